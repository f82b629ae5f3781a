"""DBO vs serial vs a hand-written software pipeline, over real gloo collectives.

    .venv/bin/python benchmarks/comm_overlap.py            # spawns its own 2 gloo ranks
    .venv/bin/python benchmarks/comm_overlap.py --no-pin   # let the OS place the threads
    .venv/bin/python benchmarks/comm_overlap.py --greenlets  # + the schedule without threads
    .venv/bin/python benchmarks/comm_overlap.py --json       # + one JSON line at the end

Two ranks on loopback run a layer loop: per ubatch per layer, compute (matmuls on the
ubatch's activations) then an `all_to_all_single` of those activations. The same two
ubatches run these ways:

- serial:   ubatch 0's loop, then ubatch 1's (blocking collectives, no overlap);
- DBO:      `dbo.overlap(loop)(x)` with `comm.all_to_all_single` (per-ubatch groups);
- DBO raw:  the same overlap, but each collective written by hand on the ubatch's group:
            `dist.all_to_all_single(async_op=True)`, `dbo.yield_()`, `wait()`, so that
            DBO / DBO raw is `comm`'s share of DBO's time and DBO raw / threads the
            runtime's (its per-call work and its baton);
- pipeline: one thread, by hand: launch ubatch u's all-to-all async, compute the other
            ubatch, wait; the schedule DBO reaches without rewriting the loop;
- threads:  DBO's schedule on two bare threads, each parked on the wake-up dbo uses, no dbo;
- greenlets (`--greenlets`, needs `pip install greenlet`): the same schedule on two
            greenlets in one OS thread: ubatch switches without thread switches.
("one group": the same, with both ubatches' collectives on one process group.)

Printed per row: c and m (one ubatch's compute and all-to-all per layer, each measured
alone in this run), step times, speedup over serial, and the hidden fraction
(T_serial - T) / (T_serial - T_ideal) with T_ideal = max(C, M) + min(c, m), C and M the
totals over both ubatches. Every mode is timed in interleaved rounds (a round's time: the
best of two steps, each timed from a barrier, of the slowest rank; printed: the median
over the rounds), so the ratios share the conditions; each round runs the modes in a
new shuffled order, so that no mode keeps the same predecessor. The paired ratios (DBO's
time over another mode's in the same round) come with a 95% confidence interval of their
median (order statistics; at least 6 rounds): where it contains 1 the run cannot tell
the two apart ("tie").

The first table measures two all-to-alls in flight at once, on one group or on one
group each, against one after the other (the question behind `comm.ubatch_groups`).

Pinning: each rank is pinned to its own core (every thread of the rank: ubatch threads
and gloo's), so a baton handoff wakes the next ubatch on the core the previous one
frees; `--no-pin` lets the OS place them. gloo's transfers need CPU too (TCP loopback
copies), so on a 2-core machine the largest all-to-alls cannot hide behind compute and
the ceiling is below 2x. Compare columns within one run; the README shows current ratios.
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import multiprocessing
import os
import random
import socket
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

WORLD_SIZE = 2
HIDDEN = 64
CONFIGS = [
    # (rows per ubatch: the all-to-all moves rows x HIDDEN float32, target c / m)
    (1024, 1.0),
    (4096, 1.0),
    (4096, 2.0),
    (4096, 0.5),
]


# --------------------------------------------------------------------------- timing
def _time_ms(fn: Callable[[], Any], repeats: int = 2) -> float:
    """Best of `repeats` runs of `fn`, each started together on every rank (ms)."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _interleaved(
    modes: dict[str, Callable[[], Any]],
    rounds: int,
    ratios: tuple[tuple[str, str], ...] = (),
) -> dict[str, float]:
    """Each mode's step time over `rounds` interleaved rounds (ms): the median over the
    rounds of the round's time, which is the slowest rank's (every rank starts a timed
    step together after a barrier, and a step ends when its last rank does).

    For each `(a, b)` in `ratios`, also "a/b": the median over rounds of a's time over
    b's in the same round (paired, so a slow drift of the machine cancels); "a/b q1",
    "a/b q3": the quartiles of those per-round ratios (a round's noise); and "a/b lo",
    "a/b hi": a 95% confidence interval of that median (how well the run pins it down:
    an interval that contains 1 means the run cannot tell a from b; NaN with fewer than
    6 rounds, too few for one).
    """
    samples: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for round_index in range(rounds):
        # A new order each round (seeded by the round: the same on every rank), so that
        # no mode keeps the same predecessor (a slow serial step, say) round after round.
        order = list(names)
        random.Random(round_index).shuffle(order)
        for name in order:
            samples[name].append(_time_ms(modes[name]))
    slowest = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank gets the same rows
    per_mode = dict(zip(names, slowest.tolist()))
    result = {name: statistics.median(per_mode[name]) for name in names}
    for a, b in ratios:
        per_round = [x / y for x, y in zip(per_mode[a], per_mode[b])]
        quartiles = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        low, high = _median_interval(per_round)
        result.update({
            f"{a}/{b}": statistics.median(per_round),
            f"{a}/{b} q1": quartiles[0], f"{a}/{b} q3": quartiles[2],
            f"{a}/{b} lo": low, f"{a}/{b} hi": high,
        })
    return result


def _median_interval(values: list[float]) -> tuple[float, float]:
    """A confidence interval of at least 95% for the median of `values`, from their
    order statistics (distribution-free): `[x_(k), x_(n+1-k)]` with the largest k whose
    tails, P(Binomial(n, 1/2) < k) on each side, add up to at most 5%. (NaN, NaN) when
    no such k exists (n < 6)."""
    n = len(values)
    tail, k = 0.0, 0
    while True:  # tail = P(B <= k) for the next candidate k + 1
        tail += math.comb(n, k) / 2**n
        if tail > 0.025 or k + 1 > n // 2:
            break
        k += 1
    if k == 0:
        return math.nan, math.nan
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


# --------------------------------------------------------------------------- workload
class Workload:
    """`num_layers` x (compute: `num_matmuls` matmuls; communicate: all_to_all_single)."""

    def __init__(self, rows: int, num_matmuls: int, num_layers: int) -> None:
        generator = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=generator))
        self.weight = q.contiguous()  # orthogonal: the activations keep their scale
        self.num_matmuls, self.num_layers = num_matmuls, num_layers
        generator.manual_seed(dist.get_rank() + 1)
        self.x = torch.randn(2 * rows, HIDDEN, generator=generator)
        self.parts = [part.contiguous() for part in self.x.tensor_split(2)]
        self._overlapped: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {}

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.num_matmuls):
            x = x @ self.weight
        return x

    def loop(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        """The model: one ubatch's layers; DBO overlaps it, serial runs it per ubatch."""
        for _ in range(self.num_layers):
            x = self.compute(x)
            out = torch.empty_like(x)
            comm.all_to_all_single(out, x, group=group)
            x = out
        return x

    def serial(self) -> torch.Tensor:
        return torch.cat([self.loop(part) for part in self.parts])

    def dbo(self, group: Any = None) -> torch.Tensor:
        step = self._overlapped.get(group)
        if step is None:  # wrapped once per group, as a model's forward would be
            step = self._overlapped[group] = dbo.overlap(lambda x: self.loop(x, group))
        return step(self.x)

    def dbo_raw(self, groups: tuple[Any, Any]) -> torch.Tensor:
        """DBO with each collective written by hand (no `comm`)."""
        step = self._overlapped.get("raw")
        if step is None:

            def loop(x: torch.Tensor) -> torch.Tensor:
                group = groups[dbo.current_ubatch_id()]
                for _ in range(self.num_layers):
                    x = self.compute(x)
                    out = torch.empty_like(x)
                    work = dist.all_to_all_single(out, x, group=group, async_op=True)
                    dbo.yield_()  # the other ubatch runs while this one's data moves
                    work.wait()
                    x = out
                return x

            step = self._overlapped["raw"] = dbo.overlap(loop)
        return step(self.x)

    def pipeline(self, groups: tuple[Any, Any]) -> torch.Tensor:
        """One thread: ubatch u's all-to-all in flight while the other ubatch computes."""
        xs = list(self.parts)
        outs: list[Any] = [None, None]
        works: list[Any] = [None, None]
        for _ in range(self.num_layers):
            for u in (0, 1):
                if works[u] is not None:
                    works[u].wait()
                    xs[u] = outs[u]
                xs[u] = self.compute(xs[u])
                outs[u] = torch.empty_like(xs[u])
                works[u] = dist.all_to_all_single(outs[u], xs[u], group=groups[u], async_op=True)
        for u in (0, 1):
            works[u].wait()
            xs[u] = outs[u]
        return torch.cat(xs)

    def threads(self, pair: TwoThreads) -> torch.Tensor:
        return torch.cat(pair.run())

    def compute_and_comm_ms(self, rounds: int) -> tuple[float, float]:
        """(c, m): one ubatch's compute and all-to-all for one layer, each alone."""
        part = self.parts[0]
        out = torch.empty_like(part)
        times = _interleaved(
            {"c": lambda: self.compute(part), "m": lambda: dist.all_to_all_single(out, part)},
            rounds,
        )
        return times["c"], times["m"]


class TwoThreads:
    """DBO's schedule on two bare threads, no dbo: the floor of any runtime that runs
    each ubatch in its own OS thread.

    Thread u runs ubatch u's loop; where DBO yields, it wakes the other thread and parks
    on its own wake-up. The wake-ups are the kind dbo's baton uses (`dbo.runtime.wakeup`), so
    the difference from DBO is dbo's own work. The threads persist across
    steps (like dbo's workers) and use one intra-op thread (dbo replays the caller's
    setting the same way).
    """

    def __init__(self, work: Workload, groups: tuple[Any, Any]) -> None:
        self._work, self._groups = work, groups
        self._turn = [new_wakeup(), new_wakeup()]
        self._start = [new_wakeup(), new_wakeup()]
        self._done = [_thread.allocate_lock(), _thread.allocate_lock()]
        for lock in self._done:
            lock.acquire()
        self._results: list[Any] = [None, None]
        self._num_finished = 0
        for u in (0, 1):
            threading.Thread(target=self._loop, args=(u,), daemon=True).start()

    def run(self) -> list[torch.Tensor]:
        self._num_finished = 0
        for u in (0, 1):
            self._start[u].set()
        self._turn[0].set()
        for u in (0, 1):
            if not self._done[u].acquire(timeout=30):
                raise RuntimeError("a benchmark thread did not finish in 30 s")
        return list(self._results)

    def _loop(self, me: int) -> None:
        torch.set_num_threads(1)
        work, turn, other = self._work, self._turn, 1 - me
        while True:
            self._start[me].wait()
            turn[me].wait()
            x = work.parts[me]
            for _ in range(work.num_layers):
                x = work.compute(x)
                out = torch.empty_like(x)
                handle = dist.all_to_all_single(out, x, group=self._groups[me], async_op=True)
                turn[other].set()  # the other ubatch runs while this one's data moves
                turn[me].wait()
                handle.wait()
                x = out
            self._results[me] = x
            self._num_finished += 1  # only the thread holding the turn runs here
            if self._num_finished == 1:
                turn[other].set()
            self._done[me].release()


class TwoGreenlets:
    """The same schedule with two greenlets in the calling thread (`--greenlets`, needs
    `pip install greenlet`): ubatch switches without OS thread switches, to measure
    what running each ubatch in its own OS thread costs (the design's choice: CUDA's
    current stream and torch's settings are per OS thread)."""

    def __init__(self, work: Workload, groups: tuple[Any, Any]) -> None:
        import greenlet  # optional: only for this measurement

        self._greenlet = greenlet.greenlet
        self._work, self._groups = work, groups
        self._peers: list[Any] = []
        self._results: list[Any] = [None, None]

    def run(self) -> list[torch.Tensor]:
        self._peers = [self._greenlet(self._loop) for _ in (0, 1)]
        self._peers[0].switch(0)  # back here when ubatch 0 (or 1) has finished
        for u, peer in enumerate(self._peers):
            while not peer.dead:
                peer.switch(u)
        return list(self._results)

    def _loop(self, me: int) -> None:
        work, peer = self._work, 1 - me
        x = work.parts[me]
        for _ in range(work.num_layers):
            x = work.compute(x)
            out = torch.empty_like(x)
            handle = dist.all_to_all_single(out, x, group=self._groups[me], async_op=True)
            if not self._peers[peer].dead:
                self._peers[peer].switch(peer)  # the other ubatch runs meanwhile
            handle.wait()
            x = out
        self._results[me] = x


def _calibrated(rows: int, target_ratio: float, layers: int, rounds: int) -> Workload:
    """A workload whose per-layer compute is about `target_ratio` x its all-to-all."""
    one_matmul_ms, comm_ms = Workload(rows, 1, layers).compute_and_comm_ms(rounds)
    num_matmuls = max(1, round(target_ratio * comm_ms / one_matmul_ms))
    agreed = torch.tensor([num_matmuls])
    dist.broadcast(agreed, src=0)  # every rank runs the same loop
    return Workload(rows, int(agreed.item()), layers)


# --------------------------------------------------------------------------- in flight
def _two_all_to_alls(
    tensors: tuple[torch.Tensor, ...], groups: tuple[Any, Any], together: bool
) -> tuple[float, float]:
    """Two all-to-alls, the second launched after the first is done unless `together`;
    (ms until the first is done, ms until both are)."""
    a, b, out_a, out_b = tensors
    dist.barrier()
    start = time.perf_counter()
    work_a = dist.all_to_all_single(out_a, a, group=groups[0], async_op=True)
    if together:
        work_b = dist.all_to_all_single(out_b, b, group=groups[1], async_op=True)
        work_a.wait()
        first = time.perf_counter() - start
    else:  # the first's time ends before the second is launched
        work_a.wait()
        first = time.perf_counter() - start
        work_b = dist.all_to_all_single(out_b, b, group=groups[1], async_op=True)
    work_b.wait()
    return first * 1e3, (time.perf_counter() - start) * 1e3


def _in_flight(rounds: int, groups: tuple[Any, Any]) -> list[tuple[str, float, float]]:
    """Two all-to-alls: (label, ms until the first is done, ms until both are)."""
    rows = []
    for megabytes in (0.25, 1.0):
        numel = int(megabytes * 2**20 / 4)
        tensors = (torch.randn(numel), torch.randn(numel), torch.empty(numel), torch.empty(numel))
        setups = {
            "one after the other": ((None, None), False),
            "both in flight, one group": ((None, None), True),
            "both in flight, two groups": (groups, True),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
        for _ in range(2 * rounds):  # interleaved
            for name, (pair, together) in setups.items():
                samples[name].append(_two_all_to_alls(tensors, pair, together))
        # Each round's slowest rank first (per round, as the layer-loop table does),
        # then the median over the rounds.
        slowest = torch.tensor([samples[name] for name in setups], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        for name, per_round in zip(setups, slowest.tolist()):
            first, both = (statistics.median(column) for column in zip(*per_round))
            rows.append((f"2 x {megabytes:g} MB, {name}", first, both))
    return rows


# --------------------------------------------------------------------------- one rank
def _rank_main(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = args.pin and len(cores) >= WORLD_SIZE
    if pinned:
        os.sched_setaffinity(0, {cores[rank]})  # before any thread exists: all inherit it
    comm.init_distributed(backend="gloo", timeout_s=60)
    groups = comm.ubatch_groups(None, 2)  # init_distributed made them; a lookup
    shared = dist.new_group()  # a group without per-ubatch duplicates
    report: dict[str, Any] = {
        "pinned": pinned, "layers": args.layers, "rounds": args.rounds,
        "in_flight": _in_flight(args.rounds, groups), "rows": [],
    }
    for rows, target_ratio in args.configs:
        work = _calibrated(rows, target_ratio, args.layers, args.rounds)
        c, m = work.compute_and_comm_ms(args.rounds)
        pair = TwoThreads(work, groups)
        modes: dict[str, Callable[[], Any]] = {
            "serial": work.serial,
            "dbo": work.dbo,
            "dbo raw": lambda work=work: work.dbo_raw(groups),
            "pipeline": lambda work=work: work.pipeline(groups),
            "threads": lambda work=work, pair=pair: work.threads(pair),
            "dbo, one group": lambda work=work: work.dbo(shared),
            "pipeline, one group": lambda work=work: work.pipeline((shared, shared)),
        }
        ratios = [
            ("dbo", "pipeline"), ("dbo", "threads"), ("dbo", "dbo raw"), ("dbo raw", "threads"),
            ("threads", "pipeline"),
        ]
        if args.greenlets:
            glets = TwoGreenlets(work, groups)
            modes["greenlets"] = lambda glets=glets: torch.cat(glets.run())
            ratios += [("greenlets", "pipeline")]
        reference = work.serial()
        for name, fn in modes.items():  # warm-up; every mode computes the same thing
            if not torch.equal(fn(), reference):
                raise AssertionError(f"{name} differs from serial")
        times = _interleaved(modes, args.rounds, ratios=tuple(ratios))
        label = f"{rows * HIDDEN * 4 // 1024} KB, c~{target_ratio:g}m"
        report["rows"].append({"label": label, "c": c, "m": m, **times})
    if rank == 0:
        queue.put(report)
    comm.destroy_distributed()


# --------------------------------------------------------------------------- printing
def _print_report(report: dict[str, Any]) -> None:
    layers = report["layers"]
    print(
        f"2 gloo ranks on loopback, {'one core each' if report['pinned'] else 'not pinned'}, "
        f"{report['rounds']} interleaved rounds; times in ms (median over the rounds of the "
        "slowest rank's time)\n"
    )
    print(f"Two all-to-alls per rank{'':<26}{'first done':>11}{'both done':>11}")
    for label, first, both in report["in_flight"]:
        print(f"  {label:<47}{first:>11.2f}{both:>11.2f}")
    print(
        f"\nLayer loop: 2 ubatches x {layers} layers; times in ms; x = speedup over serial; "
        "hidden = (serial - T) / (serial - ideal);\nthreads = the same schedule on two bare "
        "threads (no dbo); DBO/pipe, DBO/thr = DBO's step time over theirs in the same "
        "round (median)"
    )
    print(
        f"{'per ubatch':<17}{'c':>6}{'m':>6}{'serial':>8}{'ideal':>7}{'DBO':>7}{'pipe':>7}"
        f"{'thr':>7}{'DBO x':>7}{'pipe x':>7}{'thr x':>7}{'DBO hid':>8}{'pipe hid':>9}"
        f"{'DBO/pipe':>9}{'DBO/thr':>8}{'1 group: DBO':>14}{'pipe':>6}"
    )
    for row in report["rows"]:
        c, m, serial = row["c"], row["m"], row["serial"]
        ideal = max(2 * layers * c, 2 * layers * m) + min(c, m)
        t_dbo, t_pipe, t_thr = row["dbo"], row["pipeline"], row["threads"]

        def hidden(t: float, serial: float = serial, ideal: float = ideal) -> str:
            return f"{(serial - t) / (serial - ideal):.2f}" if serial > ideal else "n/a"

        print(
            f"{row['label']:<17}{c:6.2f}{m:6.2f}{serial:8.1f}{ideal:7.1f}{t_dbo:7.1f}"
            f"{t_pipe:7.1f}{t_thr:7.1f}{serial / t_dbo:7.2f}{serial / t_pipe:7.2f}"
            f"{serial / t_thr:7.2f}{hidden(t_dbo):>8}{hidden(t_pipe):>9}"
            f"{row['dbo/pipeline']:9.2f}{row['dbo/threads']:8.2f}"
            f"{serial / row['dbo, one group']:>13.2f}x{serial / row['pipeline, one group']:>5.2f}x"
        )
    print(
        "\nThe paired ratios' spread: q1-q3, quartiles of the per-round ratios (a round's "
        "noise);\nCI, a 95% interval of their median (the run's precision; n/a under 6 rounds); "
        "verdict: does DBO's CI vs the pipeline lie below 1, contain it, or lie above"
    )
    print(
        f"{'per ubatch':<17}{'DBO/pipe q1-q3':>16}{'CI':>13}{'DBO/thr q1-q3':>16}{'CI':>13}"
        f"{'DBO vs pipe':>14}"
    )
    for row in report["rows"]:
        print(
            f"{row['label']:<17}{_span(row, 'dbo/pipeline', 'q1', 'q3'):>16}"
            f"{_span(row, 'dbo/pipeline', 'lo', 'hi'):>13}"
            f"{_span(row, 'dbo/threads', 'q1', 'q3'):>16}"
            f"{_span(row, 'dbo/threads', 'lo', 'hi'):>13}{_verdict(row, 'dbo/pipeline'):>14}"
        )
    print(
        "\nWhere DBO's time goes (same rounds; DBO/pipe ~ comm x runtime x threads): comm = "
        "DBO over DBO with the collectives written by hand\n(dist async + dbo.yield_() + "
        "wait); runtime = that over the bare threads (dbo's per-call work and baton);\n"
        "threads = the bare threads over the pipeline (one OS thread per ubatch, the floor of "
        "any runtime built that way); median and 95% CI"
    )
    print(
        f"{'per ubatch':<17}{'comm':>7}{'CI':>13}{'runtime':>9}{'CI':>13}{'threads':>9}{'CI':>13}"
        f"{'thr vs pipe':>13}"
    )
    for row in report["rows"]:
        print(
            f"{row['label']:<17}{row['dbo/dbo raw']:7.2f}"
            f"{_span(row, 'dbo/dbo raw', 'lo', 'hi'):>13}{row['dbo raw/threads']:9.2f}"
            f"{_span(row, 'dbo raw/threads', 'lo', 'hi'):>13}{row['threads/pipeline']:9.2f}"
            f"{_span(row, 'threads/pipeline', 'lo', 'hi'):>13}"
            f"{_verdict(row, 'threads/pipeline'):>13}"
        )
    with_greenlets = [row for row in report["rows"] if "greenlets" in row]
    if with_greenlets:
        print(
            "\nWithout OS threads (--greenlets): the same schedule on two greenlets in one "
            "thread; step time over the pipeline's, same round (median)"
        )
        print(f"{'per ubatch':<17}{'glet x':>7}{'glet/pipe':>10}{'thr/pipe':>9}{'DBO/pipe':>9}")
        for row in with_greenlets:
            print(
                f"{row['label']:<17}{row['serial'] / row['greenlets']:7.2f}"
                f"{row['greenlets/pipeline']:10.2f}{row['threads/pipeline']:9.2f}"
                f"{row['dbo/pipeline']:9.2f}"
            )


def _span(row: dict[str, Any], ratio: str, low: str, high: str) -> str:
    low_value, high_value = row[f"{ratio} {low}"], row[f"{ratio} {high}"]
    if math.isnan(low_value):
        return "n/a"
    return f"{low_value:.2f}-{high_value:.2f}"


def _verdict(row: dict[str, Any], ratio: str) -> str:
    """Whether the run tells the two modes apart: "faster" / "slower" when the 95%
    interval of the median step-time ratio lies below / above 1, else "tie" ("n/a":
    too few rounds for an interval)."""
    if math.isnan(row[f"{ratio} lo"]):
        return "n/a"
    if row[f"{ratio} hi"] < 1.0:
        return "faster"
    if row[f"{ratio} lo"] > 1.0:
        return "slower"
    return "tie"


def _wait_for_report(queue: Any, processes: list[Any], deadline: float) -> dict[str, Any]:
    """Rank 0's report; raise if a rank dies first or the deadline passes."""
    import queue as queue_module

    while time.perf_counter() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            failed = [p.name for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"{failed} failed (see the traceback above)") from None
    raise SystemExit("the ranks did not finish in time; pass a larger --timeout-s")


def _parse_configs(text: str) -> list[tuple[int, float]]:
    configs = []
    for item in text.split(","):
        rows, ratio = item.split(":")
        configs.append((int(rows), float(ratio)))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per mode")
    parser.add_argument("--layers", type=int, default=16, help="layers per step")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up after this")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin each rank to its own core")
    parser.add_argument(
        "--greenlets", action="store_true",
        help="also time the schedule on two greenlets in one thread (pip install greenlet)",
    )
    parser.add_argument(
        "--configs", type=_parse_configs, default=CONFIGS,
        help="ROWS:RATIO,... rows per ubatch and target c/m (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args()
    # Forked ranks start with this process's imports; the store serves on a socket bound
    # before they start (a free port that stays ours), its thread started after them.
    context = multiprocessing.get_context("fork")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    queue = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, port, args, queue), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    started = time.perf_counter()
    for process in processes:
        process.start()
    store = dist.TCPStore(  # noqa: F841 - serves the ranks' rendezvous while it lives
        "127.0.0.1", port, WORLD_SIZE, is_master=True, wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    try:
        report = _wait_for_report(queue, processes, started + args.timeout_s)
    finally:
        for process in processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
    _print_report(report)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:  # NaN (an interval under 6 rounds) as null: strict JSON
        print(json.dumps(_without_nan(report)))


def _without_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(item) for item in value]
    return value


if __name__ == "__main__":
    main()
