"""comm.init_distributed / destroy_distributed / ubatch_groups in one process (no spawn)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import comm
import dbo
from comm.distributed import TORCHRUN_ENV_VARS
from comm.groups import group_registry


@pytest.fixture
def no_torchrun_env(
    monkeypatch: pytest.MonkeyPatch, cpu_machine_defaults: None
) -> Iterator[None]:
    for name in TORCHRUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    comm.destroy_distributed()
    yield
    comm.destroy_distributed()


def test_without_torchrun_env_the_error_shows_the_command(no_torchrun_env: None) -> None:
    with pytest.raises(comm.TorchrunEnvironmentError) as info:
        comm.init_distributed()
    message = str(info.value)
    assert "torchrun --nproc-per-node 2" in message
    assert "--nnodes" in message
    assert all(name in message for name in TORCHRUN_ENV_VARS)
    assert "allow_single_process=True" in message
    assert isinstance(info.value, RuntimeError)
    assert not dist.is_initialized()


def test_the_command_names_the_script_as_it_was_started(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pasted where the program was started, the command must find the script."""
    monkeypatch.setattr("sys.argv", ["examples/moe_overlap.py", "--layers", "2"])
    expected = "nproc-per-node 2 examples/moe_overlap.py"
    with pytest.raises(comm.TorchrunEnvironmentError, match=expected):
        comm.init_distributed()


def test_single_process_world_and_idempotence(no_torchrun_env: None) -> None:
    rank, world_size, device = comm.init_distributed(allow_single_process=True)
    assert (rank, world_size, device) == (0, 1, torch.device("cpu"))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert comm.init_distributed(allow_single_process=True) == (0, 1, device)
    # Without the environment but already initialized: no error, same answer.
    assert comm.init_distributed() == (0, 1, device)
    comm.destroy_distributed()
    assert not dist.is_initialized()
    comm.destroy_distributed()  # idempotent


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"backend": "nccl"}, "already initialized with backend 'gloo'"),
        ({"backend": "mpi"}, "already initialized with backend 'gloo'"),
        ({"device": "meta"}, "already initialized for device cpu"),
    ],
)
def test_a_later_call_that_contradicts_the_world_is_refused(
    no_torchrun_env: None, kwargs: dict, text: str
) -> None:
    """Idempotence returns the existing world; a later call asking for another backend
    or device would get it silently and run on what it did not ask for."""
    expected = comm.init_distributed(allow_single_process=True)
    with pytest.raises(ValueError, match=text) as raised:
        comm.init_distributed(allow_single_process=True, **kwargs)
    assert "comm.destroy_distributed()" in str(raised.value)
    # What agrees with the world (any spelling of it) is still just the same answer.
    assert comm.init_distributed(backend="GLOO", device="cpu") == expected
    assert comm.init_distributed(device=torch.device("cpu")) == expected
    assert comm.init_distributed(device="cpu:0") == expected  # cpu:N is the one CPU
    assert comm.init_distributed(device=torch.device("cpu", 1)) == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"timeout_s": 0}, ValueError, "timeout_s must be a number of seconds in"),
        ({"timeout_s": "10"}, TypeError, "timeout_s"),
        ({"backend": 3}, TypeError, "backend"),
        ({"backend": "nccl", "device": "cpu"}, ValueError, "needs a CUDA device"),
        ({"num_ubatch_groups": -1}, ValueError, "num_ubatch_groups"),
    ],
)
def test_bad_arguments(no_torchrun_env: None, kwargs: dict, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        comm.init_distributed(allow_single_process=True, **kwargs)
    assert not dist.is_initialized()


def test_init_inside_an_overlap_is_refused(no_torchrun_env: None) -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        comm.init_distributed(allow_single_process=True)
        return x

    with pytest.raises(RuntimeError, match="inside dbo.overlap"):
        dbo.overlap(body)(torch.zeros(2))
    assert not dist.is_initialized()


def test_ubatch_groups_are_created_outside_and_only_looked_up_inside(
    no_torchrun_env: None,
) -> None:
    with pytest.raises(RuntimeError, match="init_distributed"):
        comm.ubatch_groups()
    comm.init_distributed(allow_single_process=True)
    world = dist.group.WORLD
    assert group_registry().lookup(world, 1) is world  # a world of one gets none
    groups = comm.ubatch_groups(None, 2)
    assert len(groups) == 2 and len({id(g) for g in groups}) == 2
    assert all(dist.get_world_size(g) == 1 for g in groups)
    assert comm.ubatch_groups(None, 2) == groups  # no new groups
    assert comm.ubatch_groups(None, 1) == groups[:1]
    assert [group_registry().lookup(world, u) for u in range(3)] == [
        groups[0], groups[1], groups[0]
    ]
    with pytest.raises(ValueError, match="itself a per-ubatch duplicate"):
        comm.ubatch_groups(groups[0])
    with pytest.raises(ValueError, match=r"num_ubatches must be in \[1, "):
        comm.ubatch_groups(None, 0)

    seen = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append(comm.ubatch_groups(None, 2))  # existing: fine inside
        comm.ubatch_groups(None, 3)  # would create a group: refused
        return x

    with pytest.raises(RuntimeError, match="outside dbo.overlap"):
        dbo.overlap(body)(torch.zeros(2))
    assert seen and seen[0] == groups
    assert len(comm.ubatch_groups(None, 2)) == 2
    comm.destroy_distributed()
    assert group_registry().clear() == [], "destroy_distributed forgets the duplicates"


@pytest.mark.parametrize(
    ("env", "error", "text"),
    [
        # RANK etc. without WORLD_SIZE is a launch mistake, not a world of one.
        ({"RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         comm.TorchrunEnvironmentError, "missing: WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, comm.TorchrunEnvironmentError, "missing: RANK"),
        # A launcher that sets the ranks but not the rendezvous address: never rank 0 of 1.
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
         comm.TorchrunEnvironmentError, "MASTER_ADDR"),
        ({"WORLD_SIZE": "1", "RANK": "1"}, ValueError, r"RANK must be in \[0, WORLD_SIZE=1\)"),
        ({"WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, ValueError, "LOCAL_RANK must be >= 0"),
        ({"WORLD_SIZE": "0"}, comm.TorchrunEnvironmentError, "missing"),
        ({"LOCAL_RANK": "1"}, comm.TorchrunEnvironmentError, "missing"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "1"}, ValueError, r"RANK must be in \[0, WORLD_SIZE=2\)"),
        ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "1"}, ValueError, "WORLD_SIZE must be >= 1"),
    ],
)
def test_a_partial_or_inconsistent_environment_is_refused(
    no_torchrun_env: None,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    error: type,
    text: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=text):
        comm.init_distributed(allow_single_process=True, timeout_s=5)
    assert not dist.is_initialized()


def test_world_size_one_alone_runs_as_a_single_process(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert comm.init_distributed(allow_single_process=True)[:2] == (0, 1)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), -1.0, 1e15, 10**400])
def test_timeout_must_be_positive_and_not_huge(no_torchrun_env: None, timeout_s: float) -> None:
    # 1e15 s would overflow inside torch; 10**400 is too large for a float.
    with pytest.raises(ValueError, match=r"number of seconds in \(0, 1e\+08\]"):
        comm.init_distributed(allow_single_process=True, timeout_s=timeout_s)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "env",
    [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},  # a batch script's exports
        {"LOCAL_RANK": "0"},
        {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
    ],
)
def test_variables_that_say_nothing_of_several_ranks_allow_a_single_process(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert comm.init_distributed(allow_single_process=True)[:2] == (0, 1)


def test_a_world_torn_down_and_started_again_with_torchs_own_calls(no_torchrun_env: None) -> None:
    """`dist.destroy_process_group()` destroys every group, duplicates included: the
    registry forgets them, and the next init_distributed adopts the new world as new."""
    comm.init_distributed(allow_single_process=True, timeout_s=300)
    old = comm.ubatch_groups(None, 2)
    # As a non-member of a 2-rank group would have counted (a 1-rank world has none):
    # in the next world, those counts would make it skip creations its peers make.
    group_registry()._created_as_non_member[((1, 2), "gloo", "key")] = 2
    dist.destroy_process_group()  # torch's own teardown
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert comm.init_distributed(timeout_s=42) == (0, 1, torch.device("cpu"))
    assert group_registry().timeout_s == 42, "the new world is adopted with this call's timeout"
    new = comm.ubatch_groups(None, 2)
    assert group_registry()._created_as_non_member == {}
    for group in new:  # registered in the new world: comm's collectives run on them
        comm.all_reduce(torch.ones(1), group=group)
    assert not any(group in new for group in old)
    out = dbo.overlap(lambda t: (comm.all_reduce(t), t)[1], timeout_s=30)(torch.ones(4))
    torch.testing.assert_close(out, torch.ones(4), rtol=0, atol=0)
    comm.destroy_distributed()
    assert not dist.is_initialized()
    assert group_registry().clear() == []


def test_destroy_distributed_after_torchs_own_teardown_only_forgets(no_torchrun_env: None) -> None:
    comm.init_distributed(allow_single_process=True)
    comm.ubatch_groups(None, 2)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.destroy_distributed()  # the duplicates are gone already: only forgotten
    assert not dist.is_initialized()


def test_adopting_a_world_refuses_another_backend_than_its_own(no_torchrun_env: None) -> None:
    """A world started with torch's own call and adopted by the first init_distributed
    is checked against that call's backend too."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="already initialized with backend 'gloo'"):
        comm.init_distributed(backend="nccl")
    assert comm.init_distributed(backend="gloo") == (0, 1, torch.device("cpu"))
