"""Launching a checked collective on a process group.

For a plain call `comm` calls the process group's method itself, skipping the argument
checks and dispatch of torch.distributed's function (`comm` has checked already), which
saves host time on every collective (`benchmarks/host_overhead.py`). Plain: a group of
exactly `ProcessGroup`; no `__torch_function__` to honour (subclass or active mode); not
complex; a group not coalescing; no `torch.compile` tracing. Anything else goes through
torch.distributed's function. A failure on the direct path is raised but not written to
torch's `c10d_logger`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

_ProcessGroup = dist.ProcessGroup


def _method(*names: str) -> Any:
    """The first of `names` this torch's ProcessGroup has (newest first), or None."""
    for name in names:
        method = getattr(_ProcessGroup, name, None)
        if method is not None:
            return method
    return None


class _Direct(NamedTuple):
    """What the direct launch of one collective needs from this torch."""

    method: Any  # the ProcessGroup method torch.distributed's function calls
    options_type: Any  # its options type (`AllreduceOptions`, ...)
    has_async_op: bool  # whether those options have `asyncOp` (newer torch)
    plain_options: tuple[Any, Any]  # without a reduce op, blocking and async, built once


def _new_options(
    options_type: Any, has_async_op: bool, async_op: bool, reduce_op: Any = None
) -> Any:
    options = options_type()
    if has_async_op:
        options.asyncOp = async_op
    if reduce_op is not None:
        options.reduceOp = reduce_op
    return options


def _fast(options_type: str, *names: str) -> _Direct | None:
    """The direct launch of a collective, or None if this torch lacks the method or the
    options type."""
    method, options = _method(*names), getattr(_c10d, options_type, None)
    if method is None or options is None:
        return None
    has_async_op = hasattr(options(), "asyncOp")
    blocking, async_ = (_new_options(options, has_async_op, flag) for flag in (False, True))
    return _Direct(method, options, has_async_op, (blocking, async_))


_ALL_TO_ALL = _fast("AllToAllOptions", "all_to_all_single", "alltoall_base")
_ALL_REDUCE = _fast("AllreduceOptions", "allreduce")
_ALL_GATHER = _fast("AllgatherOptions", "all_gather_single", "_allgather_base")
_REDUCE_SCATTER = _fast("ReduceScatterOptions", "reduce_scatter_single", "_reduce_scatter_base")
_RedOpType = dist.ReduceOp.RedOpType
_has_torch_function = torch._C._has_torch_function
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _plain(group: dist.ProcessGroup, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether torch.distributed's function would call `group`'s method with these
    tensors as they are (`first` and `second` have one dtype)."""
    try:
        # Read at each call (torch's test backends replace `_world`); unknown: torch's path.
        coalescing = _c10d._world.pg_coalesce_state
    except AttributeError:
        return False
    return (
        type(group) is _ProcessGroup
        and not _has_torch_function((first, second))
        and not first.is_complex()
        and (not coalescing or group not in coalescing)
        and not _is_compiling()
    )


_options_cache: dict[tuple[type, bool, Any], Any] = {}
"""(options type, async_op, `ReduceOp.RedOpType`) -> options, shared by every launch (the
process-group methods only read their options)."""


def _options(direct: _Direct, async_op: bool, reduce_op: Any) -> Any:
    """The options for a reducing launch: cached per `ReduceOp.RedOpType` (a small enum),
    built each time for a `ReduceOp` object (it may carry a scalar)."""
    if type(reduce_op) is not _RedOpType:
        return _new_options(direct.options_type, direct.has_async_op, async_op, reduce_op)
    key = (direct.options_type, async_op, reduce_op)
    options = _options_cache.get(key)
    if options is None:
        options = _new_options(direct.options_type, direct.has_async_op, async_op, reduce_op)
        _options_cache[key] = options
    return options


def _waited(work: Any) -> None:
    """A blocking call's end, as torch.distributed's function does it."""
    if work is not None:  # a backend that synchronized in C++ returns None
        work.wait()


def all_to_all_single(
    group: dist.ProcessGroup,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    async_op: bool,
) -> Any:
    if _ALL_TO_ALL is not None and _plain(group, output, input):
        work = _ALL_TO_ALL.method(
            group, output, input,
            [] if output_split_sizes is None else output_split_sizes,
            [] if input_split_sizes is None else input_split_sizes,
            _ALL_TO_ALL.plain_options[async_op],
        )
        return work if async_op else _waited(work)
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor, op: Any, async_op: bool) -> Any:
    if _ALL_REDUCE is not None and _plain(group, tensor, tensor):
        options = _options(_ALL_REDUCE, async_op, op)
        work = _ALL_REDUCE.method(group, [tensor], options)
        return work if async_op else _waited(work)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(
    group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, async_op: bool
) -> Any:
    if _ALL_GATHER is not None and _plain(group, output, input):
        work = _ALL_GATHER.method(group, output, input, _ALL_GATHER.plain_options[async_op])
        return work if async_op else _waited(work)
    # `dist.all_gather_single` is the name since torch 2.13 (the old one warns).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, op: Any, async_op: bool
) -> Any:
    if _REDUCE_SCATTER is not None and _plain(group, output, input):
        options = _options(_REDUCE_SCATTER, async_op, op)
        work = _REDUCE_SCATTER.method(group, output, input, options)
        return work if async_op else _waited(work)
    # `dist.reduce_scatter_single` is the name since torch 2.13 (the old one warns).
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
