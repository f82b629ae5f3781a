"""Randomized overlap schedules: 2-4 ubatches with unequal yield counts, sleeps, workspace
requests that grow the capacity mid-run, emulated-link transfers, recv hooks, nested
overlaps and stream switches. Each output equals the serial one bitwise, each ubatch's
workspace bytes survive the other ubatches' turns, and the turns follow the ring."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _stress import size
from _ubatch_programs import (
    KINDS,
    Op,
    Record,
    Schedule,
    check_events,
    check_schedule,
    expected_turns,
    schedules,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workspace

pytestmark = pytest.mark.stress

SCHEDULES_PER_COUNT = size(670, 33_400)
"""Schedules per ubatch count (2, 3 and 4): 2,010 bounded, 100,200 long."""

_SETTINGS = dict(
    derandomize=True,  # the same schedules on every run: a failure reproduces
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture
def fresh_manager() -> Iterator[None]:
    workspace.reset_workspace_manager()
    yield
    workspace.reset_workspace_manager()


def _fresh_manager(num_ubatches: int) -> workspace.WorkspaceManager:
    """A new process-wide manager with no capacity: the schedule's requests grow it."""
    workspace.reset_workspace_manager()
    return workspace.init_workspace_manager("cpu", num_ubatches)


@pytest.mark.timeout(size(120, 6 * 3600))
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@settings(max_examples=SCHEDULES_PER_COUNT, **_SETTINGS)
@given(data=st.data())
def test_random_schedules_match_the_serial_run(
    fresh_manager: None, num_ubatches: int, data: st.DataObject
) -> None:
    schedule = data.draw(schedules(num_ubatches), label="schedule")
    check_schedule(schedule, _fresh_manager(num_ubatches))


@pytest.mark.timeout(60)
def test_every_op_kind_in_one_schedule_of_each_ubatch_count(fresh_manager: None) -> None:
    """Each kind in each variant, so that the random tests' checks are known to see them."""
    everything = tuple(Op(kind, arg) for kind in dict.fromkeys(KINDS) for arg in range(8))
    for num_ubatches in (2, 3, 4):
        programs = tuple(everything[i:] + everything[:i] for i in range(num_ubatches))
        check_schedule(Schedule(programs, 3 * num_ubatches + 1, 7), _fresh_manager(num_ubatches))


@pytest.mark.timeout(10)
def test_expected_turns_go_round_the_ring_skipping_finished_ubatches() -> None:
    assert expected_turns([0, 0]) == [(0, 0), (1, 0)]
    assert expected_turns([2, 0, 1]) == [
        (0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2),
    ]
    assert expected_turns([0, 3]) == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]  # left alone


class _OneBufferForAll:
    """A broken workspace that gives every ubatch views of the same bytes."""

    capacity_bytes = 1 << 20

    def __init__(self) -> None:
        self._buffer = torch.zeros(self.capacity_bytes, dtype=torch.uint8)

    def get_simultaneous(self, *requests: tuple[tuple[int, ...], torch.dtype]) -> list[Any]:
        views, offset = [], 0
        for shape, dtype in requests:
            num_bytes = math.prod(shape) * dtype.itemsize
            views.append(self._buffer[offset:offset + num_bytes].view(dtype).view(shape))
            offset += -(-num_bytes // 256) * 256
        return views


@pytest.mark.timeout(30)
def test_the_checks_catch_ubatches_that_share_workspace_bytes() -> None:
    program = (Op("workspace", 2),)
    with pytest.raises(AssertionError, match="workspace bytes changed across a yield"):
        check_schedule(Schedule((program, program), 4, 0), _OneBufferForAll())  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_the_checks_catch_turns_out_of_ring_order_and_a_hook_in_the_wrong_ubatch() -> None:
    schedule = Schedule(((Op("yield"),), (Op("yield"),)), 2, 0)
    rec = Record(workspace.WorkspaceManager("cpu", 2), serial=False)
    rec.threads = {0: -1, 1: -2}
    rec.events = [("turn", 0, 0), ("turn", 0, 1), ("turn", 1, 0), ("turn", 1, 1)]
    with pytest.raises(AssertionError, match="ring order"):
        check_events(schedule, rec)
    rec.events = [("turn", 0, 0), ("reg", 0, 0), ("hook", 0, 0, 0), ("turn", 1, 0),
                  ("turn", 0, 1), ("turn", 1, 1)]
    with pytest.raises(AssertionError, match="ran in ubatch 0, not 1"):
        check_events(schedule, rec)
    rec.events = [("turn", 0, 0), ("reg", 0, 0), ("turn", 1, 0), ("turn", 0, 1),
                  ("turn", 1, 1)]
    with pytest.raises(AssertionError, match="never ran"):
        check_events(schedule, rec)
