"""comm's per-ubatch groups and init_distributed across real processes (gloo on
loopback): duplicates match across ranks whatever each rank's group history, carry the
right timeout, take non-members along in step, and a process initializes again under a
shared store.
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
    """Duplicates are named by a counter every rank advances alike: ranks that are
    members of a different number of groups still rendezvous under the same names."""
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
    """In a world initialized elsewhere, the per-ubatch duplicates (which carry every
    collective made inside an overlap) get init_distributed's `timeout_s`, neither
    torch's default nor the world's own timeout (40 s here)."""
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
    """A subgroup's duplicates time out when the subgroup would (7 s), not at
    init_distributed's timeout."""
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


def _all_ranks_still_in_step() -> float:
    """A group creation and an all-reduce over the whole world of 3: they complete (3.0)
    only if every rank's group counter still agrees; otherwise the ranks hang."""
    import torch.distributed as dist

    everyone = dist.new_group([0, 1, 2])
    value = torch.ones(1)
    dist.all_reduce(value, group=everyone)
    return float(value[0])


def _repeated_ubatch_groups_with_non_members() -> list[Any]:
    import torch.distributed as dist

    start_together()
    rank = comm.init_distributed(timeout_s=15, num_ubatch_groups=0)[0]
    first = dist.new_group([0, 1])  # rank 2 is not a member
    second = dist.new_group([0, 2])  # rank 1 is not a member
    made = []
    for group, ranks, counts in ((first, [0, 1], (2, 2)), (second, [0, 2], (1, 2, 1))):
        for count in counts:  # the same calls on every rank (members ignore ranks=, key=)
            made.append(len(comm.ubatch_groups(group, count, ranks=ranks, key=tuple(ranks))))
            if rank in ranks:
                for duplicate in comm.ubatch_groups(group, count):
                    value = torch.ones(1)
                    dist.all_reduce(value, group=duplicate)
                    assert float(value[0]) == 2.0
    return [*made, _all_ranks_still_in_step()]


@pytest.mark.timeout(150)
def test_a_non_member_repeating_ubatch_groups_stays_in_step_with_the_members() -> None:
    """With `key=`, a non-member creates only the duplicates the members create: a
    repeated (group, 2) creates none, (group, 1) then (group, 2) one more, and every
    later group creation on the world still matches."""
    values = expect_ok(run_world(_repeated_ubatch_groups_with_non_members, 3, timeout_s=90))
    assert values[0] == [2, 2, 1, 2, 1, 3.0]
    assert values[1] == [2, 2, 0, 0, 0, 3.0]
    assert values[2] == [0, 0, 1, 2, 1, 3.0]


def _same_ranks_base_groups_one_call_each_without_key() -> list[Any]:
    import torch.distributed as dist

    start_together()
    comm.init_distributed(timeout_s=15, num_ubatch_groups=0)
    tensor_parallel = dist.new_group([0, 1])
    expert_parallel = dist.new_group([0, 1])  # the same ranks, another group
    made = [len(comm.ubatch_groups(g, 2, ranks=[0, 1])) for g in (tensor_parallel, expert_parallel)]
    return [*made, _all_ranks_still_in_step()]


@pytest.mark.timeout(150)
def test_same_rank_base_groups_with_one_call_each_need_no_key() -> None:
    """Without key=, every non-member call creates its groups: two base groups with the
    same ranks, one call each, stay in step."""
    values = expect_ok(
        run_world(_same_ranks_base_groups_one_call_each_without_key, 3, timeout_s=90)
    )
    assert values[0] == values[1] == [2, 2, 3.0]
    assert values[2] == [0, 0, 3.0]


def _same_ranks_base_groups_told_apart_by_key() -> list[Any]:
    import torch.distributed as dist

    start_together()
    rank = comm.init_distributed(timeout_s=15, num_ubatch_groups=0)[0]
    tensor_parallel = dist.new_group([0, 1])
    expert_parallel = dist.new_group([0, 1])  # the same ranks, another group
    made = []
    for group, key in ((tensor_parallel, "tp"), (expert_parallel, "ep"), (tensor_parallel, "tp")):
        made.append(len(comm.ubatch_groups(group, 2, ranks=[0, 1], key=key)))
    if rank < 2:
        duplicates = comm.ubatch_groups(tensor_parallel) + comm.ubatch_groups(expert_parallel)
        assert len(set(duplicates)) == 4
    return [*made, _all_ranks_still_in_step()]


@pytest.mark.timeout(150)
def test_a_non_member_tells_same_rank_base_groups_apart_by_key() -> None:
    """A non-member has no group object: `key=` (ignored by members) tells two base
    groups with the same ranks apart, so repeated calls stay in step."""
    values = expect_ok(run_world(_same_ranks_base_groups_told_apart_by_key, 3, timeout_s=90))
    assert values[0] == values[1] == [2, 2, 2, 3.0]
    assert values[2] == [0, 0, 0, 3.0]
