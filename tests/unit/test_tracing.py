"""dbo.trace(): the host-side timeline of overlaps and collective waits."""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import comm
import dbo
from dbo import tracing

TIMEOUT_S = 30.0


def _yielding(num_yields: int):  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(num_yields):
            x = x + 1
            dbo.yield_()
        return x

    return dbo.overlap(fn, timeout_s=TIMEOUT_S)


def test_each_turn_is_a_span_and_turns_never_overlap() -> None:
    step = _yielding(3)
    with dbo.trace() as timeline:
        step(torch.zeros(4))
    turns = sorted(
        (span for span in timeline.spans if span.name == "baton"), key=lambda s: s.start_s
    )
    # 3 yields each: 4 turns per ubatch, alternating 0, 1, 0, 1, ...
    assert [span.ubatch_id for span in turns] == [0, 1] * 4
    for earlier, later in zip(turns, turns[1:]):
        assert earlier.end_s <= later.start_s  # one holder at a time
    (call,) = [span for span in timeline.spans if span.name == "dbo.overlap"]
    assert call.ubatch_id == tracing.CALLER
    assert call.start_s <= turns[0].start_s and turns[-1].end_s <= call.end_s
    totals = timeline.totals()
    assert totals[0].turns == totals[1].turns == 4
    assert totals[0].blocked_s == 0.0
    assert 0 < totals[0].baton_s + totals[1].baton_s <= call.duration_s


def test_nothing_is_recorded_outside_the_block_and_traces_do_not_nest() -> None:
    step = _yielding(1)
    with dbo.trace() as timeline:
        with pytest.raises(RuntimeError, match="already recording"), dbo.trace():
            pass
        step(torch.zeros(4))
    recorded = len(timeline.spans)
    step(torch.zeros(4))
    assert len(timeline.spans) == recorded > 0
    with dbo.trace() as later:  # the ended trace no longer blocks a new one
        step(torch.zeros(4))
    assert len(later.spans) > 0 and len(timeline.spans) == recorded
    assert timeline.end_s is not None


def test_an_inline_call_is_recorded_as_inline() -> None:
    step = dbo.overlap(lambda x: x * 2, min_batch_size=100)
    with dbo.trace() as timeline:
        step(torch.zeros(4))
    assert [span.name for span in timeline.spans] == ["dbo.overlap inline"]
    assert "1 call(s) ran inline" in timeline.summary()


def test_spans_past_max_spans_are_counted_not_kept() -> None:
    step = _yielding(5)
    with dbo.trace(max_spans=3) as timeline:
        step(torch.zeros(4))
    assert len(timeline.spans) == 3
    assert timeline.dropped == 2 * 6 + 1 - 3  # 12 turns and the call
    # First, since the counts below it cover the kept spans only (here: turns, no call)
    first_line = timeline.summary().splitlines()[0]
    assert first_line.startswith("TRUNCATED: 10 spans dropped past max_spans=3"), first_line
    with pytest.raises(ValueError, match="max_spans"):
        dbo.Trace(max_spans=0)
    with pytest.raises(TypeError, match="max_spans"):  # a wrong type, like every other check
        dbo.Trace(max_spans="10")  # type: ignore[arg-type]


def test_collective_waits_are_recorded_on_their_ubatch_and_the_caller(
    world_of_one: None,
) -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(x)
        handle = comm.all_reduce(x, async_op=True)
        assert handle is not None
        handle.wait()
        return x

    with dbo.trace() as timeline:
        dbo.overlap(body, timeout_s=TIMEOUT_S)(torch.ones(4))
        comm.all_reduce(torch.ones(2))
    waits = [(span.name, span.ubatch_id) for span in timeline.spans if span.name.startswith("wait")]
    assert sorted(waits) == sorted(
        [("wait all_reduce", 0)] * 2 + [("wait all_reduce", 1)] * 2
        + [("wait all_reduce", tracing.CALLER)]
    )
    totals = timeline.totals()
    assert totals[0].waits == totals[1].waits == 2
    assert totals[tracing.CALLER].waits == 1 and totals[tracing.CALLER].turns == 0


def test_the_chrome_trace_has_a_named_track_per_thread(tmp_path: Path) -> None:
    step = _yielding(2)
    with dbo.trace() as timeline:
        step(torch.zeros(4))
    path = tmp_path / "trace.json"
    timeline.save(path, process_name="rank 0")
    events = json.loads(path.read_text())["traceEvents"]
    names = {event["args"]["name"] for event in events if event["ph"] == "M"}
    assert names == {"rank 0", "caller", "ubatch 0", "ubatch 1"}
    complete = [event for event in events if event["ph"] == "X"]
    assert len(complete) == len(timeline.spans)
    assert all(event["ts"] >= 0 and event["dur"] >= 0 for event in complete)
    assert {event["name"] for event in complete} == {"baton", "dbo.overlap"}


def test_a_wait_is_on_the_track_of_the_thread_that_blocked_in_it(world_of_one: None) -> None:
    """Recv-hook pattern: ubatch i launches, ubatch i + 1 waits; the wait lies inside
    one of the waiting ubatch's turns."""

    def body(x: torch.Tensor) -> torch.Tensor:
        handle = comm.all_reduce(x, async_op=True)
        assert handle is not None
        dbo.register_recv_hook(functools.partial(handle.wait, yield_first=False))
        dbo.yield_()
        dbo.maybe_run_recv_hook()
        return x

    with dbo.trace() as timeline:
        dbo.overlap(body, timeout_s=TIMEOUT_S)(torch.ones(4))
    turns = [span for span in timeline.spans if span.name == "baton"]
    waits = [span for span in timeline.spans if span.name.startswith("wait")]
    assert len(waits) == 2
    for wait in waits:
        assert any(
            turn.ubatch_id == wait.ubatch_id and turn.thread_id == wait.thread_id
            and turn.start_s <= wait.start_s and wait.end_s <= turn.end_s
            for turn in turns
        ), wait


def test_concurrent_overlaps_get_tracks_of_their_own() -> None:
    barrier = threading.Barrier(2)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            barrier.wait(timeout=10)  # both calls' ubatch 0 hold their batons at once
        time.sleep(0.01)
        dbo.yield_()
        return x

    step = dbo.overlap(fn, timeout_s=TIMEOUT_S)
    with dbo.trace() as timeline:
        callers = [threading.Thread(target=step, args=(torch.zeros(4),)) for _ in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=TIMEOUT_S)
    chrome = timeline.to_chrome_trace()["traceEvents"]
    names = sorted(event["args"]["name"] for event in chrome if event["name"] == "thread_name")
    assert names == ["caller", "caller (2)", "ubatch 0", "ubatch 0 (2)", "ubatch 1", "ubatch 1 (2)"]
    by_track: dict[int, list[tuple[float, float]]] = {}
    for event in chrome:
        if event["ph"] == "X":
            by_track.setdefault(event["tid"], []).append((event["ts"], event["ts"] + event["dur"]))
    for intervals in by_track.values():  # one thread: its spans nest or follow each other
        intervals.sort()
        for (_, first_end), (second_start, second_end) in zip(intervals, intervals[1:]):
            assert second_end <= first_end or second_start >= first_end
    assert timeline.totals()[0].turns == 4  # two calls, two turns each


def test_a_failed_overlap_still_has_its_call_span() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            raise ValueError("boom")
        return x

    with dbo.trace() as timeline, pytest.raises(ValueError, match="boom"):
        dbo.overlap(fn, timeout_s=TIMEOUT_S)(torch.zeros(4))
    assert [span.name for span in timeline.spans].count("dbo.overlap") == 1


def test_a_trace_started_inside_a_turn_starts_its_spans_at_the_trace() -> None:
    traces: list[dbo.Trace] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            time.sleep(0.01)
            with dbo.trace() as timeline:
                dbo.yield_()
            traces.append(timeline)
        else:
            dbo.yield_()
        return x

    dbo.overlap(fn, timeout_s=TIMEOUT_S)(torch.zeros(4))
    (timeline,) = traces
    assert timeline.spans and all(span.start_s >= timeline.start_s for span in timeline.spans)
    events = timeline.to_chrome_trace()["traceEvents"]
    assert all(event["ts"] >= 0 for event in events if event["ph"] == "X")


def test_a_span_that_ended_before_the_trace_started_has_no_negative_length() -> None:
    timeline = dbo.Trace()
    timeline.add("baton", 0, timeline.start_s - 2.0, timeline.start_s - 1.0)
    (span,) = timeline.spans
    assert span.start_s == span.end_s == timeline.start_s


def test_reading_a_trace_while_overlaps_record_sees_one_consistent_set_of_spans() -> None:
    """A reader walks one copy of the spans: a span recorded between two walks of the
    live list (simulated: the second walk finds one more) gets no event without a track."""
    step = dbo.overlap(lambda x: x + 1)
    with dbo.trace() as recording:
        step(torch.ones(2))

    class GrowsBeforeTheSecondWalk(list):  # type: ignore[type-arg]
        walks = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.walks += 1
            if self.walks == 2:
                span = self[0]
                self.append(span._replace(thread_id=span.thread_id + 1))
            return super().__iter__()

    recording.spans = GrowsBeforeTheSecondWalk(recording.spans)
    events = recording.to_chrome_trace()["traceEvents"]
    spans = [event for event in events if event["ph"] == "X"]
    assert len(spans) == len(recording.spans)
    named = {event["tid"] for event in events if event["ph"] == "M" and event["tid"] != 0}
    assert {event["tid"] for event in spans} <= named


def _turns_and_gaps_before_ubatch_1(step: Any) -> tuple[list[tracing.Span], list[float]]:
    """One traced call of `step`: its turns in time order, and the gap before each of
    ubatch 1's turns (from the end of the turn before it)."""
    with dbo.trace() as timeline:
        step(torch.zeros(4))
    turns = sorted(
        (span for span in timeline.spans if span.name == "baton"), key=lambda s: s.start_s
    )
    gaps = [
        later.start_s - earlier.end_s
        for earlier, later in zip(turns, turns[1:])
        if later.ubatch_id == 1
    ]
    return turns, gaps


def test_a_turn_starts_when_its_thread_wakes_not_at_the_handoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The successor's wake-up is a gap between turns, not host work: with every
    wake-up made 50 ms slow, the turns of a do-nothing fn stay short and the 50 ms
    are gaps between them."""
    from dbo.runtime import wakeup

    step = _yielding(3)
    step(torch.zeros(4))  # warm: the pooled threads exist
    turns, gaps = _turns_and_gaps_before_ubatch_1(step)
    assert len(gaps) == 4 and all(gap >= 0 for gap in gaps)  # the control: real wake-ups

    kind = type(wakeup.new_wakeup())  # what the pooled workers park on
    original_wait = kind.wait

    def slow_wait(self: Any) -> None:
        original_wait(self)
        time.sleep(0.05)  # woken, but slow to get going

    monkeypatch.setattr(kind, "wait", slow_wait)
    turns, gaps = _turns_and_gaps_before_ubatch_1(step)
    # The first may be ~0: ubatch 1's worker can reach its first wait for the baton
    # after it already holds it (no wake-up to wait for). The later ones follow yields.
    assert len(gaps) == 4 and all(gap >= 0.045 for gap in gaps[1:]), gaps
    assert all(span.duration_s < 0.045 for span in turns), turns


def test_a_call_that_outlives_the_block_is_not_added_to_the_finished_trace() -> None:
    started, release = threading.Event(), threading.Event()

    def fn(x: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait(TIMEOUT_S)
        return x

    step = dbo.overlap(fn, timeout_s=TIMEOUT_S)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            step(torch.zeros(4))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with dbo.trace() as timeline:
        thread = threading.Thread(target=call)
        thread.start()
        assert started.wait(TIMEOUT_S)
    spans_at_exit = list(timeline.spans)
    release.set()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive() and not errors
    assert timeline.spans == spans_at_exit  # complete once the block exited
    assert timeline.end_s is not None
    assert all(span.end_s <= timeline.end_s for span in timeline.spans)


def test_a_revoked_job_that_held_the_baton_records_no_turn() -> None:
    """The runner finishes a job revoked before it started (watchdog, interrupt) from the
    caller's thread: it held the baton but never ran, so no turn is recorded."""
    from dbo.runtime.baton import Baton

    with dbo.trace() as timeline:
        baton = Baton(2)
        baton.start()  # ubatch 0 holds the baton; its thread never wakes
        baton.abort("revoked", wake_all=True)
        baton.finish(0)
        baton.finish(1)
        assert baton.wait_done(TIMEOUT_S)
    assert [span for span in timeline.spans if span.name == "baton"] == []


# ------------------------------------------------------------------ picture and profiler
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_of_the_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with dbo.trace() as timeline:
        _yielding(3)(torch.zeros(4))
    path = tmp_path / "timeline.png"
    timeline.plot(path, title="two ubatches")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_plot_without_matplotlib_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dbo.trace() as timeline:
        _yielding(1)(torch.zeros(4))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError
    with pytest.raises(ImportError, match=r"pip install 'dbo\[plot\]'"):
        timeline.plot(tmp_path / "timeline.png")
    assert not (tmp_path / "timeline.png").exists()


@pytest.mark.skipif(
    not hasattr(torch._C._profiler, "_ExperimentalConfig"), reason="no experimental config"
)
def test_a_torch_profile_shows_each_turn_and_wait_as_a_range_named_after_its_ubatch(
    world_of_one: None,
) -> None:
    from torch.profiler import ProfilerActivity, profile

    def body(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        comm.all_reduce(x)
        return x

    step = dbo.overlap(body, timeout_s=TIMEOUT_S)
    step(torch.ones(4))  # warm: the runner's threads exist before the profiler starts
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with (
        profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof,
        dbo.trace() as timeline,
    ):
        step(torch.ones(4))
        comm.all_reduce(torch.ones(2))
    names = [event.name for event in prof.events() if event.name.startswith("dbo/")]
    totals = timeline.totals()
    for ubatch_id in (0, 1):  # one range per turn the trace saw (the yields and the wait's)
        assert totals[ubatch_id].turns >= 2
        assert names.count(f"dbo/ubatch{ubatch_id}/turn") == totals[ubatch_id].turns, names
        assert names.count(f"dbo/ubatch{ubatch_id}/wait all_reduce") == 1, names
    assert names.count("dbo/caller/wait all_reduce") == 1, names
