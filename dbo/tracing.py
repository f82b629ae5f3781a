"""A host-side timeline of overlapped calls: when each ubatch held the baton, and when
its thread sat blocked waiting for a collective.

    with dbo.trace() as timeline:
        for _ in range(10):
            step(x)
    print(timeline.summary())             # per ubatch: turns, baton time, blocked time
    timeline.save("dbo_trace.json")       # open in https://ui.perfetto.dev or chrome://tracing

Recorded on host clocks (`time.perf_counter`):
  - "baton": a span per turn, from the moment a ubatch's thread woke holding the baton
    to the moment it handed it on or finished (a wake-up is a gap between turns);
  - "wait <collective>": the part of a turn a `comm` collective's `wait()` blocked the
    host (gloo blocks; NCCL's wait only orders streams): communication the overlap did
    not hide; outside an overlap too (track "caller");
  - "dbo.overlap": each overlapped call on the caller's thread, split and merge included
    ("dbo.overlap inline" for a call that ran `fn` on the whole batch; nested calls and
    calls under a mode or a `torch.func` transform are not recorded).

A turn minus its waits is host work; GPU kernels are not on this timeline (use
`torch.profiler`). While no trace is active, recording costs one attribute read per
handoff and per collective. One trace at a time per process (each rank records its
own); concurrent overlaps get tracks of their own, and `totals()` adds them up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

CALLER = -1
"""The `ubatch_id` of spans recorded outside a ubatch thread (the caller's thread)."""

DEFAULT_MAX_SPANS = 1_000_000
"""The spans a trace keeps by default (a few hundred bytes each)."""


class Span(NamedTuple):
    """One interval of the timeline (seconds on the `time.perf_counter` clock)."""

    name: str
    ubatch_id: int
    """The ubatch whose thread it belongs to; `CALLER` for the caller's thread."""
    start_s: float
    end_s: float
    thread_id: int = 0
    """`threading.get_ident()` of that thread (concurrent overlaps: their own tracks)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class UBatchTotals:
    """What one ubatch (or the caller, `CALLER`) did over a trace: how many times it got
    the baton, how long it held it, how long its thread was blocked in collective waits,
    and how many waits."""

    turns: int
    baton_s: float
    blocked_s: float
    waits: int


class Trace:
    """The spans recorded while a `dbo.trace()` block was active."""

    def __init__(self, max_spans: int = DEFAULT_MAX_SPANS) -> None:
        if isinstance(max_spans, bool) or not isinstance(max_spans, int):
            raise TypeError(f"max_spans must be an int >= 1, got {max_spans!r}")
        if max_spans < 1:
            raise ValueError(f"max_spans must be an int >= 1, got {max_spans!r}")
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.dropped = 0
        """Spans not kept because `max_spans` were already recorded."""
        self.start_s = time.perf_counter()
        self.end_s: float | None = None
        self._lock = threading.Lock()

    def add(self, name: str, ubatch_id: int, start_s: float, end_s: float) -> None:
        """Record a span of the calling thread, clipped to the trace's start; ignored once
        the `dbo.trace()` block has exited."""
        start_s = max(start_s, self.start_s)
        span = Span(name, ubatch_id, start_s, max(end_s, start_s), threading.get_ident())
        with self._lock:  # several overlaps may run at once, from several callers
            if self.end_s is not None:
                return
            if len(self.spans) < self.max_spans:
                self.spans.append(span)
            else:
                self.dropped += 1

    # ------------------------------------------------------------------ reading
    def _snapshot(self) -> list[Span]:
        """The spans so far, copied under the lock: readers may run while overlaps
        still record, and must see one set of spans."""
        with self._lock:
            return list(self.spans)

    def totals(self) -> dict[int, UBatchTotals]:
        """Per ubatch id (and `CALLER` if it has waits): turns, baton and blocked time,
        summed over every overlap in the trace (over the kept spans: see `dropped`)."""
        sums: dict[int, list[float]] = {}  # turns, baton_s, waits, blocked_s
        for span in self._snapshot():
            if span.name == "baton" or span.name.startswith("wait "):
                row = sums.setdefault(span.ubatch_id, [0, 0.0, 0, 0.0])
                column = 0 if span.name == "baton" else 2
                row[column] += 1
                row[column + 1] += span.duration_s
        return {
            key: UBatchTotals(int(row[0]), row[1], row[3], int(row[2]))
            for key, row in sorted(sums.items())
        }

    def summary(self) -> str:
        """A small table: per ubatch, turns, baton time, blocked time, and the calls."""
        spans = self._snapshot()
        calls = [span for span in spans if span.name == "dbo.overlap"]
        inline = sum(1 for span in spans if span.name == "dbo.overlap inline")
        lines = [
            f"{len(calls)} overlapped call(s), {sum(s.duration_s for s in calls) * 1e3:.2f} ms "
            f"in them (host clock); {inline} call(s) ran inline",
            f"{'':<10}{'turns':>7}{'baton ms':>10}{'blocked ms':>12}{'waits':>7}",
        ]
        for key, total in self.totals().items():
            label = "caller" if key == CALLER else f"ubatch {key}"
            lines.append(
                f"{label:<10}{total.turns:>7}{total.baton_s * 1e3:>10.2f}"
                f"{total.blocked_s * 1e3:>12.2f}{total.waits:>7}"
            )
        if self.dropped:  # first: the counts below cover the kept spans only
            lines.insert(
                0,
                f"TRUNCATED: {self.dropped} spans dropped past max_spans={self.max_spans}; "
                f"the numbers below cover the first {len(spans)} spans only",
            )
        return "\n".join(lines)

    def to_chrome_trace(self, process_name: str | None = None) -> dict[str, Any]:
        """The Chrome trace-event JSON object (Perfetto and chrome://tracing read it):
        one track per ubatch thread and one for the caller, times in us from the start."""
        pid = os.getpid()
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": process_name or f"dbo (pid {pid})"}},
        ]
        # One track per (role, thread), numbered by role, then by first appearance.
        spans = self._snapshot()
        tracks: dict[tuple[int, int], int] = {}
        for span in sorted(spans, key=lambda span: (span.ubatch_id, span.start_s)):
            tracks.setdefault((span.ubatch_id, span.thread_id), len(tracks) + 1)
        seen: dict[int, int] = {}
        for (ubatch_id, _), tid in tracks.items():
            label = "caller" if ubatch_id == CALLER else f"ubatch {ubatch_id}"
            seen[ubatch_id] = seen.get(ubatch_id, 0) + 1
            if seen[ubatch_id] > 1:  # concurrent overlaps: another thread in this role
                label += f" ({seen[ubatch_id]})"
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}}
            )
        for span in spans:
            events.append({
                "ph": "X", "name": span.name, "cat": "dbo", "pid": pid,
                "tid": tracks[(span.ubatch_id, span.thread_id)],
                "ts": (span.start_s - self.start_s) * 1e6,
                "dur": span.duration_s * 1e6,
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str], process_name: str | None = None) -> None:
        """Write `to_chrome_trace()` to `path` (JSON)."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_chrome_trace(process_name), file)

    def plot(self, path: str | os.PathLike[str], title: str | None = None) -> None:
        """Draw the timeline to an image file (PNG by its suffix): one lane per ubatch and
        one for the caller, baton turns and collective waits in their own colours, time in
        ms from the trace's start. Needs matplotlib (`pip install dbo[plot]`); draws
        off-screen (Agg), from any thread."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as error:
            raise ImportError(
                "Trace.plot needs matplotlib: pip install 'dbo[plot]' (or pip install "
                "matplotlib)"
            ) from error
        spans = self._snapshot()
        lanes = sorted({span.ubatch_id for span in spans} | {CALLER}, reverse=True)
        row = {ubatch_id: index for index, ubatch_id in enumerate(lanes)}
        colours = {"call": "#c7c7c7", "baton": "#1f77b4", "wait": "#d62728"}
        figure = Figure(figsize=(12, 0.6 * len(lanes) + 1.2), layout="constrained")
        axes = figure.add_subplot()
        for kind, height in (("call", 0.8), ("baton", 0.6), ("wait", 0.35)):  # waits on top
            for span in spans:
                if span.name.split(" ")[0].replace("dbo.overlap", "call") != kind:
                    continue
                axes.broken_barh(
                    [((span.start_s - self.start_s) * 1e3, span.duration_s * 1e3)],
                    (row[span.ubatch_id] - height / 2, height), color=colours[kind],
                )
        axes.set_yticks(range(len(lanes)), [
            "caller" if ubatch_id == CALLER else f"ubatch {ubatch_id}" for ubatch_id in lanes
        ])
        axes.set_xlabel("ms since the trace started (host clock)")
        axes.set_title(title or "dbo.trace() timeline")
        axes.legend(handles=[
            Patch(color=colours["call"], label="dbo.overlap call"),
            Patch(color=colours["baton"], label="baton turn (host work)"),
            Patch(color=colours["wait"], label="blocked in a collective wait"),
        ], loc="upper right", fontsize="small")
        figure.savefig(path, dpi=110)


_active: Trace | None = None
"""The trace being recorded, read by the baton and `comm` at every handoff and wait."""
_lock = threading.Lock()


def reset_after_fork() -> None:
    """In a forked child: new locks (another thread may have held them at the fork), and
    the parent's trace ended, so that the child records nothing into it and may start
    its own."""
    global _lock, _active
    _lock = threading.Lock()
    if _active is not None:
        _active._lock = threading.Lock()
        _active.end_s = time.perf_counter()
    _active = None


def active() -> Trace | None:
    """The trace being recorded in this process, if any."""
    return _active


@contextmanager
def trace(max_spans: int = DEFAULT_MAX_SPANS) -> Iterator[Trace]:
    """Record the timeline of every overlap (and `comm` wait) in this process during the
    block; yields the `Trace`, complete once the block exits.

    One trace at a time: starting a second while one is active raises RuntimeError.
    Past `max_spans` spans, further ones are counted in `Trace.dropped`, not kept.
    """
    global _active
    recording = Trace(max_spans)
    with _lock:
        if _active is not None:
            raise RuntimeError("a dbo.trace() is already recording in this process")
        _active = recording
    try:
        yield recording
    finally:
        with _lock:
            _active = None
        with recording._lock:  # from here on, add() ignores late spans
            recording.end_s = time.perf_counter()
