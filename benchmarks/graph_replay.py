"""Eager DBO next to graph-replayed DBO (`dbo.capture_graph`) at decode sizes, on one GPU.

    python benchmarks/graph_replay.py                    # needs CUDA; seconds
    python benchmarks/graph_replay.py --tokens 16,64,256 --layers 16 --json

Model: `--layers` layers, each a bf16 MLP (hidden -> ffn -> hidden, GELU, residual) and a
transfer of `--link-us` on `comm.EmulatedLink` (a sleep kernel on the ubatch's comm
stream): a decode step with one exchange per layer. At decode sizes a layer's kernels
take microseconds, so eager DBO is bound by the host (launches, baton handoffs); a
replay launches the whole step at once. Per batch size (tokens, 2 ubatches), timed
interleaved round by round, `--steps` steps back to back:

    eager DBO      `dbo.overlap(fn)(x)`
    graph DBO      `dbo.capture_graph(fn, x)(x)`: copy into the static input, replay
    graph, whole   the whole batch without DBO, captured with `torch.cuda.graph`

The replay is checked bitwise equal to eager DBO on the same input first; a mismatch
makes the exit status 1 (after the table and the JSON line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import dbo
from comm import EmulatedLink

Step = Callable[[], object]


def make_model(
    layers: int, hidden: int, ffn: int, link: EmulatedLink, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-ubatch forward (plain model code: the dbo calls are no-ops outside one)."""
    generator = torch.Generator(device=device).manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, device=device, generator=generator) / rows**0.5
        return w.to(torch.bfloat16)

    weights = [(weight(hidden, ffn), weight(ffn, hidden)) for _ in range(layers)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for w1, w2 in weights:
            x = x + torch.nn.functional.gelu(x @ w1) @ w2
            dbo.switch_to_comm()
            handle = link.transfer(x)
            dbo.yield_and_switch_to_compute()  # the other ubatch computes meanwhile
            x = handle.wait()
        return x

    return forward


def whole_batch_graph(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Step:
    """`fn` on the whole batch captured with `torch.cuda.graph` (warmed up on a side
    stream first, as torch's docs ask); the step copies `x` in and replays."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x)

    def step() -> torch.Tensor:
        static_x.copy_(x)
        graph.replay()
        return static_y

    return step


def ms_per_step(step: Step, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def measure(
    fn: Callable[[torch.Tensor], torch.Tensor], tokens: int, hidden: int, steps: int,
    rounds: int,
) -> dict[str, float | int | bool]:
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    overlapped = dbo.overlap(fn, num_ubatches=2)
    eager = overlapped(x)
    graph = dbo.capture_graph(fn, x.clone(), num_ubatches=2)
    replayed = graph(x)
    bitwise = torch.equal(replayed, eager)
    max_diff = (replayed.float() - eager.float()).abs().max().item()
    modes: dict[str, Step] = {
        "eager_dbo": lambda: overlapped(x), "graph_dbo": lambda: graph(x),
        "graph_whole": whole_batch_graph(fn, x),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, step in modes.items():
            times[name].append(ms_per_step(step, steps))
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {
        "tokens": tokens, **{f"{name}_ms": value for name, value in ms.items()},
        "graph_speedup": ms["eager_dbo"] / ms["graph_dbo"],
        "dbo_vs_whole": ms["graph_whole"] / ms["graph_dbo"],
        "bitwise_equal": bitwise, "max_abs_diff": max_diff,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", default="16,32,64,128,256", help="batch sizes, comma-separated"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--link-us", type=float, default=30.0, help="transfer per layer")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_replay.py needs a CUDA device (torch.cuda.is_available() is False)")
    link = EmulatedLink(latency_s=args.link_us / 1e6)
    link.calibrate()  # the sleep kernel's clock, before anything is captured
    fn = make_model(args.layers, args.hidden, args.ffn, link, torch.device("cuda"))
    print(
        f"{torch.cuda.get_device_name()}: {args.layers} layers, bf16 {args.hidden}x{args.ffn} "
        f"MLP + {args.link_us:g} us link per layer, 2 ubatches; ms per step, median of "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(f"{'tokens':>6} {'eager DBO':>10} {'graph DBO':>10} {'graph, whole':>13} "
          f"{'eager/graph':>12} {'whole/DBO':>10} {'bitwise':>8}")
    rows = []
    for tokens in (int(size) for size in args.tokens.split(",")):
        with torch.no_grad():  # decode: no autograd graph
            row = measure(fn, tokens, args.hidden, args.steps, args.rounds)
        rows.append(row)
        print(f"{tokens:>6} {row['eager_dbo_ms']:>10.3f} {row['graph_dbo_ms']:>10.3f} "
              f"{row['graph_whole_ms']:>13.3f} {row['graph_speedup']:>11.2f}x "
              f"{row['dbo_vs_whole']:>9.2f}x {str(row['bitwise_equal']):>8}")
    dbo.close_default_runners()
    if args.json:
        print(json.dumps({
            "gpu": torch.cuda.get_device_name(), "layers": args.layers, "hidden": args.hidden,
            "ffn": args.ffn, "link_us": args.link_us, "rows": rows,
            "cuda_alloc_retries": torch.cuda.memory_stats()["num_alloc_retries"],
        }))
    if not all(row["bitwise_equal"] for row in rows):
        print("graph replay differs from eager DBO on the same input", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
