"""The collectives' argument checks refuse what the backend would get wrong (silently,
or by failing inside the launch) before anything is launched, and let through what
torch.distributed takes. A world of one (gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm


@pytest.mark.timeout(60)
def test_all_to_all_single_with_a_0dim_input_raises_a_value_error(world_of_one: None) -> None:
    with pytest.raises(ValueError, match="0-dim"):
        comm.all_to_all_single(torch.zeros(1), torch.tensor(1.0))


@pytest.mark.timeout(60)
def test_all_to_all_single_without_splits_needs_one_dim_0_on_both_sides(
    world_of_one: None,
) -> None:
    with pytest.raises(ValueError, match="must have the same dim 0"):
        comm.all_to_all_single(torch.empty(4, 2), torch.ones(2, 2))
    out = torch.empty(2, 2)
    comm.all_to_all_single(out, torch.ones(2, 2))  # equal: the plain op
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
def test_all_to_all_single_refuses_an_output_that_partly_overlaps_its_input(
    world_of_one: None,
) -> None:
    """Windows of one buffer shifted by a row would receive rows over rows not yet sent."""
    buffer = torch.arange(5.0)
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(buffer[1:], buffer[:-1])
    with pytest.raises(ValueError, match="share memory"):
        comm.all_to_all_single(buffer[:-1], buffer[1:])
    output = torch.empty(2)
    comm.all_to_all_single(buffer[3:], buffer[:2])  # disjoint windows: allowed
    comm.all_to_all_single(output, buffer[:2])
    torch.testing.assert_close(buffer[3:], output, rtol=0, atol=0)


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
    """Two distinct tensors without storage both report data_ptr() 0: not an alias."""
    out, source = _Wrapped(torch.zeros(4, 2)), _Wrapped(torch.arange(8.0).reshape(4, 2))
    assert out.data_ptr() == source.data_ptr() == 0
    comm.all_to_all_single(out, source)
    torch.testing.assert_close(out.inner, torch.arange(8.0).reshape(4, 2), rtol=0, atol=0)


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
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_an_average_of_integers_is_refused_before_the_launch(
    world_of_one: None, dtype: torch.dtype
) -> None:
    """gloo would all-reduce the sum into the tensor, then fail to cast the average."""
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


def test_the_integer_average_refusal_is_gloos_only() -> None:
    """NCCL averages integers (every dtype but bool); bool averages nowhere."""
    from comm._checks import require_reduce_op

    require_reduce_op(dist.ReduceOp.AVG, torch.int64, is_nccl=True)
    require_reduce_op(dist.ReduceOp.AVG, torch.bfloat16, is_nccl=False)
    require_reduce_op(dist.ReduceOp.SUM, torch.int64, is_nccl=False)
    for dtype, is_nccl in [(torch.int64, False), (torch.bool, False), (torch.bool, True)]:
        with pytest.raises(TypeError, match="AVG"):
            require_reduce_op(dist.ReduceOp.AVG, dtype, is_nccl=is_nccl)


@pytest.mark.timeout(60)
def test_all_reduce_takes_a_channels_last_tensor_as_torch_does(world_of_one: None) -> None:
    """Element-wise, a dense tensor in any memory format reduces as it is."""
    tensor = torch.arange(24.0).reshape(2, 3, 2, 2).to(memory_format=torch.channels_last)
    expected = tensor.clone()
    comm.all_reduce(tensor)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.arange(8.0).reshape(2, 4)[:, ::2])  # gaps: refused
