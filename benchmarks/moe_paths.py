"""The fixed-shape MoE path against the dynamic one at decode-sized batches, side by side.

    .venv/bin/python benchmarks/moe_paths.py                   # 2 gloo ranks, 16/64/128 tokens
    .venv/bin/python benchmarks/moe_paths.py --tokens 64 --json
    torchrun --nproc-per-node 2 benchmarks/moe_paths.py        # NCCL on GPUs

The model of `examples/moe_overlap.py` (4 MoE layers, the same weights), built per batch
size on the dynamic path (`comm.moe.dispatch`) and on the fixed-shape path (capacity =
the tokens: nothing dropped). The whole batch and DBO of both paths run interleaved, step
by step (per step the slowest rank; printed: the median), and one whole-batch step of
each counts its host reads (`examples/_host_reads.py`; on a GPU each read waits for the
device; a DBO step makes them per ubatch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _harness  # noqa: E402 - the examples' launcher and step timer
from _host_reads import HostReads  # noqa: E402
from moe_overlap import MoEModel  # noqa: E402

import comm  # noqa: E402
import dbo  # noqa: E402

PATHS = (("dynamic", False), ("fixed", True))


def measure(args: argparse.Namespace, tokens: int, device: torch.device) -> list[dict[str, Any]]:
    """Both paths at `tokens` per rank: medians of the interleaved steps and host reads."""
    x = torch.randn(tokens, args.hidden, device=device)
    steps, reads = {}, {}
    for path, fixed in PATHS:
        model = MoEModel(args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk,
                         tokens if fixed else None).to(device)
        with torch.inference_mode(), HostReads().counting() as counter:
            model(x)
        reads[path] = counter.reads
        overlapped = dbo.overlap(model)
        steps[(path, "whole")] = lambda model=model: model(x)
        steps[(path, "dbo")] = lambda overlapped=overlapped: overlapped(x)
    with torch.inference_mode():
        for step in steps.values():
            step()  # warm up
        times: dict[Any, list[float]] = {key: [] for key in steps}
        for _ in range(args.steps):
            for key, step in steps.items():
                times[key].append(_harness.step_ms(step, device))
    flat = [value for key in steps for value in times[key]]
    slowest = _harness.gather(flat, device).max(dim=0).values.view(len(steps), args.steps)
    median = {key: statistics.median(row.tolist()) for key, row in zip(steps, slowest)}
    return [
        {"tokens": tokens, "path": path, "whole_ms": median[(path, "whole")],
         "dbo_ms": median[(path, "dbo")], "host_reads_per_step": reads[path]}
        for path, _ in PATHS
    ]


def rank_main(args: argparse.Namespace) -> None:
    rank, _, device = comm.init_distributed()
    torch.manual_seed(1234 + rank)
    rows = [row for tokens in args.token_sizes for row in measure(args, tokens, device)]
    if rank != 0:
        return
    print(f"{'tokens':>6} {'path':<8} {'whole ms':>9} {'DBO ms':>8} {'host reads/step':>16}")
    for row in rows:
        print(f"{row['tokens']:>6} {row['path']:<8} {row['whole_ms']:>9.2f} "
              f"{row['dbo_ms']:>8.2f} {row['host_reads_per_step']:>16}")
    if args.json:
        print(json.dumps({"rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64,128", help="tokens per rank, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--ffn", type=int, default=128, help="expert hidden width (default 128)")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="default 2")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    _harness.add_common_args(parser, default_out="bench-out/moe_paths")
    parser.set_defaults(steps=40)  # gloo latency dominates at these sizes: more steps
    args = parser.parse_args()
    args.token_sizes = [int(value) for value in args.tokens.split(",")]
    if args.spawn is None and "RANK" not in __import__("os").environ:
        args.spawn = 2  # a fresh machine: 2 gloo ranks, as `make bench` runs it
    _harness.launch(rank_main, args)


if __name__ == "__main__":
    main()
