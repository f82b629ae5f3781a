"""comm's blocking collectives as torch.library ops, so that `torch.compile` traces each
as one node of its graph (`fullgraph=True` holds a block with its exchanges).

Under `torch.compiler.is_compiling()` a blocking `comm` collective records its op instead
of running: a node that writes its output tensors in place (its fake kernel writes
nothing). When the compiled code runs, the node's kernel is the eager collective, which
checks its arguments and, inside an overlap, yields while in flight, exactly as in eager.

A node holds no ProcessGroup: the group goes by name, resolved when the node runs among
the default group and those `comm.ubatch_groups` has duplicated (the groups an overlap
uses); any other raises, naming the fix. `async_op=True` is not traced (its handle is
Python state: a graph break), nor is a `ReduceOp` built with an argument. Like the eager
collectives, the ops have no autograd formula: wrap them in an `autograd.Function`.
They are registered when `comm` is imported (a few ms): dynamo finds them while it traces.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from comm.groups import group_registry

_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
"""The reduce ops a node can name."""


def traced(async_op: bool) -> bool:
    """Whether a collective called now records its op (`torch.compile` tracing it)."""
    return not async_op and torch.compiler.is_compiling()


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a node holds for `group` (None: the default group)."""
    group = group if group is not None else dist.group.WORLD
    assert group is not None, "comm.init_distributed() makes the default group"
    return group.group_name


def _op_name(op: object) -> str:
    for name in _OPS:
        if op is getattr(dist.ReduceOp, name):  # torch 2.11's dynamo cannot compare them
            return name
    raise ValueError(f"comm under torch.compile takes a plain ReduceOp ({', '.join(_OPS)}), "
                     f"got {op!r}")


def group_named(name: str) -> dist.ProcessGroup:
    """The group a node names, when it runs: the default group, or one that
    `comm.ubatch_groups` has duplicated (ValueError naming the fix otherwise)."""
    world = dist.group.WORLD
    if world is not None and world.group_name == name:
        return world
    found = group_registry().base_named(name)
    if found is None:
        raise ValueError(
            f"a comm collective compiled by torch.compile names group {name!r}, which is "
            "neither the default group nor one comm.ubatch_groups(group) has duplicated: "
            "call comm.ubatch_groups(group) on every rank before the compiled code runs"
        )
    return found


@torch.library.custom_op("dbo_comm::all_reduce", mutates_args=("tensor",))
def _all_reduce(tensor: torch.Tensor, op: str, group: str) -> None:
    from comm import collectives  # which imports this module

    collectives.all_reduce(tensor, getattr(dist.ReduceOp, op), group_named(group))


@torch.library.custom_op("dbo_comm::all_gather_into_tensor", mutates_args=("output",))
def _all_gather(output: torch.Tensor, input: torch.Tensor, group: str) -> None:
    from comm import collectives

    collectives.all_gather_into_tensor(output, input, group_named(group))


@torch.library.custom_op("dbo_comm::reduce_scatter_tensor", mutates_args=("output",))
def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group: str) -> None:
    from comm import collectives

    collectives.reduce_scatter_tensor(output, input, getattr(dist.ReduceOp, op), group_named(group))


@torch.library.custom_op("dbo_comm::all_to_all_single", mutates_args=("output",))
def _all_to_all(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None, group: str,
) -> None:
    from comm import collectives

    collectives.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group_named(group))


for _op in (_all_reduce, _all_gather, _reduce_scatter, _all_to_all):
    _op.register_fake(lambda *args: None)  # each writes only tensors it was given


def all_reduce(tensor: torch.Tensor, op: object, group: dist.ProcessGroup | None) -> Any:
    return torch.ops.dbo_comm.all_reduce(tensor, _op_name(op), group_name(group))


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None
) -> Any:
    return torch.ops.dbo_comm.all_gather_into_tensor(output, input, group_name(group))


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: object, group: dist.ProcessGroup | None
) -> Any:
    return torch.ops.dbo_comm.reduce_scatter_tensor(output, input, _op_name(op), group_name(group))


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None, group: dist.ProcessGroup | None,
) -> Any:
    """The op's node (it returns None), as the other three."""
    return torch.ops.dbo_comm.all_to_all_single(
        output, input, None if output_split_sizes is None else list(output_split_sizes),
        None if input_split_sizes is None else list(input_split_sizes), group_name(group))
