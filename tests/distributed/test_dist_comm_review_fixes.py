"""Review fixes for `comm` that need several real processes (gloo on loopback).

Each test reproduces a finding of a review (see its docstring) and guards its fix.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from _spawn import expect_ok, run_world, start_together

import comm

pytestmark = pytest.mark.distributed


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
    """comm/groups.py create_for_non_member created every duplicate again on each call,
    where the members (get_or_create) create only the missing ones: after a repeated
    `ubatch_groups(group, 2)` the non-member's new_group counter ran ahead and every
    later new_group on the world hung. Likewise (group, 1) then (group, 2) must create
    one more group on the non-member, and (group, 1) after that none."""
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
    """Counting a non-member's duplicates per ranks alone made two base groups with the
    same ranks look like one: the non-member created 2 groups where the members created
    4, and the next group creation hung. Without key= every call creates its groups."""
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
    """A non-member has no group object, so it counts duplicates per (ranks, backend):
    two base groups with the same ranks would look like one and the non-member would
    create too few. `key=` (ignored by members) tells them apart."""
    values = expect_ok(run_world(_same_ranks_base_groups_told_apart_by_key, 3, timeout_s=90))
    assert values[0] == values[1] == [2, 2, 2, 3.0]
    assert values[2] == [0, 0, 0, 3.0]


def _waits_after_a_peer_never_joins(first_timeout_ms: int | None) -> list[str]:
    start_together()
    rank = comm.init_distributed(timeout_s=3)[0]
    if rank == 1:
        time.sleep(12)  # never joins the all-reduce below
        return []
    seen: list[str] = []
    handle = comm.all_reduce(torch.ones(2), async_op=True)
    assert handle is not None
    if first_timeout_ms is not None:
        try:  # the caller's own timeout: the collective is still in flight afterwards
            handle.wait(timedelta(milliseconds=first_timeout_ms))
            seen.append("returned")
        except RuntimeError:
            seen.append("in flight" if "in flight" in repr(handle) else repr(handle))
    errors = []
    for _ in range(3):  # the group's timeout: a failure, raised by every later wait
        try:
            seen.append(f"returned {handle.wait()!r}")
        except RuntimeError as error:
            errors.append(error)
            seen.append("raised")
    same = all(type(e) is type(errors[0]) and str(e) == str(errors[0]) for e in errors)
    seen.append("same error" if same else "other errors")
    return seen


@pytest.mark.timeout(120)
def test_a_wait_after_a_failed_wait_raises_again() -> None:
    """CollectiveWork.wait set `_done` before waiting: when a peer never joined, the first
    wait raised the group's timeout and the second returned as if the all-reduce had
    completed (torch's Work raises again, the same exception; the handle raises an
    equal copy, which holds no frames)."""
    results = run_world(
        _waits_after_a_peer_never_joins, 2, args=(None,), timeout_s=60, exit_timeout_s=3
    )
    assert results[0].ok, results[0].traceback
    assert results[0].value == ["raised", "raised", "raised", "same error"]


@pytest.mark.timeout(120)
def test_a_wait_whose_own_timeout_passed_leaves_the_collective_in_flight() -> None:
    """`wait(timeout)` passes torch's timeout through: it raises when it passes, and the
    handle stays in flight (as torch's Work: a later wait waits again) until the
    collective itself fails, after which every wait raises that failure."""
    results = run_world(
        _waits_after_a_peer_never_joins, 2, args=(300,), timeout_s=60, exit_timeout_s=3
    )
    assert results[0].ok, results[0].traceback
    assert results[0].value == ["in flight", "raised", "raised", "raised", "same error"]


def _gather_layouts() -> list[Any]:
    start_together()
    rank, world = comm.init_distributed(timeout_s=15)[:2]
    refused = []
    for call in (
        lambda: comm.reduce_scatter_tensor(torch.zeros(()), torch.ones(world)),  # gloo: SIGSEGV
        lambda: comm.reduce_scatter_tensor(torch.zeros(3), torch.ones(world, 3)),
        lambda: comm.all_gather_into_tensor(torch.zeros(world, 3), torch.ones(3)),
        lambda: comm.all_gather_into_tensor(torch.zeros(world), torch.ones(())),
    ):
        try:
            call()
            refused.append("launched")
        except ValueError as error:
            refused.append("concatenation" in str(error))
    # Nothing was launched above: the next collectives match across ranks.
    gathered = torch.zeros(world * 2, 3)
    comm.all_gather_into_tensor(gathered, torch.full((2, 3), float(rank)))
    scattered = torch.zeros(2)
    comm.reduce_scatter_tensor(scattered, torch.arange(world * 2.0))
    return [refused, gathered[:, 0].tolist(), scattered.tolist()]


@pytest.mark.timeout(120)
def test_gloo_layouts_are_checked_before_launching_across_ranks() -> None:
    """comm accepted the documented [world_size, n] layouts that ProcessGroupGloo then
    rejected; a 0-dim reduce-scatter output crashed the rank inside gloo (SIGSEGV).
    Refused on every rank before anything is launched, the ranks stay in step."""
    values = expect_ok(run_world(_gather_layouts, 2, timeout_s=60))
    for rank, (refused, gathered, scattered) in enumerate(values):
        assert refused == [True] * 4
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert scattered == [4.0 * rank, 4.0 * rank + 2.0]
