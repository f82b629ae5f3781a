"""The per-ubatch group registry in one process (a world of one): argument checks that
keep the ranks' group creations in step, NCCL communicators connected at creation, and
duplicates destroyed with their base group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import comm
import dbo


def test_nccl_duplicates_connect_when_created_not_inside_an_overlap(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gloo stands in for NCCL (no GPU here): every new duplicate of an NCCL group runs
    # its first collective at creation, so no communicator is created in a ubatch thread.
    from comm import groups

    connected: list[object] = []
    create = groups.UBatchGroupRegistry._new_group

    def new_gloo_group(
        self: object, ranks: list[int], backend: str, index: int, timeout: object = None
    ) -> object:
        assert backend == "nccl"
        return create(self, ranks, "gloo", index, timeout)  # type: ignore[arg-type]

    monkeypatch.setattr(groups.UBatchGroupRegistry, "_new_group", new_gloo_group)
    monkeypatch.setattr(groups.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(groups, "connect_now", connected.append)
    duplicates = comm.ubatch_groups(None, 2)
    assert connected == list(duplicates) and len(duplicates) == 2
    assert comm.ubatch_groups(None, 2) == duplicates and len(connected) == 2  # once


@pytest.mark.timeout(60)
def test_a_subgroup_destroyed_alone_has_its_duplicates_destroyed_too(world_of_one: None) -> None:
    from comm._checks import still_registered
    from comm.groups import destroy_ubatch_groups

    sub = dist.new_group([0])
    duplicates = comm.ubatch_groups(sub, 2)
    dist.destroy_process_group(sub)  # torch's own call, the subgroup only
    comm.ubatch_groups(None, 2)  # the registry notices the next time it creates groups
    assert not any(still_registered(group) for group in duplicates)
    destroy_ubatch_groups()  # and does not destroy them a second time (an error)


@pytest.mark.timeout(60)
def test_ubatch_groups_refuses_more_duplicates_than_ubatches_can_be(world_of_one: None) -> None:
    with pytest.raises(ValueError, match="num_ubatches"):
        comm.ubatch_groups(None, dbo.MAX_NUM_UBATCHES + 1)


@pytest.mark.timeout(60)
def test_a_non_member_naming_itself_in_ranks_is_refused_at_once(world_of_one: None) -> None:
    """ranks= naming this rank, or a rank outside the world, raises before any
    rendezvous (which would time out and leave later group creations out of step)."""
    with pytest.raises(ValueError, match="ranks"):
        comm.ubatch_groups(dist.GroupMember.NON_GROUP_MEMBER, ranks=[0])
    with pytest.raises(ValueError, match="ranks"):
        comm.ubatch_groups(dist.GroupMember.NON_GROUP_MEMBER, ranks=[1, 5])


@pytest.mark.timeout(60)
def test_a_non_members_count_does_not_depend_on_the_order_of_ranks(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`new_group` sorts the ranks: [2, 1] and [1, 2] are one group."""
    from comm.groups import UBatchGroupRegistry

    registry = UBatchGroupRegistry()
    created: list[list[int]] = []
    monkeypatch.setattr(
        registry, "_new_group", lambda ranks, backend, index, timeout=None: created.append(ranks)
    )
    registry.create_for_non_member([2, 1], "gloo", 2, key="ep")
    registry.create_for_non_member([1, 2], "gloo", 2, key="ep")
    assert len(created) == 2


def test_nccl_duplicates_ask_for_high_priority_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ubatch's transfer kernels should not queue behind the other ubatch's compute."""
    from comm.groups import high_priority_options

    class FakeNccl:
        class Options:
            is_high_priority_stream = False

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    options = high_priority_options("nccl")
    assert isinstance(options, FakeNccl.Options) and options.is_high_priority_stream is True
    assert high_priority_options("gloo") is None
    assert high_priority_options("cpu:gloo,cuda:nccl") is None  # defaults for a mixed group
    monkeypatch.delattr(dist, "ProcessGroupNCCL")
    assert high_priority_options("nccl") is None
