"""Host time dbo and comm add per call, against the bare operations in the same run.

    taskset -c 0 .venv/bin/python benchmarks/host_overhead.py [--calls 300] [--rounds 31] [--json]

On a GPU the host only launches kernels; when it cannot stay ahead of them (small decode
steps, many layers), every microsecond the runtime spends per collective or per overlap
call is step time. This measures those microseconds on the host, in one process (a gloo
world of one: a collective is a local copy, so what is timed is the Python and c10d
path, not a transfer):

  collective, outside an overlap:  `comm.all_to_all_single` vs `dist.all_to_all_single`
  collective, inside an overlap:   2 ubatches, each call one handoff:
                                   `comm.all_to_all_single` vs `dist` async + `dbo.yield_()`
                                   + `wait()` (the same schedule written by hand)
  overlap call:                    `dbo.overlap(identity)` on 2 ubatches vs the floor of
                                   any thread-per-ubatch runtime: two persistent threads
                                   woken by the baton's kind of wake-up (eventfd), plus
                                   the same split (`tensor_split`) and merge (`torch.cat`)

Rounds interleave the variants, in a new shuffled order each round; the table shows
medians (us per call) and "added", the median over rounds of each round's difference
(paired, so the host's drift cancels). Pin to one core (`taskset -c 0`): a handoff that
wakes a thread on the other core costs several times more on a 2-core VM and would swamp
the differences.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import comm  # noqa: E402
import dbo  # noqa: E402
from dbo.runtime.wakeup import new_wakeup  # noqa: E402


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


class BareThreads:
    """Two persistent threads, each started per call and parked between turns on the
    wake-ups dbo's baton uses (`dbo.runtime.wakeup`: an eventfd on Linux), joined through
    `_thread` locks: what any runtime running each ubatch in its own thread pays per
    call, at least."""

    def __init__(self, body: Callable[[int], Any]) -> None:
        self._body = body
        self._start = [new_wakeup(), new_wakeup()]
        self._turn = [new_wakeup(), new_wakeup()]
        self._done = [_thread.allocate_lock(), _thread.allocate_lock()]
        for lock in self._done:
            lock.acquire()
        self.results: list[Any] = [None, None]
        for me in (0, 1):
            threading.Thread(target=self._loop, args=(me,), daemon=True).start()

    def run(self) -> list[Any]:
        for wakeup in self._start:
            wakeup.set()
        self._turn[0].set()
        for lock in self._done:
            if not lock.acquire(timeout=30):
                raise RuntimeError("a benchmark thread did not finish in 30 s")
        return self.results

    def handoff(self, me: int) -> None:
        """What `dbo.yield_()` does: wake the other thread, park until it hands back."""
        self._turn[1 - me].set()
        self._turn[me].wait()

    def _loop(self, me: int) -> None:
        torch.set_num_threads(1)
        while True:
            self._start[me].wait()
            self._turn[me].wait()
            self.results[me] = self._body(me)
            if me == 0:
                self._turn[1].set()  # ubatch 0 is done: ubatch 1's turn
            self._done[me].release()


def _shuffled(variants: dict[str, Any], round_index: int) -> list[str]:
    """The variants in a new order each round (seeded): a fixed order put each variant
    right after the same other one every round, and what runs first pays for it."""
    order = list(variants)
    random.Random(round_index).shuffle(order)
    return order


Row = tuple[str, float, float, float]
"""(label, ours us/call, bare us/call, added us/call)."""


def _row(label: str, ours: list[float], bare: list[float]) -> Row:
    """Medians, and the median of the per-round differences (paired: a round's host
    load is the same for both, so this moves less than the difference of medians)."""
    added = statistics.median(a - b for a, b in zip(ours, bare))
    return label, statistics.median(ours), statistics.median(bare), added


def collective_rows(calls: int, rounds: int) -> list[Row]:
    """One row for a collective outside an overlap, one for inside."""
    x = torch.randn(8, 16)
    out = torch.empty_like(x)
    groups = comm.ubatch_groups(None, 2)  # the duplicates comm uses inside an overlap

    def raw_inside() -> None:
        group = groups[dbo.current_ubatch_id()]
        for _ in range(calls):
            handle = dist.all_to_all_single(out_local(), x, group=group, async_op=True)
            dbo.yield_()
            handle.wait()

    def comm_inside() -> None:
        for _ in range(calls):
            comm.all_to_all_single(out_local(), x)

    outs = [torch.empty_like(x), torch.empty_like(x)]

    def out_local() -> torch.Tensor:
        return outs[dbo.current_ubatch_id()]

    samples: dict[str, list[float]] = {name: [] for name in ("dist", "comm", "raw in", "comm in")}
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {}), ((), {})]

        def inside(fn: Callable[[], None]) -> float:
            start = time.perf_counter()
            runner.run(fn, inputs)
            return (time.perf_counter() - start) / (2 * calls) * 1e6

        variants: dict[str, Callable[[], float]] = {
            "dist": lambda: _per_call_us(lambda: dist.all_to_all_single(out, x), calls),
            "comm": lambda: _per_call_us(lambda: comm.all_to_all_single(out, x), calls),
            "raw in": lambda: inside(raw_inside),
            "comm in": lambda: inside(comm_inside),
        }
        for round_index in range(rounds):
            for name in _shuffled(variants, round_index):
                samples[name].append(variants[name]())
    return [
        _row("all_to_all_single, outside an overlap", samples["comm"], samples["dist"]),
        _row("all_to_all_single, inside (1 handoff each)", samples["comm in"], samples["raw in"]),
    ]


def overlap_call_row(calls: int, rounds: int) -> Row:
    """`dbo.overlap` against bare threads + the same split and merge."""
    x = torch.randn(64, 16)
    parts: list[torch.Tensor] = []
    bare = BareThreads(lambda me: parts[me])

    def bare_call() -> torch.Tensor:
        parts[:] = x.tensor_split(2)
        return torch.cat(bare.run())

    overlapped = dbo.overlap(lambda t: t)
    samples: dict[str, list[float]] = {"dbo": [], "bare": []}
    _per_call_us(lambda: overlapped(x), 100)  # warm up: the runner's threads start
    _per_call_us(bare_call, 100)
    variants = {"dbo": lambda: overlapped(x), "bare": bare_call}
    for round_index in range(rounds):
        for name in _shuffled(variants, round_index):
            samples[name].append(_per_call_us(variants[name], calls))
    return _row("dbo.overlap(identity), 2 ubatches", samples["dbo"], samples["bare"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed sample")
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds")
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm.init_distributed(backend="gloo", allow_single_process=True)
    try:
        for _ in range(2):  # warm up: first calls build caches, threads, groups
            rows = collective_rows(max(args.calls // 10, 1), 1)
        rows = collective_rows(args.calls, args.rounds)
        rows.append(overlap_call_row(args.calls, args.rounds))
    finally:
        comm.destroy_distributed()
    print(f"host us per call (medians of {args.rounds} interleaved rounds of {args.calls} calls)")
    print(f"{'':<44}{'dbo/comm':>9}{'bare':>8}{'added':>8}")
    for label, ours, bare_us, added in rows:
        print(f"{label:<44}{ours:9.1f}{bare_us:8.1f}{added:8.1f}")
    if args.json:
        keys = ("label", "ours_us", "bare_us", "added_us")
        table = [dict(zip(keys, row)) for row in rows]
        print(json.dumps({"calls": args.calls, "rounds": args.rounds, "rows": table}))


if __name__ == "__main__":
    main()
