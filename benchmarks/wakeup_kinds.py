"""The baton's wake-up kinds side by side: eventfd (Linux default) vs `_thread` lock.

    taskset -c 0 .venv/bin/python benchmarks/wakeup_kinds.py   # one core
    .venv/bin/python benchmarks/wakeup_kinds.py                # let the OS place threads
    .venv/bin/python benchmarks/wakeup_kinds.py --json         # + one JSON line at the end

Two `UBatchRunner`s, identical except for the kind of wake-up their workers (and so
their batons) park on, run the same calls in interleaved rounds:
  - `identity`: one overlapped call that does nothing (the per-call cost: wake the
    workers, pass the baton twice, signal the caller);
  - `100 handoffs`: each of the 2 ubatches calls `dbo.yield_()` 50 times;
  - `+ k matmuls`: the same with k 64x64 matmuls per turn (torch drops the GIL around
    each op, where an eventfd setter still waiting for the GIL takes it to park: these
    rows show whether that delays the ubatch that woke).
Printed: microseconds per call for each kind, the median of the per-round ratios
eventfd / lock (paired: the host's drift cancels), and the context switches per call
(`getrusage`: voluntary + involuntary, whole process).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import dbo
from dbo.runtime import wakeup


def _runner_with(kind: type) -> dbo.UBatchRunner:
    """A runner whose workers park on wake-ups of `kind` (each worker asks
    `wakeup.new_wakeup` for its wake-up when the runner is created)."""
    default = wakeup.new_wakeup
    wakeup.new_wakeup = kind  # type: ignore[assignment]
    try:
        return dbo.UBatchRunner(num_ubatches=2)
    finally:
        wakeup.new_wakeup = default


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def _time(runner: dbo.UBatchRunner, fn: Callable[[Any], Any], calls: int) -> tuple[float, float]:
    """(us per call, context switches per call) for `calls` runs of `fn`."""
    inputs = [((None,), {}), ((None,), {})]
    switches = _switches()
    start = time.perf_counter()
    for _ in range(calls):
        runner.run(fn, inputs)
    elapsed = time.perf_counter() - start
    return elapsed / calls * 1e6, (_switches() - switches) / calls


def _identity(x: Any) -> Any:
    return x


_MATRIX = torch.randn(64, 64)


def _yields_with_matmuls(num_matmuls: int) -> Callable[[Any], Any]:
    """50 `dbo.yield_()` per ubatch, each after `num_matmuls` 64x64 matmuls."""

    def fn(x: Any) -> Any:
        for _ in range(50):
            y = _MATRIX
            for _ in range(num_matmuls):
                y = y @ _MATRIX
            dbo.yield_()
        return x

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args()
    if wakeup.EventfdWakeup not in wakeup.kinds():
        reason = "no eventfd on this platform: the baton uses locks, nothing to compare"
        if args.json:
            print(json.dumps({"skipped": reason}))
            return
        raise SystemExit(reason)
    torch.set_num_threads(1)
    runners = {
        "lock": _runner_with(wakeup.LockWakeup),
        "eventfd": _runner_with(wakeup.EventfdWakeup),
    }
    print(f"{'call':<14}{'lock us':>9}{'eventfd us':>12}{'eventfd/lock':>14}"
          f"{'switches: lock':>16}{'eventfd':>9}")
    rows = []
    try:
        cases = (
            ("identity", _identity, 300),
            ("100 handoffs", _yields_with_matmuls(0), 40),
            ("+ 1 matmul", _yields_with_matmuls(1), 20),
            ("+ 5 matmuls", _yields_with_matmuls(5), 10),
        )
        for name, fn, calls in cases:
            for runner in runners.values():
                _time(runner, fn, calls // 10)  # warm up
            samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in runners}
            for round_index in range(args.rounds):
                order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
                for kind in order:
                    samples[kind].append(_time(runners[kind], fn, calls))
            lock_us = [us for us, _ in samples["lock"]]
            eventfd_us = [us for us, _ in samples["eventfd"]]
            ratio = statistics.median(e / lo for e, lo in zip(eventfd_us, lock_us))
            rows.append({
                "call": name, "lock_us": statistics.median(lock_us),
                "eventfd_us": statistics.median(eventfd_us), "eventfd_over_lock": ratio,
            })
            print(
                f"{name:<14}{statistics.median(lock_us):9.1f}{statistics.median(eventfd_us):12.1f}"
                f"{ratio:14.2f}{statistics.median(s for _, s in samples['lock']):16.1f}"
                f"{statistics.median(s for _, s in samples['eventfd']):9.1f}"
            )
    finally:
        for runner in runners.values():
            runner.close()
    if args.json:
        print(json.dumps({"rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
