"""A host-side timeline of overlapped calls: when each ubatch held the baton, and when
its thread sat blocked waiting for a collective.

    with dbo.trace() as timeline:
        step(x)
    print(timeline.summary())             # per ubatch: turns, baton time, blocked time
    timeline.save("dbo_trace.json")       # open in https://ui.perfetto.dev or chrome://tracing
    timeline.plot("dbo_trace.png")        # needs matplotlib (the `plot` extra)

Spans, on the `time.perf_counter` clock: "baton", a turn, from the wake-up of a ubatch's
thread holding the baton to its handoff or finish; "wait <collective>", the time a `comm`
wait blocked the host (gloo blocks, NCCL's wait only orders streams), on the caller's
track outside an overlap; "dbo.overlap" ("dbo.overlap inline"), each call on the
caller's thread (nested calls and calls under a mode or `torch.func` are not recorded).
One trace at a time per process; concurrent overlaps get tracks of their own.

In a `torch.profiler` profile each turn and wait is also a range, `dbo/ubatch1/turn`,
`dbo/ubatch1/wait all_to_all_single`, beside the kernels; the ubatch threads are recorded
with `experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`.
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

from dbo._torch_private import private

CALLER = -1  # the `ubatch_id` of spans recorded outside a ubatch thread

DEFAULT_MAX_SPANS = 1_000_000  # spans a trace keeps by default (a few hundred bytes each)


class Span(NamedTuple):
    """One interval of the timeline, in seconds, on the thread of ubatch `ubatch_id`
    (`CALLER`: the caller's thread) whose `threading.get_ident()` is `thread_id`."""

    name: str
    ubatch_id: int
    start_s: float
    end_s: float
    thread_id: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class UBatchTotals:
    """What one ubatch (or `CALLER`) did over a trace: turns with the baton, time holding
    it, time its thread was blocked in collective waits, and how many waits."""

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
        self.dropped = 0  # spans not kept: `max_spans` were recorded already
        self.start_s = time.perf_counter()
        self.end_s: float | None = None
        self._lock = threading.Lock()

    def add(self, name: str, ubatch_id: int, start_s: float, end_s: float) -> None:
        """Record a span of this thread, clipped to the trace's start, until the block exits."""
        start_s = max(start_s, self.start_s)
        span = Span(name, ubatch_id, start_s, max(end_s, start_s), threading.get_ident())
        with self._lock:  # several overlaps may run at once, from several callers
            if self.end_s is not None:
                return
            if len(self.spans) < self.max_spans:
                self.spans.append(span)
            else:
                self.dropped += 1

    def _snapshot(self) -> list[Span]:
        with self._lock:  # one consistent set while overlaps still record
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
            lines.append(
                f"{_label(key):<10}{total.turns:>7}{total.baton_s * 1e3:>10.2f}"
                f"{total.blocked_s * 1e3:>12.2f}{total.waits:>7}"
            )
        truncated = (
            f"TRUNCATED: {self.dropped} spans dropped past max_spans={self.max_spans}; the "
            f"numbers below cover the first {len(spans)} spans only\n" if self.dropped else ""
        )
        return truncated + "\n".join(lines)

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
        roles = [ubatch_id for ubatch_id, _ in tracks]
        for index, ubatch_id in enumerate(roles):
            nth = roles[: index + 1].count(ubatch_id)  # concurrent overlaps: more per role
            label = _label(ubatch_id) + (f" ({nth})" if nth > 1 else "")
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": index + 1,
                           "args": {"name": label}})
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
        """Draw the timeline to an image file (PNG by the suffix): one lane per ubatch and
        one for the caller, calls, baton turns and collective waits in colours of their
        own, ms from the trace's start on the x axis. Needs matplotlib (ImportError naming
        the `plot` extra); draws off-screen, from any thread, without pyplot."""
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("Trace.plot needs matplotlib: pip install 'dbo[plot]'") from error
        spans = self._snapshot()
        lanes = sorted({span.ubatch_id for span in spans} | {CALLER}, reverse=True)
        figure = Figure(figsize=(12, 0.5 * len(lanes) + 1.4), layout="constrained")
        axes = figure.add_subplot()
        for prefix, label, colour, height in _PLOT_KINDS:  # waits last: on top of turns
            for row, ubatch_id in enumerate(lanes):
                bars = [((span.start_s - self.start_s) * 1e3, span.duration_s * 1e3)
                        for span in spans
                        if span.ubatch_id == ubatch_id and span.name.startswith(prefix)]
                axes.broken_barh(bars, (row - height / 2, height), color=colour,
                                 label=label if row == 0 else None)
        axes.set_yticks(range(len(lanes)), [_label(ubatch_id) for ubatch_id in lanes])
        axes.set_xlabel("ms since the trace started (host clock)")
        axes.set_title(title or "dbo.trace()", loc="left")
        axes.legend(loc="lower right", bbox_to_anchor=(1, 1), ncols=3, frameon=False)
        figure.savefig(path, dpi=110)


_PLOT_KINDS = (  # span name prefix, legend, colour, bar height
    ("dbo.overlap", "dbo.overlap call", "#c7c7c7", 0.8),
    ("baton", "baton turn (host work)", "#1f77b4", 0.6),
    ("wait ", "blocked in a collective wait", "#d62728", 0.35),
)


def _label(ubatch_id: int) -> str:
    return "caller" if ubatch_id == CALLER else f"ubatch {ubatch_id}"


def begin_range(track: int, what: str) -> Any:
    """Begin a `torch.profiler` range (`record_function`) named `dbo/ubatch{track}/{what}`
    (`dbo/caller/...` for `CALLER`) on this thread; `end_range` ends it on the same thread.
    Callers check `profiling()` first."""
    label = _label(track).replace(" ", "")
    return private.enter_profiler_range(f"dbo/{label}/{what}", None)


def end_range(handle: Any) -> None:
    """End a `begin_range` range (None: none was begun)."""
    if handle is not None:
        private.exit_profiler_range(handle)


recording: Trace | None = None
"""The `Trace` recording now, or None: read by the baton, `dbo.overlap` and `blocking_wait`
at every handoff and wait (an attribute, not a call, on that path)."""
_lock = threading.Lock()


def reset_after_fork() -> None:
    """In a forked child: new locks (another thread may have held them at the fork), and
    the parent's trace ended: the child records nothing into it and may start its own."""
    global _lock, recording
    _lock = threading.Lock()
    if recording is not None:
        recording._lock = threading.Lock()
        recording.end_s = time.perf_counter()
    recording = None


@contextmanager
def trace(max_spans: int = DEFAULT_MAX_SPANS) -> Iterator[Trace]:
    """Record the timeline of every overlap (and `comm` wait) in this process during the
    block; yields the `Trace`, complete once the block exits. One trace at a time (a
    second raises RuntimeError); spans past `max_spans` are counted in `Trace.dropped`."""
    global recording
    started = Trace(max_spans)
    with _lock:
        if recording is not None:
            raise RuntimeError("a dbo.trace() is already recording in this process")
        recording = started
    try:
        yield started
    finally:
        with _lock:
            recording = None
        with started._lock:  # from here on, add() ignores late spans
            started.end_s = time.perf_counter()
