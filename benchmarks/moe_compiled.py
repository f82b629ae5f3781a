"""The demo MoE model compiled (`torch.compile(fullgraph=True)`) against eager, under DBO
and on the ubatches in turn, side by side.

    .venv/bin/python benchmarks/moe_compiled.py                # 2 gloo ranks, inductor
    .venv/bin/python benchmarks/moe_compiled.py --backend aot_eager --json
    torchrun --nproc-per-node 2 benchmarks/moe_compiled.py     # NCCL on GPUs

The model of `examples/moe_overlap.py` on the fixed-shape path (capacity = the tokens of
a ubatch: nothing dropped), whose exchanges compile as nodes (`comm.moe.compiled`). It is
compiled once on the caller's thread, on a ubatch's shape; the ubatch threads then run
the compiled code. Four modes run interleaved, step by step, under `torch.no_grad()`
(per step the slowest rank; printed: the median): eager and compiled, each in turn (the
two halves one after the other) and under `dbo.overlap`. Also printed: the graph breaks
(`torch._dynamo.explain`), the baton's turns per ubatch in a compiled DBO step, and
whether compiled DBO equals compiled in turn bit for bit.
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
from moe_overlap import MoEModel, add_model_args  # noqa: E402

import comm  # noqa: E402
import dbo  # noqa: E402

MODES = ("eager in turn", "eager DBO", "compiled in turn", "compiled DBO")


def _in_turn(fn: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(part) for part in x.tensor_split(2)])


def rank_main(args: argparse.Namespace) -> None:
    rank, _, device = comm.init_distributed()
    torch.manual_seed(1234 + rank)
    half = args.tokens // 2
    model = MoEModel(args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk,
                     half).to(device)
    x = torch.randn(args.tokens, args.hidden, device=device)
    compiled = torch.compile(model, fullgraph=True, backend=args.backend)
    with torch.no_grad():
        breaks = torch._dynamo.explain(model)(x[:half]).graph_break_count
        want = _in_turn(compiled, x)  # compiles on this thread, on a ubatch's shape
        with dbo.trace() as timeline:
            got = dbo.overlap(compiled)(x)
        turns = {ubatch: total.turns for ubatch, total in timeline.totals().items()}
        close = torch.allclose(want, _in_turn(model, x), atol=1e-4)
        steps = {
            "eager in turn": lambda: _in_turn(model, x),
            "eager DBO": lambda: dbo.overlap(model)(x),
            "compiled in turn": lambda: _in_turn(compiled, x),
            "compiled DBO": lambda: dbo.overlap(compiled)(x),
        }
        for step in steps.values():
            step()  # warm up
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.steps):
            for mode in MODES:
                times[mode].append(_harness.step_ms(steps[mode], device))
    flat = [value for mode in MODES for value in times[mode]]
    slowest = _harness.gather(flat, device).max(dim=0).values.view(len(MODES), args.steps)
    median = {mode: statistics.median(row.tolist()) for mode, row in zip(MODES, slowest)}
    if rank != 0:
        return
    result = {
        "backend": args.backend, "tokens": args.tokens, "graph_breaks": breaks,
        "turns": turns, "equal": torch.equal(got, want), "close_to_eager": close,
        "ms": median,
    }
    for mode in MODES:
        print(f"{mode:<17} {median[mode]:8.2f} ms")
    print(f"graph breaks {breaks}; compiled DBO turns per ubatch {turns}; equal to compiled "
          f"in turn: {result['equal']}; compiled close to eager: {close}")
    if args.json:
        print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    _harness.add_common_args(parser, default_out="bench-out/moe_compiled")
    args = parser.parse_args()
    if args.spawn is None and "RANK" not in __import__("os").environ:
        args.spawn = 2  # a fresh machine: 2 gloo ranks, as `make bench` runs it
    _harness.launch(rank_main, args)


if __name__ == "__main__":
    main()
