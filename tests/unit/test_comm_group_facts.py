"""comm._checks caches what every collective asks of its group (size, backend): the
cache must never outlive the group, answer for another group, or keep a group alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import comm
from comm import _checks


@pytest.mark.timeout(60)
def test_the_facts_are_the_groups_own(world_of_one: None) -> None:
    group, facts = _checks.resolve_group_and_facts(None)
    assert group is dist.group.WORLD
    assert facts == _checks.GroupFacts(size=group.size(), is_nccl=False)
    again, facts_again = _checks.resolve_group_and_facts(None)  # from the cache
    assert again is group and facts_again == facts


@pytest.mark.timeout(60)
def test_the_default_group_of_a_new_world_is_the_new_one(world_of_one: None) -> None:
    old, _ = _checks.resolve_group_and_facts(None)
    comm.destroy_distributed()
    comm.init_distributed(allow_single_process=True)
    new, facts = _checks.resolve_group_and_facts(None)
    assert new is dist.group.WORLD
    assert new is not old  # `old` is alive here, so the two cannot share an id
    assert facts.size == 1
    x = torch.ones(2)
    comm.all_reduce(x)
    assert torch.equal(x, torch.ones(2))


@pytest.mark.timeout(60)
def test_a_destroyed_group_is_refused_after_it_was_cached(world_of_one: None) -> None:
    sub = dist.new_group([0])
    x = torch.ones(2)
    comm.all_reduce(x, group=sub)  # resolved and cached
    dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match="not registered"):
        comm.all_reduce(x, group=sub)


@pytest.mark.timeout(60)
def test_the_cache_keeps_no_group_alive(world_of_one: None) -> None:
    """A destroyed group must go (its sockets and threads with it), and its entry too."""
    sub = dist.new_group([0])
    comm.all_reduce(torch.ones(2), group=sub)
    assert sub in _checks._known
    entries = len(_checks._known)
    dist.destroy_process_group(sub)
    reference = weakref.ref(sub)
    del sub
    gc.collect()
    assert reference() is None
    assert len(_checks._known) == entries - 1


@pytest.mark.timeout(60)
def test_a_non_member_and_a_non_group_still_get_the_clear_errors(world_of_one: None) -> None:
    with pytest.raises(ValueError, match="not a member"):
        comm.all_reduce(torch.ones(2), group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="ProcessGroup or None"):
        comm.all_reduce(torch.ones(2), group="world")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_group_of_a_destroyed_world_is_refused(world_of_one: None) -> None:
    group = dist.new_group([0])
    comm.all_reduce(torch.ones(2), group=group)
    comm.destroy_distributed()
    with pytest.raises(RuntimeError, match="not initialized"):
        comm.all_reduce(torch.ones(2), group=group)
    comm.init_distributed(allow_single_process=True)
    with pytest.raises((ValueError, RuntimeError)):
        comm.all_reduce(torch.ones(2), group=group)  # a group of the old world
