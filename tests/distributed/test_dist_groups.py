"""Review findings for `comm` that need several real processes (gloo on loopback).

Each test reproduces a finding of a review (see its docstring) and guards its fix.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from _spawn import expect_ok, run_world, start_together

import comm

pytestmark = pytest.mark.distributed


def _duplicates_of_a_subgroup_after_an_uneven_group_history() -> list[str]:
    """Rank 0 is a member of one more group than rank 1 (a one-rank group, e.g. a
    per-rank logging/checkpoint group). Both then create the duplicates of their shared
    subgroup, the same number of times, in the same order, outside any overlap, exactly
    as `comm.ubatch_groups` asks."""
    import torch.distributed as dist

    start_together()
    comm.init_distributed(timeout_s=8)
    shared = dist.new_group([0, 1])  # every rank calls new_group: a plain collective
    dist.new_group([0])  # rank 0 is a member, rank 1 is not (it gets NON_GROUP_MEMBER)
    duplicates = comm.ubatch_groups(shared, 2)
    # They must be usable: one all_reduce on each.
    for group in duplicates:
        value = torch.ones(1)
        dist.all_reduce(value, group=group)
        assert float(value[0]) == 2.0
    return [group.group_name for group in duplicates]


@pytest.mark.timeout(120)
def test_ubatch_groups_of_a_subgroup_match_across_ranks_with_uneven_group_history() -> None:
    """comm/groups.py:101-110 (line 107) creates subgroup duplicates with
    use_local_synchronization=True, whose group name is
    sha1(ranks + len(_world.pg_names)) on *each* rank: ranks that are members of a
    different number of groups pick different names, rendezvous under different store
    prefixes, and wait until the timeout (a hang with the default 300 s)."""
    values = expect_ok(run_world(
        _duplicates_of_a_subgroup_after_an_uneven_group_history, 2, timeout_s=60
    ))
    assert values[0] == values[1]


def _adopted_world_duplicates_get_the_timeout() -> list[Any]:
    import torch.distributed as dist

    start_together()
    dist.init_process_group("gloo", timeout=timedelta(seconds=40))  # env:// from _spawn
    return _new_group_timeouts(lambda: comm.init_distributed(timeout_s=20))


def _new_group_timeouts(call: Any) -> list[Any]:
    """The `timeout` of each `dist.new_group` that `call()` makes."""
    import torch.distributed as dist

    seen: list[Any] = []
    original = dist.new_group

    def recording_new_group(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("timeout"))
        return original(*args, **kwargs)

    dist.new_group = recording_new_group
    try:
        call()
    finally:
        dist.new_group = original
    return seen


@pytest.mark.timeout(120)
def test_adopted_world_duplicate_groups_use_the_given_timeout() -> None:
    """comm/distributed.py:133-139: when the world was initialized elsewhere, the
    registry's timeout stays None, so the per-ubatch duplicates (which carry every
    collective made inside an overlap) get torch's default timeout (30 min for gloo)
    instead of `timeout_s`: a diverged peer hangs for 30 minutes. The world's own
    timeout (40 s here) differs, so that taking it instead of `timeout_s` fails too."""
    values = expect_ok(run_world(_adopted_world_duplicates_get_the_timeout, 2, timeout_s=60))
    for seen in values:
        assert len(seen) == 2, seen
        assert all(timeout == timedelta(seconds=20) for timeout in seen), seen


def _subgroup_duplicates_record_timeouts() -> list[Any]:
    import torch.distributed as dist

    start_together()
    comm.init_distributed(timeout_s=30)
    shared = dist.new_group([0, 1], timeout=timedelta(seconds=7))
    return _new_group_timeouts(lambda: comm.ubatch_groups(shared, 2))


@pytest.mark.timeout(120)
def test_duplicates_of_a_subgroup_get_the_subgroups_timeout() -> None:
    """comm/groups.py _new_group gave every duplicate the registry's one timeout (that of
    init_distributed): a subgroup made with a short timeout got duplicates that waited
    for the long one inside an overlap, where a diverged peer should raise soonest."""
    values = expect_ok(run_world(_subgroup_duplicates_record_timeouts, 2, timeout_s=60))
    for seen in values:
        assert seen == [timedelta(seconds=7)] * 2, seen


def _duplicates_with_a_non_member() -> list[int]:
    import torch.distributed as dist

    start_together()
    comm.init_distributed(timeout_s=8)
    only_rank0 = dist.new_group([0])
    if dist.get_rank() == 0:
        duplicates = comm.ubatch_groups(only_rank0, 2)
        for group in duplicates:
            value = torch.ones(1)
            dist.all_reduce(value, group=group)
        return [dist.get_world_size(group) for group in duplicates]
    assert comm.ubatch_groups(only_rank0, 2, ranks=[0]) == ()
    with pytest.raises(ValueError, match="ranks="):
        comm.ubatch_groups(only_rank0, 2)
    return []


@pytest.mark.timeout(120)
def test_a_non_member_takes_part_in_creating_a_subgroups_duplicates() -> None:
    values = expect_ok(run_world(_duplicates_with_a_non_member, 2, timeout_s=60))
    assert values == [[1, 1], []]


def _initialize_again_skewed() -> list[float]:
    """Three worlds in a row in one process, as torchrun's ranks see them (clients of
    one long-lived store), rank 1 always a second behind: torch names the new world's
    groups "0", "1", ... again, and without a prefix per world their rendezvous keys
    are the old world's, where a late rank reads a peer's closed address."""
    start_together()
    totals = []
    for _ in range(3):
        if int(os.environ["RANK"]) == 1:
            time.sleep(1.0)
        comm.init_distributed(timeout_s=10)
        total = torch.ones(1)
        comm.all_reduce(total)
        totals.append(float(total.item()))
        comm.destroy_distributed()
    return totals


@pytest.mark.timeout(120)
def test_initializing_again_in_one_process_under_a_shared_store() -> None:
    values = expect_ok(run_world(_initialize_again_skewed, 2, timeout_s=90))
    assert values == [[2.0, 2.0, 2.0]] * 2
