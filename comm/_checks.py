"""Argument checks shared by the collectives and MoE dispatch/combine.

Host-side checks on metadata (shapes, dtypes, devices, split lists), run before anything
is launched; errors say what was passed and the fix.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class GroupFacts(NamedTuple):
    """What every collective asks of its process group, read once per group."""

    size: int  # group.size()
    is_nccl: bool  # group.name() is nccl (also for backend "cpu:gloo,cuda:nccl")


_known: weakref.WeakKeyDictionary[dist.ProcessGroup, GroupFacts] = weakref.WeakKeyDictionary()
"""The groups this rank is a member of, and their facts (weakly: a destroyed group goes)."""


def still_registered(group: dist.ProcessGroup) -> bool:
    """Whether `group` belongs to the current world and is not destroyed (False where
    this torch keeps its registry elsewhere: then the full checks run every time)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    registered = getattr(world, "pg_group_ranks", None)
    return registered is not None and group in registered


def resolve_group(group: Any) -> dist.ProcessGroup:
    """The process group a collective runs on: `group`, or the default group for None.
    RuntimeError when torch.distributed is not initialized, TypeError for a non-group,
    ValueError when this rank is not a member of `group`."""
    return resolve_group_and_facts(group)[0]


def resolve_group_and_facts(group: Any) -> tuple[dist.ProcessGroup, GroupFacts]:
    """`resolve_group(group)` and that group's `GroupFacts`; after a group's first call,
    one lookup (and a registry check for a group other than the default)."""
    key = dist.GroupMember.WORLD if group is None else group
    if isinstance(key, dist.ProcessGroup):
        facts = _known.get(key)
        if facts is not None and (group is None or still_registered(key)):
            return key, facts
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call comm.init_distributed() first (under "
            "torchrun, e.g. `torchrun --nproc-per-node 2 your_script.py`), or "
            "comm.init_distributed(allow_single_process=True) for a world of one process"
        )
    if group is None:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup), "an initialized world has a default group"
    elif group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not a member of the group (new_group returned "
            "GroupMember.NON_GROUP_MEMBER here); call the collective only on its members"
        )
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    elif dist.get_rank(group) < 0:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not a member of the group {group.group_name!r} "
            f"(ranks {dist.get_process_group_ranks(group)}); call the collective only on its "
            "members"
        )
    facts = GroupFacts(group.size(), backend_is_nccl(group))
    _known[group] = facts
    return group, facts


def require_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(
            f"{name_a} and {name_b} must be on the same device, got {a.device} and "
            f"{b.device}; move one with .to({str(a.device)!r})"
        )


def require_contiguous(name: str, tensor: torch.Tensor, any_memory_format: bool = False) -> None:
    """Dense and without gaps: row-major, or with `any_memory_format` (an element-wise
    collective) also channels_last (4-D, 5-D)."""
    if tensor.layout is not torch.strided:  # sparse: "contiguous" does not apply
        raise TypeError(
            f"{name} is a {tensor.layout} tensor; comm's collectives take dense (strided) "
            f"tensors: pass {name}.to_dense(), or call torch.distributed directly (gloo "
            "all-reduces sparse COO tensors)"
        )
    if tensor.is_contiguous():
        return
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(tensor.dim())
    if not (
        any_memory_format
        and channels_last is not None
        and tensor.is_contiguous(memory_format=channels_last)
    ):
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(tensor.shape)}, stride "
            f"{tensor.stride()}); pass {name}.contiguous() (for an output, copy the result "
            "into your view afterwards)"
        )


def backend_is_nccl(group: dist.ProcessGroup) -> bool:
    return group.name().lower() == "nccl"


def runs_on_nccl(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether NCCL runs `group`'s collectives on `tensor` (CUDA tensors on a group whose
    backend is nccl, also "cpu:gloo,cuda:nccl")."""
    return tensor.is_cuda and backend_is_nccl(group)


def require_backend_device(name: str, tensor: torch.Tensor, is_nccl: bool) -> None:
    """NCCL moves CUDA tensors only; say so before launching rather than inside NCCL."""
    if is_nccl and not tensor.is_cuda:
        raise ValueError(
            f"{name} is on {tensor.device} but the group's backend is nccl, which needs CUDA "
            "tensors; move it with .cuda() or use a gloo group for CPU tensors"
        )


def require_reduce_op(op: Any, dtype: torch.dtype, is_nccl: bool) -> None:
    """A ReduceOp the backend can apply to `dtype`: NCCL averages integers, gloo would
    write the sum into the tensor and then fail; bools average nowhere."""
    if not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise TypeError(f"op must be a torch.distributed.ReduceOp, got {op!r}")
    integral = not (dtype.is_floating_point or dtype.is_complex)
    if op == dist.ReduceOp.AVG and integral and (dtype == torch.bool or not is_nccl):
        backend = "any backend" if dtype == torch.bool else "this (non-NCCL) backend"
        raise TypeError(
            f"ReduceOp.AVG of a {dtype} tensor is not supported on {backend}: its "
            "average cannot be written back; reduce with SUM and divide, or use a "
            "floating-point tensor"
        )


def check_async_op(async_op: Any) -> bool:
    if async_op is False or async_op is True:
        return async_op
    raise TypeError(f"async_op must be a bool, got {async_op!r}")


def check_pair(output: Any, input: Any, is_nccl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`output` and `input` of a two-tensor collective: tensors of one dtype and device,
    dense and contiguous, on CUDA for NCCL."""
    output = require_tensor("output", output)
    input = require_tensor("input", input)
    if output.dtype != input.dtype:
        raise TypeError(
            f"output and input must have the same dtype, got {output.dtype} and "
            f"{input.dtype}; convert one with .to({output.dtype})"
        )
    require_same_device("output", output, "input", input)
    require_contiguous("output", output)
    require_contiguous("input", input)
    require_backend_device("input", input, is_nccl)
    return output, input


def check_split_sizes(
    name: str,
    split_sizes: Sequence[int] | None,
    tensor_name: str,
    tensor: torch.Tensor,
    world_size: int,
) -> list[int] | None:
    """One side's split sizes of `all_to_all_single` as a list: one int >= 0 per rank,
    summing to `tensor.shape[0]`; None (equal splits) needs dim 0 divisible by
    `world_size`."""
    dim0 = int(tensor.shape[0])
    if split_sizes is None:
        if dim0 % world_size != 0:
            raise ValueError(
                f"{name}=None splits {tensor_name} evenly over {world_size} ranks, but its "
                f"dim 0 is {dim0}, not divisible by {world_size}; pass {name} explicitly"
            )
        return None
    if isinstance(split_sizes, torch.Tensor) or not isinstance(split_sizes, Sequence):
        raise TypeError(
            f"{name} must be a list of ints (one per rank) or None, got "
            f"{type(split_sizes).__name__}; use .tolist() on a tensor of sizes"
        )
    try:
        sizes = [operator.index(size) for size in split_sizes]
    except TypeError:
        raise TypeError(f"{name} must contain ints, got {list(split_sizes)!r}") from None
    if len(sizes) != world_size:
        raise ValueError(
            f"{name} must have one entry per rank of the group ({world_size}), got "
            f"{len(sizes)}: {sizes}"
        )
    if any(size < 0 for size in sizes):
        raise ValueError(f"{name} must be >= 0, got {sizes}")
    if sum(sizes) != dim0:
        raise ValueError(
            f"{name} {sizes} sums to {sum(sizes)}, but {tensor_name} has {dim0} rows (dim 0); "
            f"the sizes must add up to {tensor_name}.shape[0]"
        )
    return sizes


def check_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    world_size: int,
) -> tuple[list[int] | None, list[int] | None]:
    """`all_to_all_single`'s tensors (checked by `check_pair`) and split sizes: no shared
    byte, rows of one shape, sizes that add up; returns the split sizes as lists."""
    check_no_shared_bytes(output, input)
    shape = output.shape
    if output.ndim == 0 or input.ndim == 0:
        raise ValueError(
            "all_to_all_single needs tensors with a dim 0 (not 0-dim), got shapes "
            f"{tuple(shape)} (output) and {tuple(input.shape)} (input)"
        )
    if shape[1:] != input.shape[1:]:
        raise ValueError(
            f"output and input must have the same row shape (all dims but 0), got "
            f"{tuple(shape)} and {tuple(input.shape)}"
        )
    if output_split_sizes is None and input_split_sizes is None and shape[0] != input.shape[0]:
        raise ValueError(
            f"without split sizes, output and input must have the same dim 0 (even parts "
            f"of it go to and come from each rank), got {shape[0]} (output) and "
            f"{input.shape[0]} (input); pass output_split_sizes and input_split_sizes"
        )
    return (
        check_split_sizes("output_split_sizes", output_split_sizes, "output", output, world_size),
        check_split_sizes("input_split_sizes", input_split_sizes, "input", input, world_size),
    )


def check_no_shared_bytes(output: torch.Tensor, input: torch.Tensor) -> None:
    """ValueError if `output` and `input` (both contiguous) share a byte: received rows
    would overwrite rows not yet sent. Tensors without storage of their own (other
    subclasses, meta: `data_ptr()` 0) and empty ones are left alone."""
    plain = (torch.Tensor, torch.nn.Parameter)  # their data_ptr() is their own storage's
    if type(output) not in plain or type(input) not in plain:
        return
    out_start, in_start = output.data_ptr(), input.data_ptr()
    out_end, in_end = out_start + output.nbytes, in_start + input.nbytes
    if (
        out_start and in_start and out_start != out_end and in_start != in_end
        and out_start < in_end and in_start < out_end
    ):
        raise ValueError(
            "all_to_all_single: output and input share memory; the rows received would "
            "overwrite rows not yet sent. Use a separate output (torch.empty_like(input))"
        )


def require_world_chunks(
    op: str,
    whole_name: str,
    whole: torch.Tensor,
    chunk_name: str,
    chunk: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
) -> None:
    """`whole` must hold one `chunk` per rank (all-gather output, reduce-scatter input).
    NCCL checks only the element counts; every other backend takes only the
    concatenation along dim 0, [world_size * chunk.shape[0], *chunk.shape[1:]] (gloo
    rejects the rest inside the launch, and crashes on a 0-dim reduce-scatter output)."""
    if whole.numel() != world_size * chunk.numel():
        raise ValueError(
            f"{whole_name} must hold world_size * {chunk_name}.numel() = {world_size} * "
            f"{chunk.numel()} = {world_size * chunk.numel()} elements, got shape "
            f"{tuple(whole.shape)} ({whole.numel()} elements)"
        )
    concatenation = (world_size * chunk.shape[0], *chunk.shape[1:]) if chunk.ndim else None
    if whole.shape == concatenation or runs_on_nccl(group, chunk):
        return
    if concatenation is not None:
        fix = f"pass {whole_name}.view({', '.join(map(str, concatenation))}) (the same memory)"
    else:
        fix = f"pass {chunk_name}.view(1) and {whole_name}.view({world_size})"
    raise ValueError(
        f"{op} on a {group.name()} group takes only {whole_name} of shape "
        f"[world_size * {chunk_name}.shape[0], *{chunk_name}.shape[1:]] (the concatenation "
        f"along dim 0; {chunk_name} needs at least one dim); got {whole_name} "
        f"{tuple(whole.shape)} for {chunk_name} {tuple(chunk.shape)} with world_size "
        f"{world_size}. Other layouts with that many elements are NCCL's only; {fix}"
    )
