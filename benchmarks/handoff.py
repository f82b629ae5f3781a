"""Cost of one baton handoff, against raw thread ping-pongs measured in the same run.

    .venv/bin/python benchmarks/handoff.py [--handoffs 20000] [--rounds 5] [--json]

Prints microseconds per handoff for:
  - dbo: two ubatches calling `dbo.yield_()` in a loop (one yield = one handoff);
  - raw lock: two threads ping-ponging with `_thread` locks (the floor for a handoff
    through locks; the baton's eventfd wake-ups, `dbo.runtime.wakeup`, beat it on Linux by
    waking the next thread with the GIL already released);
  - Event ring: the same with `threading.Event` (what a naive implementation uses);
and the ratios to the raw lock. Rounds interleave the three; the table shows medians
(`--json`: then one JSON line of them).
"""

from __future__ import annotations

import _thread
import argparse
import json
import statistics
import threading
import time

import torch

import dbo


def raw_lock_ping_pong(num_handoffs: int) -> float:
    locks = [_thread.allocate_lock(), _thread.allocate_lock()]
    for lock in locks:
        lock.acquire()
    per_thread = num_handoffs // 2

    def player(me: int) -> None:
        other = 1 - me
        for _ in range(per_thread):
            locks[me].acquire()
            locks[other].release()

    threads = [threading.Thread(target=player, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    locks[0].release()
    for thread in threads:
        thread.join(timeout=60)
    return (time.perf_counter() - start) / (2 * per_thread)


def event_ring(num_handoffs: int) -> float:
    events = [threading.Event(), threading.Event()]
    per_thread = num_handoffs // 2

    def player(me: int) -> None:
        other = 1 - me
        for _ in range(per_thread):
            events[me].wait()
            events[me].clear()
            events[other].set()

    threads = [threading.Thread(target=player, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    events[0].set()
    for thread in threads:
        thread.join(timeout=60)
    return (time.perf_counter() - start) / (2 * per_thread)


def dbo_yield(runner: dbo.UBatchRunner, num_handoffs: int) -> float:
    per_ubatch = num_handoffs // 2

    def fn() -> None:
        for _ in range(per_ubatch):
            dbo.yield_()

    start = time.perf_counter()
    runner.run(fn, [((), {}), ((), {})])
    return (time.perf_counter() - start) / (2 * per_ubatch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {"dbo.yield_()": [], "raw _thread lock": [], "Event ring": []}
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        dbo_yield(runner, 1000)  # warm up
        for _ in range(args.rounds):
            results["raw _thread lock"].append(raw_lock_ping_pong(args.handoffs))
            results["dbo.yield_()"].append(dbo_yield(runner, args.handoffs))
            results["Event ring"].append(event_ring(args.handoffs))
    floor = statistics.median(results["raw _thread lock"])
    print(f"{'handoff':<20} {'us/handoff':>11} {'x raw lock':>11}")
    medians = {name: statistics.median(samples) for name, samples in results.items()}
    for name, median in medians.items():
        print(f"{name:<20} {median * 1e6:>11.2f} {median / floor:>11.2f}")
    if args.json:
        keys = {"dbo.yield_()": "dbo", "raw _thread lock": "raw_lock", "Event ring": "event_ring"}
        us = {keys[name]: median * 1e6 for name, median in medians.items()}
        print(json.dumps({"handoffs": args.handoffs, "rounds": args.rounds, "us_per_handoff": us}))


if __name__ == "__main__":
    main()
