"""Leaks and load in one process: many overlapped calls of 2 and 4 ubatches (yields,
workspace requests, link transfers, recv hooks, stream switches) leave the live threads
at the baseline plus the pooled runners' workers, resident memory flat once warm, and
the workspace's capacity and buffers unchanged once warm."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest
import torch
from _stress import size
from _ubatch_programs import (
    Op,
    OverlappedCaller,
    Record,
    Schedule,
    check_events,
    run_serial,
)

import dbo
import workspace

pytestmark = pytest.mark.stress

CALLS = size(1_500, 10_000)
WARM_CALLS = size(300, 1_000)
"""Calls before the baseline of memory and workspace is taken."""
CHECK_EVERY = 100
MAX_RSS_GROWTH = 0.05

_A = (Op("workspace", 7), Op("yield"), Op("compute", 1), Op("link", 1), Op("yield"),
      Op("switch", 1), Op("hook"), Op("run_hooks"), Op("yield"), Op("sleep"))
_B = (Op("workspace", 3), Op("yield"), Op("hook"), Op("switch", 2), Op("compute"),
      Op("run_hooks"), Op("link"), Op("yield"), Op("nested"))
_C = (Op("run_hooks"), Op("nested", 1), Op("workspace", 5), Op("yield"), Op("hook"),
      Op("link", 1), Op("switch"), Op("workspace", 1), Op("yield"))
SCHEDULES = (
    Schedule((_A, _B, _C, _A), batch=13, seed=1),  # the largest workspace in every slot
    Schedule((_B, _C), batch=5, seed=2),
    Schedule((_C, _A, _B, _B), batch=8, seed=3),
    Schedule((_A, _C), batch=9, seed=4),
)
"""Calls cycle through these: unequal programs, 4 ubatches and 2 in turn."""


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _extra_threads(baseline: set[int]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.ident not in baseline)


WORKERS = sorted(f"dbo-ubatch-{i}-of-{n}" for n in (2, 4) for i in range(n))
"""The pooled runners' workers: one runner per ubatch count, since calls come one at a time."""


@pytest.fixture
def fresh_runners_and_manager() -> Iterator[workspace.WorkspaceManager]:
    dbo.close_default_runners()  # earlier tests' pooled workers are not this test's
    workspace.reset_workspace_manager()
    yield workspace.init_workspace_manager("cpu", 4)
    workspace.reset_workspace_manager()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
@pytest.mark.timeout(size(120, 1800))
def test_many_overlapped_calls_leak_no_threads_memory_or_workspace(
    fresh_runners_and_manager: workspace.WorkspaceManager,
) -> None:
    manager = fresh_runners_and_manager
    baseline = {t.ident for t in threading.enumerate()}
    schedules = SCHEDULES
    references = [run_serial(schedule, manager) for schedule in schedules]
    callers = {n: OverlappedCaller(n) for n in (2, 4)}
    warm_rss, warm_stats = 0, None
    for call in range(CALLS):
        if call == WARM_CALLS:
            gc.collect()
            warm_rss, warm_stats = _resident_bytes(), manager.stats()
            assert _extra_threads(baseline) == WORKERS
        schedule = schedules[call % len(schedules)]
        rec = Record(manager, serial=False)
        output = callers[schedule.num_ubatches](schedule, rec)
        check_events(schedule, rec)
        assert torch.equal(output, references[call % len(schedules)]), f"call {call}"
        if call % CHECK_EVERY == 0:
            extra = _extra_threads(baseline)
            assert set(extra) <= set(WORKERS) and len(extra) <= len(WORKERS), (
                f"after call {call}: threads beyond the baseline: {extra}"
            )
    gc.collect()
    end_rss = _resident_bytes()
    assert _extra_threads(baseline) == WORKERS
    assert manager.stats() == warm_stats, "the workspace changed after warmup"
    growth = (end_rss - warm_rss) / warm_rss
    assert growth < MAX_RSS_GROWTH, (
        f"resident memory grew {growth:.1%} from call {WARM_CALLS} to call {CALLS} "
        f"({warm_rss >> 20} MiB -> {end_rss >> 20} MiB)"
    )
