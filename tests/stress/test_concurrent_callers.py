"""Concurrent callers: four caller threads, each with its own overlapped function (2, 3,
4 and 2 ubatches) and its own workspace manager, run random schedules at the same
time; every call's output equals its serial one and its turns follow its own ring. A
ubatch's helper thread runs an overlapped call of its own."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from _stress import size
from _ubatch_programs import (
    WATCHDOG_S,
    OverlappedCaller,
    Record,
    Schedule,
    check_events,
    check_schedule,
    run_serial,
    schedules,
    ubatch_body,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dbo
from workspace import WorkspaceManager

pytestmark = pytest.mark.stress

CALLER_UBATCHES = (2, 3, 4, 2)
CALLS_PER_CALLER = 8
EXAMPLES = size(24, 3200)
"""Rounds of concurrent calls: 24 x 4 x 8 = 768 schedules bounded, 102,400 long."""
JOIN_TIMEOUT_S = 60.0

class _InFlight:
    """How many calls run now, and the most that ran at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def add(self, step: int) -> None:
        with self._lock:
            self.now += step
            self.most = max(self.most, self.now)


def _caller_loop(
    caller: OverlappedCaller, calls: list[Schedule], start: threading.Barrier,
    in_flight: _InFlight, errors: list[str],
) -> None:
    manager = WorkspaceManager("cpu", caller.num_ubatches)  # a slot per ubatch, this caller's
    name = threading.current_thread().name
    try:
        start.wait(timeout=JOIN_TIMEOUT_S)
    except threading.BrokenBarrierError:
        errors.append(f"{name}: the other callers did not start")
        return
    for index, schedule in enumerate(calls):
        in_flight.add(+1)
        try:
            check_schedule(schedule, manager, caller)
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(f"{name}, call {index}: {type(error).__name__}: {error}")
            return
        finally:
            in_flight.add(-1)


@pytest.mark.timeout(size(120, 8 * 3600))
@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls=st.tuples(*[
    st.lists(schedules(n, max_ops=32), min_size=CALLS_PER_CALLER, max_size=CALLS_PER_CALLER)
    for n in CALLER_UBATCHES
]))
def test_concurrent_callers_each_get_their_own_serial_results(
    calls: tuple[list[Schedule], ...],
) -> None:
    callers = [OverlappedCaller(n) for n in CALLER_UBATCHES]
    errors: list[str] = []
    start = threading.Barrier(len(callers))
    in_flight = _InFlight()
    threads = [
        threading.Thread(target=_caller_loop, args=(caller, own, start, in_flight, errors),
                         name=f"caller-{i}-of-{caller.num_ubatches}-ubatches", daemon=True)
        for i, (caller, own) in enumerate(zip(callers, calls, strict=True))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"caller threads still running after {JOIN_TIMEOUT_S} s: {stuck}"
    assert not errors, "\n".join(errors)
    assert in_flight.most >= 2, f"the callers' calls never overlapped ({in_flight.most} at most)"


@pytest.mark.timeout(size(60, 4 * 3600))
@settings(max_examples=size(60, 5000), derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(outer=schedules(2, max_ops=24), inner=st.integers(2, 4).flatmap(
    lambda n: schedules(n, max_ops=24)))
def test_a_helper_thread_of_a_ubatch_runs_its_own_overlap(
    outer: Schedule, inner: Schedule
) -> None:
    """A ubatch that waits for a helper thread's overlapped call (holding the baton) gets
    its own serial result, and so does the helper, on a runner of its own."""
    helper_errors: list[str] = []

    def helper() -> None:
        try:
            check_schedule(inner, WorkspaceManager("cpu", inner.num_ubatches))
        except BaseException as error:  # noqa: BLE001 - reported by the ubatch
            helper_errors.append(f"{type(error).__name__}: {error}")

    def ubatch(part: Any) -> Any:
        ubatch_id = dbo.current_ubatch_id()
        output = ubatch_body(part, ubatch_id, outer.programs[ubatch_id], rec)
        if ubatch_id == 0:
            thread = threading.Thread(target=helper, name="ubatch-0-helper", daemon=True)
            thread.start()
            thread.join(timeout=JOIN_TIMEOUT_S)
            assert not thread.is_alive(), f"the helper still runs after {JOIN_TIMEOUT_S} s"
        return output

    manager = WorkspaceManager("cpu", 2)
    rec = Record(manager, serial=False)
    output = dbo.overlap(ubatch, timeout_s=WATCHDOG_S)(outer.input())
    assert not helper_errors, helper_errors[0]
    check_events(outer, rec)
    assert torch.equal(output, run_serial(outer, manager))
