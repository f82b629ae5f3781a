"""Peak memory of an overlapped backward against the same model without DBO, on the CPU.

    .venv/bin/python benchmarks/backward_memory.py                  # 16 linears of 1024 x 1024
    .venv/bin/python benchmarks/backward_memory.py --wrapper fsdp   # FSDP2 on 2 gloo ranks
    .venv/bin/python benchmarks/backward_memory.py --wrapper none,ddp,fsdp --json

A stack of `--layers` bias-free linears (fp32 parameters: `--layers` x 4 MiB at the
default width) and a small batch, so the parameters' gradients dominate what a backward
allocates; `--wrapper` (a comma-separated list: one model each) puts it in DDP, or
shards each linear and the root with FSDP2, on 2 gloo ranks (only `none`: one process).
After a warm-up, each mode's forward and backward peaks are measured as the process's
resident-set high-water mark (Linux: reset through /proc/self/clear_refs before, read
from /proc/self/status after) above the resident set
when each starts, with glibc's mmap threshold fixed at 64 KiB so that a freed tensor
leaves the resident set at once (on CUDA: the caching allocator's peak of allocated
bytes; under torchrun, NCCL); per mode the median over `--rounds`, the largest over
the ranks. Modes: the whole batch without DBO, the two halves in turn (one backward
through both), and `dbo.overlap` (each ubatch's backward in its thread). Printed in MiB
and in copies of the model's parameter bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _harness  # noqa: E402 - the examples' launcher

import comm  # noqa: E402
import dbo  # noqa: E402

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(size: int = 64 * 1024) -> bool:
    """Make glibc map every allocation of `size` bytes or more on its own (and unmap it
    when freed); False where that cannot be set (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    return bool(ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, size))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mib(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """`fn()`, and the peak while it runs above the memory in use before it: the resident
    set on the CPU, the caching allocator's allocated bytes on CUDA."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, (torch.cuda.max_memory_allocated(device) - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the current RSS
    before = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - before) / 1024


def _wrapped(wrapper: str, model: torch.nn.Sequential) -> torch.nn.Module:
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        return fully_shard(model)
    return model


def measure(args: argparse.Namespace, wrapper: str, device: torch.device) -> dict[str, float]:
    """This rank's medians, in MiB: the model's parameters, and each mode's peak."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                                  for _ in range(args.layers)]).to(device)
    param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    wrapped = _wrapped(wrapper, model)
    x = torch.randn(args.rows, args.width, device=device)
    overlapped = dbo.overlap(wrapped, timeout_s=args.timeout_s)
    forwards: dict[str, Callable[[], torch.Tensor]] = {
        "whole": lambda: wrapped(x),
        "in_turn": lambda: torch.cat([wrapped(part) for part in x.tensor_split(2)]),
        "dbo": lambda: overlapped(x),
    }
    peaks: dict[str, list[float]] = {f"{mode}_{part}_mib": [] for mode in forwards
                                     for part in ("forward", "backward")}
    for forward in forwards.values():  # warm up: threads, DDP's buckets, FSDP2's state
        forward().square().sum().backward()
    gc.collect()
    gc.freeze()  # each measurement's gc.collect() then scans only what it made, not torch's
    try:
        for _ in range(args.rounds):
            for mode, forward in forwards.items():
                wrapped.zero_grad(set_to_none=True)
                loss, forward_mib = peak_mib(
                    lambda forward=forward: forward().square().sum(), device)
                _, backward_mib = peak_mib(loss.backward, device)
                peaks[f"{mode}_forward_mib"].append(forward_mib)
                peaks[f"{mode}_backward_mib"].append(backward_mib)
                del loss
    finally:
        gc.unfreeze()
    return {"param_mib": param_mib, **{key: statistics.median(v) for key, v in peaks.items()}}


def rank_main(args: argparse.Namespace) -> None:
    _, _, device = comm.init_distributed()  # the world `_harness.launch` made
    if device.type == "cpu" and not fix_mmap_threshold():
        raise SystemExit("backward_memory.py needs glibc (mallopt) on the CPU")
    result: dict[str, Any] = {"device": device.type, "ranks": dist.get_world_size(),
                              "wrappers": {}}
    for wrapper in args.wrappers:
        mine = measure(args, wrapper, device)
        keys = sorted(mine)
        largest = _harness.gather([mine[key] for key in keys], device).max(dim=0).values
        result["wrappers"][wrapper] = dict(zip(keys, largest.tolist()))
    if dist.get_rank() != 0:
        return
    for wrapper, peaks in result["wrappers"].items():
        param = peaks["param_mib"]
        print(f"{wrapper}: parameters {param:.1f} MiB; peaks above the start, largest over "
              f"{result['ranks']} rank(s), in MiB and in parameter copies:")
        print(f"  {'mode':<8} {'forward':>16} {'backward':>16}")
        for mode in ("whole", "in_turn", "dbo"):
            mibs = [peaks[f"{mode}_{part}_mib"] for part in ("forward", "backward")]
            cells = [f"{mib:7.1f} = {mib / param:.2f}x" for mib in mibs]
            print(f"  {mode.replace('_', ' '):<8} {cells[0]:>16} {cells[1]:>16}")
    if args.json:
        print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wrapper", default="none",
                        help="none, ddp or fsdp (per linear and at the root), or several, "
                        "comma-separated (default none)")
    parser.add_argument("--layers", type=int, default=16, help="linears (default 16)")
    parser.add_argument("--width", type=int, default=1024, help="their width (default 1024)")
    parser.add_argument("--rows", type=int, default=64, help="batch rows (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="backwards per mode (median)")
    _harness.add_common_args(parser, default_out="bench-out/backward_memory")
    args = parser.parse_args()
    args.wrappers = args.wrapper.split(",")
    unknown = set(args.wrappers) - {"none", "ddp", "fsdp"}
    if unknown:
        parser.error(f"--wrapper takes none, ddp and fsdp, not {', '.join(sorted(unknown))}")
    if not Path("/proc/self/clear_refs").exists() and not torch.cuda.is_available():
        raise SystemExit("backward_memory.py needs Linux's /proc on the CPU")
    if args.spawn is None and "RANK" not in os.environ:
        args.spawn = 1 if args.wrappers == ["none"] else 2
    _harness.launch(rank_main, args)


if __name__ == "__main__":
    main()
