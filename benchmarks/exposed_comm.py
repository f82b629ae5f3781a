"""The gradient communication a backward leaves exposed under DDP and FSDP2, with DBO and
without, side by side.

    .venv/bin/python benchmarks/exposed_comm.py              # 2 gloo ranks, 8 linears of 1024
    .venv/bin/python benchmarks/exposed_comm.py --json
    torchrun --nproc-per-node 2 benchmarks/exposed_comm.py   # NCCL on GPUs

A stack of `--layers` bias-free linears in DDP, or sharded per linear and at the root
with FSDP2. For each wrapper and mode (the whole batch; `dbo.overlap`) the backward is
timed with the wrapper's gradient reduction (DDP's all-reduces, FSDP2's
reduce-scatters) and without it (`no_sync()`, `set_requires_gradient_sync(False)`),
interleaved step by step, per step the slowest rank: the difference of the medians is
the communication the backward did not hide. DDP reduces a bucket as soon as its
gradients are ready; under DBO its buckets reduce only after the overlapped backward,
while FSDP2's units reduce-scatter as each unit's ubatches are done (`dbo/fsdp.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _harness  # noqa: E402 - the examples' launcher and step timer

import comm  # noqa: E402
import dbo  # noqa: E402

WRAPPERS = ("ddp", "fsdp")
MODES = ("whole", "dbo")


def _wrapped(wrapper: str, args: argparse.Namespace, device: torch.device) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                                  for _ in range(args.layers)]).to(device)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


@contextlib.contextmanager
def _without_sync(wrapper: str, model: Any) -> Iterator[None]:
    if wrapper == "ddp":
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _backward_ms(
    wrapper: str, model: Any, forward: Callable[[], torch.Tensor], sync: bool,
    device: torch.device,
) -> float:
    model.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if sync else _without_sync(wrapper, model):
        loss = forward().square().sum()
        return _harness.step_ms(loss.backward, device)


def rank_main(args: argparse.Namespace) -> None:
    rank, _, device = comm.init_distributed()
    x = torch.randn(args.rows, args.width, device=device)
    keys, times = [], []
    for wrapper in WRAPPERS:
        model = _wrapped(wrapper, args, device)
        overlapped = dbo.overlap(model, timeout_s=args.timeout_s)
        forwards = {"whole": lambda model=model: model(x),
                    "dbo": lambda overlapped=overlapped: overlapped(x)}
        runs = [(mode, sync) for mode in MODES for sync in (True, False)]
        for mode, sync in runs:  # warm up
            _backward_ms(wrapper, model, forwards[mode], sync, device)
        measured: dict[Any, list[float]] = {run: [] for run in runs}
        for _ in range(args.steps):
            for mode, sync in runs:
                measured[(mode, sync)].append(
                    _backward_ms(wrapper, model, forwards[mode], sync, device))
        keys += [(wrapper, *run) for run in runs]
        times += [measured[run] for run in runs]
    flat = [value for row in times for value in row]
    slowest = _harness.gather(flat, device).max(dim=0).values.view(len(keys), args.steps)
    median = {key: statistics.median(row.tolist()) for key, row in zip(keys, slowest)}
    if rank != 0:
        return
    result: dict[str, Any] = {}
    print(f"{'wrapper':<8} {'mode':<6} {'backward ms':>12} {'without sync':>13} {'exposed':>8}")
    for wrapper in WRAPPERS:
        for mode in MODES:
            synced, unsynced = median[(wrapper, mode, True)], median[(wrapper, mode, False)]
            result.setdefault(wrapper, {})[mode] = {
                "backward_ms": synced, "without_sync_ms": unsynced,
                "exposed_ms": synced - unsynced}
            print(f"{wrapper:<8} {mode:<6} {synced:12.2f} {unsynced:13.2f} "
                  f"{synced - unsynced:8.2f}")
    if args.json:
        print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="linears (default 8)")
    parser.add_argument("--width", type=int, default=1024, help="their width (default 1024)")
    parser.add_argument("--rows", type=int, default=256, help="batch rows (default 256)")
    _harness.add_common_args(parser, default_out="bench-out/exposed_comm")
    args = parser.parse_args()
    if args.spawn is None and "RANK" not in os.environ:
        args.spawn = 2  # a fresh machine: 2 gloo ranks, as `make bench` runs it
    _harness.launch(rank_main, args)


if __name__ == "__main__":
    main()
