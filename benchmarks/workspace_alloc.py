"""Cost per call of `WorkspaceManager.get_simultaneous` next to plain `torch.empty`.

Run it with:

    .venv/bin/python benchmarks/workspace_alloc.py            # a few seconds
    .venv/bin/python benchmarks/workspace_alloc.py --rounds 15 --calls 5000
    .venv/bin/python benchmarks/workspace_alloc.py --json     # + one JSON line at the end

For each set of three tensors it times, in the same run and interleaved round by round:

    workspace     one `get_simultaneous(r0, r1, r2)` on a warmed-up manager
    torch.empty   three `torch.empty(shape, dtype=..., device=...)` calls
    slice+view    the straightforward way to carve a preallocated byte buffer: compute the
                  offsets, then `buffer[start:end].view(dtype).reshape(shape)` per tensor

on CPU, and on CUDA when it is available. Each round times `--calls` calls of every method
(in a new shuffled order each round); the table shows the median over rounds of the time
per call, and the ratios to `torch.empty` (below 1: cheaper than allocating). Nothing is
asserted: the numbers depend on the machine. With CUDA, --json also gives
`torch.cuda.memory_stats()["num_alloc_retries"]` at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from workspace import ALIGNMENT_BYTES, WorkspaceManager

Request = tuple[tuple[int, ...], torch.dtype]

CASES: dict[str, tuple[Request, Request, Request]] = {
    "small: (64,128) f32, (64,128) bf16, (64,) i64": (
        ((64, 128), torch.float32),
        ((64, 128), torch.bfloat16),
        ((64,), torch.int64),
    ),
    "large: (4096,1024) bf16, (4096,1024) f32, (4096,) i64": (
        ((4096, 1024), torch.bfloat16),
        ((4096, 1024), torch.float32),
        ((4096,), torch.int64),
    ),
}


def _nbytes(request: Request) -> int:
    shape, dtype = request
    return math.prod(shape) * dtype.itemsize


def _slice_view(buffer: torch.Tensor, requests: Sequence[Request]) -> list[torch.Tensor]:
    """The straightforward carving of a byte buffer, as one would write it inline."""
    views = []
    offset = 0
    for shape, dtype in requests:
        num_bytes = math.prod(shape) * dtype.itemsize
        views.append(buffer[offset : offset + num_bytes].view(dtype).reshape(shape))
        offset += -(-num_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    return views


def _methods(
    device: torch.device, requests: tuple[Request, Request, Request]
) -> dict[str, Callable[[], object]]:
    (s0, d0), (s1, d1), (s2, d2) = requests
    manager = WorkspaceManager(device)
    get = manager.get_simultaneous
    get(*requests)  # warm up: the capacity suffices from now on
    manager.lock()  # and the benchmark would fail loudly if it did not
    buffer = torch.empty(
        (sum(-(-_nbytes(r) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES for r in requests),),
        dtype=torch.uint8,
        device=device,
    )
    empty = torch.empty

    def workspace() -> object:
        return get(*requests)

    def torch_empty() -> object:
        return (
            empty(s0, dtype=d0, device=device),
            empty(s1, dtype=d1, device=device),
            empty(s2, dtype=d2, device=device),
        )

    def slice_view() -> object:
        return _slice_view(buffer, requests)

    return {"workspace": workspace, "torch.empty": torch_empty, "slice+view": slice_view}


def _time_per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter_ns() - start) / calls / 1e3


def measure(
    device: torch.device, requests: tuple[Request, Request, Request], rounds: int, calls: int
) -> dict[str, float]:
    """Median over `rounds` of the per-call microseconds of each method."""
    methods = _methods(device, requests)
    names = list(methods)
    for fn in methods.values():  # warm caches and allocators
        _time_per_call_us(fn, max(calls // 10, 10), device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for round_index in range(rounds):
            # A new order each round (seeded): a rotation kept each method right after
            # the same other one in most rounds.
            order = list(names)
            random.Random(round_index).shuffle(order)
            for name in order:
                samples[name].append(_time_per_call_us(methods[name], calls, device))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per case (default 7)")
    parser.add_argument(
        "--calls", type=int, default=2000, help="calls per method per round (default 2000)"
    )
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be >= 1")

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{args.rounds} rounds x {args.calls} calls, median per call over rounds"
    )
    if not torch.cuda.is_available():
        print("CUDA not available: CPU only")
    header = (
        f"{'device':6}  {'case':54}  {'workspace':>10}  {'torch.empty':>11}  "
        f"{'slice+view':>10}  {'ws/empty':>8}  {'slice/empty':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    rows = []
    for device in devices:
        for case, requests in CASES.items():
            us = measure(device, requests, args.rounds, args.calls)
            rows.append({
                "device": device.type, "case": case.split(":")[0], "workspace_us": us["workspace"],
                "empty_us": us["torch.empty"], "slice_view_us": us["slice+view"],
            })
            print(
                f"{device.type:6}  {case:54}  {us['workspace']:8.2f}us  "
                f"{us['torch.empty']:9.2f}us  {us['slice+view']:8.2f}us  "
                f"{us['workspace'] / us['torch.empty']:8.2f}  "
                f"{us['slice+view'] / us['torch.empty']:11.2f}"
            )
    print()
    print("ratios < 1: cheaper than allocating with torch.empty (lower is better)")
    result: dict[str, object] = {"rounds": args.rounds, "calls": args.calls, "rows": rows}
    if torch.cuda.is_available():  # cudaMalloc failures the caching allocator retried
        result["cuda_alloc_retries"] = torch.cuda.memory_stats()["num_alloc_retries"]
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
