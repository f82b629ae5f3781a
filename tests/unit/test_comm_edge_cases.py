"""Review findings for `comm` that one process can show (world of one, gloo).

Each test reproduces a finding of a review (see its docstring) and guards its fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm
from comm.distributed import TORCHRUN_ENV_VARS


def _moe_layer_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0], [0, 1]])
    weights = torch.rand(5, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    expert_weight = torch.randn(4, 4, generator=generator, dtype=torch.float64,
                                requires_grad=True)
    return x, ids, weights, expert_weight


def _dense_reference(x, ids, weights, expert_weight):  # ids: unused, both experts equal
    # Both experts are the same matmul here, so the MoE output is sum_k w[t,k] * x[t] @ W.
    return (weights.unsqueeze(-1) * (x @ expert_weight).unsqueeze(1)).sum(dim=1)


@pytest.mark.timeout(60)
def test_combine_does_not_silently_drop_the_expert_gradient(world_of_one: None) -> None:
    """comm/moe.py:213-227: `combine` copies `expert_out` into a fresh buffer through
    torch.distributed (no autograd), yet returns a `y` that requires grad (through the
    weights). `y.backward()` then runs without error but the experts' parameters get no
    gradient: training silently never updates the experts. It must either propagate the
    gradient (an autograd.Function with the reverse all-to-all) or refuse."""
    x, ids, weights, expert_weight = _moe_layer_inputs()
    recv_x, _, handle = comm.moe.dispatch(x.detach(), ids, 2)
    expert_out = recv_x @ expert_weight
    try:
        y = comm.moe.combine(expert_out, handle, weights)
    except (RuntimeError, TypeError, ValueError) as error:
        assert "grad" in str(error)
        return
    y.sum().backward()
    reference_weight = expert_weight.detach().clone().requires_grad_(True)
    _dense_reference(x.detach(), ids, weights.detach(), reference_weight).sum().backward()
    assert expert_weight.grad is not None, "the experts got no gradient from combine"
    assert torch.allclose(expert_weight.grad, reference_weight.grad)


@pytest.mark.timeout(60)
def test_dispatch_does_not_silently_drop_the_token_gradient(world_of_one: None) -> None:
    """comm/moe.py:147-148: `recv_x` is written by all_to_all_single into `new_empty`, so
    it is detached from `x`; the MoE branch contributes no gradient to the layers below
    (only the residual does), silently. Propagate it or refuse an `x` that requires grad."""
    x, ids, weights, expert_weight = _moe_layer_inputs()
    try:
        recv_x, _, handle = comm.moe.dispatch(x, ids, 2)
    except (RuntimeError, TypeError, ValueError) as error:
        assert "grad" in str(error)
        return
    y = comm.moe.combine(recv_x @ expert_weight.detach(), handle, weights.detach())
    assert y.requires_grad, "y does not depend on x for autograd"
    y.sum().backward()
    reference_x = x.detach().clone().requires_grad_(True)
    _dense_reference(reference_x, ids, weights.detach(), expert_weight.detach()).sum().backward()
    assert torch.allclose(x.grad, reference_x.grad)


@pytest.mark.timeout(60)
def test_all_to_all_single_with_a_0dim_input_raises_a_clear_value_error(
    world_of_one: None,
) -> None:
    """comm/collectives.py:209-222: only `output.ndim == 0` is checked; a 0-dim `input`
    with a 1-dim `output` passes the row-shape check (both `shape[1:]` are `()`) and
    `check_split_sizes` then fails with a bare `IndexError: tuple index out of range`."""
    with pytest.raises(ValueError, match="0-dim"):
        comm.all_to_all_single(torch.zeros(1), torch.tensor(1.0))


@pytest.mark.timeout(60)
def test_a_non_member_group_says_not_a_member(world_of_one: None) -> None:
    """comm/_checks.py:36-46: on a rank outside a group, `dist.new_group` returns
    `GroupMember.NON_GROUP_MEMBER` (the int -100), so the "not a member of the group"
    branch is unreachable and the rank gets "group must be a ProcessGroup or None, got
    int" instead."""
    with pytest.raises(ValueError, match="not a member"):
        comm.all_reduce(torch.ones(1), group=dist.GroupMember.NON_GROUP_MEMBER)


@pytest.fixture
def partial_torchrun_env(
    monkeypatch: pytest.MonkeyPatch, cpu_machine_defaults: None
) -> Iterator[None]:
    for name in TORCHRUN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    comm.destroy_distributed()
    # A launcher that sets the rank and world size but not the rendezvous address.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield
    comm.destroy_distributed()


@pytest.mark.timeout(60)
def test_allow_single_process_does_not_ignore_a_world_size_of_two(
    partial_torchrun_env: None,
) -> None:
    """comm/distributed.py:155-161: `single = bool(missing)`: with RANK=1 WORLD_SIZE=2 set
    but MASTER_ADDR/MASTER_PORT missing, `allow_single_process=True` silently makes this
    process rank 0 of a world of 1 (each such process then trains alone). It should
    raise `TorchrunEnvironmentError` naming the missing variables."""
    try:
        result = comm.init_distributed(allow_single_process=True)
    except comm.TorchrunEnvironmentError as error:
        assert "MASTER_ADDR" in str(error)
        return
    pytest.fail(f"RANK=1 WORLD_SIZE=2 in the environment, but init returned {result}")


def test_nccl_duplicates_connect_when_created_not_inside_an_overlap(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The decision and its order, with gloo standing in for NCCL (no GPU here): every
    # new duplicate of an NCCL group runs its first collective at creation, outside any
    # overlap, so that no communicator is created lazily in a ubatch thread.
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
def test_a_destroyed_group_is_refused_even_after_a_successful_call(world_of_one: None) -> None:
    """Member groups are remembered to skip the membership check; a destroyed one must
    not be taken for a live one."""
    group = dist.new_group([0])
    comm.all_reduce(torch.ones(2), group=group)
    dist.destroy_process_group(group)
    with pytest.raises((ValueError, RuntimeError)):
        comm.all_reduce(torch.ones(2), group=group)


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


@pytest.mark.timeout(60)
def test_all_to_all_single_without_splits_needs_one_dim_0_on_both_sides(
    world_of_one: None,
) -> None:
    """Each side alone passed its check (dim 0 divisible by the group size), and gloo
    then failed inside with an enforce message instead of the documented ValueError."""
    with pytest.raises(ValueError, match="must have the same dim 0"):
        comm.all_to_all_single(torch.empty(4, 2), torch.ones(2, 2))
    out = torch.empty(2, 2)
    comm.all_to_all_single(out, torch.ones(2, 2))  # equal: still the plain op
    torch.testing.assert_close(out, torch.ones(2, 2), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_all_to_all_single_refuses_an_output_that_is_its_input(world_of_one: None) -> None:
    tensor = torch.arange(4.0).reshape(4, 1)
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(tensor, tensor)
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(tensor.view(2, 2), tensor.view(2, 2), [2], [2])
    parameter = torch.nn.Parameter(torch.zeros(4, 1), requires_grad=False)
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(parameter, parameter)
    empty = torch.empty(0, 3)
    comm.all_to_all_single(empty, empty)  # nothing to overwrite: allowed, as torch does


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensors_are_refused_with_a_type_error_that_says_so(
    world_of_one: None, layout: str
) -> None:
    dense = torch.eye(3)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(TypeError, match="dense \\(strided\\) tensors"):
        comm.all_reduce(sparse)
    with pytest.raises(TypeError, match="dense \\(strided\\) tensors"):
        comm.all_to_all_single(torch.empty(3, 3), sparse)


@pytest.mark.timeout(60)
def test_reduce_ops_made_afresh_per_call_do_not_grow_the_options_cache(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from comm import _launch

    monkeypatch.setattr(_launch, "_options_cache", {})  # filled here, not for later tests
    for _ in range(300):
        tensor = torch.ones(2)
        comm.all_reduce(tensor, op=dist.ReduceOp.RedOpType(2))  # MAX, a new object each time
        torch.testing.assert_close(tensor, torch.ones(2), rtol=0, atol=0)
        assert len(_launch._options_cache) <= _launch._MAX_CACHED_OPTIONS
    comm.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM)
    # A full cache of one-shot ops does not refuse the op in use.
    assert any(op is dist.ReduceOp.SUM for op, _ in _launch._options_cache.values())


class _Wrapped(torch.Tensor):
    """A wrapper subclass (no storage of its own: data_ptr() is 0), as tensor-subclass
    libraries make them; torch.distributed moves its inner tensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_map

        def unwrap(value: Any) -> Any:
            return value.inner if isinstance(value, _Wrapped) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


@pytest.mark.timeout(60)
def test_the_aliasing_check_leaves_tensors_without_storage_alone(world_of_one: None) -> None:
    """Two distinct tensors without storage both report data_ptr() 0: the aliasing
    check took them for one and refused a call torch.distributed makes."""
    out, source = _Wrapped(torch.zeros(4, 2)), _Wrapped(torch.arange(8.0).reshape(4, 2))
    assert out.data_ptr() == source.data_ptr() == 0
    comm.all_to_all_single(out, source)
    torch.testing.assert_close(out.inner, torch.arange(8.0).reshape(4, 2), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_subgroup_destroyed_alone_has_its_duplicates_destroyed_too(world_of_one: None) -> None:
    from comm._checks import _still_registered
    from comm.groups import destroy_ubatch_groups

    sub = dist.new_group([0])
    duplicates = comm.ubatch_groups(sub, 2)
    dist.destroy_process_group(sub)  # torch's own call, the subgroup only
    comm.ubatch_groups(None, 2)  # the registry notices the next time it creates groups
    assert not any(_still_registered(group) for group in duplicates)
    destroy_ubatch_groups()  # and does not destroy them a second time (an error)


@pytest.mark.timeout(60)
def test_all_to_all_single_refuses_an_output_that_partly_overlaps_its_input(
    world_of_one: None,
) -> None:
    """Only a shared first byte was refused: windows of one buffer shifted by a row gave
    silently wrong rows (received rows overwrote rows not yet sent)."""
    buffer = torch.arange(5.0)
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(buffer[1:], buffer[:-1])
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(buffer[:-1], buffer[1:])
    output = torch.empty(2)
    comm.all_to_all_single(buffer[3:], buffer[:2])  # disjoint windows: allowed
    comm.all_to_all_single(output, buffer[:2])
    torch.testing.assert_close(buffer[3:], output, rtol=0, atol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_an_average_of_integers_is_refused_before_the_launch(
    world_of_one: None, dtype: torch.dtype
) -> None:
    """gloo all-reduced the sum into the tensor, then failed to cast the average back:
    the tensor was clobbered and the error did not name the op."""
    tensor = torch.tensor([1, 10], dtype=dtype)
    before = tensor.clone()
    with pytest.raises(TypeError, match="AVG.*floating"):
        comm.all_reduce(tensor, op=dist.ReduceOp.AVG)
    assert torch.equal(tensor, before)
    with pytest.raises(TypeError, match="AVG.*floating"):
        comm.reduce_scatter_tensor(torch.empty(2, dtype=dtype), tensor, op=dist.ReduceOp.AVG)
    averaged = torch.tensor([1.0, 10.0])
    comm.all_reduce(averaged, op=dist.ReduceOp.AVG)  # a floating tensor averages
    torch.testing.assert_close(averaged, torch.tensor([1.0, 10.0]))


@pytest.mark.timeout(60)
def test_all_reduce_takes_a_channels_last_tensor_as_torch_does(world_of_one: None) -> None:
    """Element-wise, a dense tensor in any memory format reduces as it is; refusing a
    channels_last activation contradicted "outside an overlap: the plain op"."""
    tensor = torch.arange(24.0).reshape(2, 3, 2, 2).to(memory_format=torch.channels_last)
    expected = tensor.clone()
    comm.all_reduce(tensor)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.arange(8.0).reshape(2, 4)[:, ::2])  # gaps: still refused


def test_the_integer_average_refusal_is_gloos_only() -> None:
    """NCCL averages integers (torch maps AVG to ncclAvg for every dtype but bool); only
    gloo writes the sum and then fails to cast. Bool averages nowhere."""
    from comm._checks import require_reduce_op

    require_reduce_op(dist.ReduceOp.AVG, torch.int64, is_nccl=True)
    require_reduce_op(dist.ReduceOp.AVG, torch.bfloat16, is_nccl=False)
    require_reduce_op(dist.ReduceOp.SUM, torch.int64, is_nccl=False)
    for dtype, is_nccl in [(torch.int64, False), (torch.bool, False), (torch.bool, True)]:
        with pytest.raises(TypeError, match="AVG"):
            require_reduce_op(dist.ReduceOp.AVG, dtype, is_nccl=is_nccl)


@pytest.mark.timeout(60)
def test_ubatch_groups_refuses_more_duplicates_than_ubatches_can_be(world_of_one: None) -> None:
    from dbo._checks import MAX_NUM_UBATCHES

    with pytest.raises(ValueError, match="num_ubatches"):
        comm.ubatch_groups(None, MAX_NUM_UBATCHES + 1)


@pytest.mark.timeout(60)
def test_a_non_member_naming_itself_in_ranks_is_refused_at_once(world_of_one: None) -> None:
    """A rank that got NON_GROUP_MEMBER is not in the group: ranks= naming it (or a rank
    outside the world) is a mistake that failed only after the rendezvous timeout,
    leaving later group creations out of step."""
    with pytest.raises(ValueError, match="ranks"):
        comm.ubatch_groups(dist.GroupMember.NON_GROUP_MEMBER, ranks=[0])
    with pytest.raises(ValueError, match="ranks"):
        comm.ubatch_groups(dist.GroupMember.NON_GROUP_MEMBER, ranks=[1, 5])


@pytest.mark.timeout(60)
def test_a_non_members_count_does_not_depend_on_the_order_of_ranks(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`new_group` sorts the ranks: [2, 1] and [1, 2] are one group, and a non-member
    counting them apart created duplicates its peers did not."""
    from comm.groups import UBatchGroupRegistry

    registry = UBatchGroupRegistry()
    created: list[list[int]] = []
    monkeypatch.setattr(
        registry, "_new_group", lambda ranks, backend, index, timeout=None: created.append(ranks)
    )
    registry.create_for_non_member([2, 1], "gloo", 2, key="ep")
    registry.create_for_non_member([1, 2], "gloo", 2, key="ep")
    assert len(created) == 2
