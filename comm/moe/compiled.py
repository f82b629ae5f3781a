"""`comm.moe`'s exchanges as torch.library ops, so that `torch.compile` traces `dispatch`,
`combine`, `dispatch_fixed` and `combine_fixed` whole (`fullgraph=True`): the sorting and
gathering around them is ordinary traced tensor code, and each exchange is one node.

- `dbo_comm::moe_dispatch_exchange`: `dispatch_fixed`'s two all-to-alls (the counts with
  the bad-id flags, and the rows), launched together as in eager (one yield inside an
  overlap), then the bad-id check: a host read when the node runs, unless `check_ids`
  is off or a CUDA graph is being captured.
- `dbo_comm::moe_exchange_rows`: an all-to-all of equal parts (`combine_fixed`'s).
- `dbo_comm::moe_dispatch_rows`: `dispatch`'s counts exchange, its host read of the
  splits and its rows exchange (two yields). The rows received are a size dynamo knows
  only when the node runs (an unbacked size: `capture_dynamic_output_shape_ops=True`,
  else dynamo breaks the graph there); the splits come out as a host tensor.
- `dbo_comm::moe_split_rows`: rows out by those splits, or back (`combine`'s).

Each is differentiable: the gradient of an exchange is the same exchange the other way
round, so the backward is `moe_exchange_rows` or `moe_split_rows` again, a node of the
compiled backward. It yields inside the ubatch's backward as in eager, and, being the
same op, has a gradient itself. The eager paths' agreement on whether `combine` needs a
gradient (one small all-reduce) is not made: every rank's `combine` input must require
grad alike, as the same compiled code gives.

Order: a compiled region's backward is one autograd node, which runs its exchanges in
the graph's order, the same on every rank. When each ubatch's backward runs as its own
sequence (`dbo.overlap`'s default, and its in-turn backward under FSDP2), that order is
the whole order, so these nodes take no order tokens. Where one autograd backward walks
every ubatch's graph (`overlap_backward=False`, a `UBatchRunner`), autograd may
interleave the ubatches differently on different ranks: a node recorded in grad mode
refuses to run there, on every rank alike, before its exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm.compiled import group_name, group_named
from comm.moe._exchange import (
    agree_on_counts,
    check_fixed_ids,
    refuse_capture,
    send_rows,
    splits_of,
)


def _refuse_shared_backward(differentiable: bool) -> None:
    if differentiable and dbo.num_ubatches() > 1 and dbo.backward_state() is dbo.run_state():
        raise RuntimeError(
            "comm.moe's exchanges compiled by torch.compile, in grad mode, need each "
            "ubatch's backward to run as its own sequence: call dbo.overlap with "
            "overlap_backward=True (the default), or run them eagerly (outside "
            "torch.compile), whose order tokens keep every rank's backward in one order"
        )


@torch.library.custom_op("dbo_comm::moe_dispatch_exchange", mutates_args=())
def _dispatch_exchange(
    counts: torch.Tensor, rows: torch.Tensor, group: str, check_ids: bool, num_experts: int,
    differentiable: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_shared_backward(differentiable)
    base = group_named(group)
    received_counts, counts_work = send_rows(counts, None, None, base, async_op=True)
    received, rows_work = send_rows(rows, None, None, base, async_op=True)
    assert counts_work is not None and rows_work is not None
    rows_work.wait()
    counts_work.wait(yield_first=False)
    check_fixed_ids(received_counts, check_ids, num_experts)
    return received_counts, received


@_dispatch_exchange.register_fake
def _(counts: torch.Tensor, rows: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(counts), torch.empty_like(rows)


@torch.library.custom_op("dbo_comm::moe_exchange_rows", mutates_args=())
def _exchange_rows(rows: torch.Tensor, group: str, differentiable: bool) -> torch.Tensor:
    _refuse_shared_backward(differentiable)
    return send_rows(rows, None, None, group_named(group))[0]


@_exchange_rows.register_fake
def _(rows: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(rows)


def _keep_dispatch_group(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group = inputs[2]
    ctx.mark_non_differentiable(output[0])  # the counts


def _keep_rows_group(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group = inputs[1]


def _dispatch_backward(ctx: Any, grad_counts: Any, grad_rows: torch.Tensor) -> tuple[Any, ...]:
    return None, torch.ops.dbo_comm.moe_exchange_rows(grad_rows, ctx.group, False), *[None] * 4


def _rows_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return torch.ops.dbo_comm.moe_exchange_rows(grad, ctx.group, False), None, None


_dispatch_exchange.register_autograd(_dispatch_backward, setup_context=_keep_dispatch_group)
_exchange_rows.register_autograd(_rows_backward, setup_context=_keep_rows_group)


@torch.library.custom_op("dbo_comm::moe_dispatch_rows", mutates_args=())
def _dispatch_rows(
    counts_table: torch.Tensor, bad_ids: torch.Tensor, rows: torch.Tensor, group: str,
    num_experts: int, differentiable: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_shared_backward(differentiable)
    refuse_capture()
    base = group_named(group)
    received, counts = agree_on_counts(counts_table, bad_ids, base, num_experts)
    recv_splits, send_splits = splits_of(counts)
    recv_x = send_rows(rows, recv_splits, send_splits, base)[0]
    return recv_x, received, torch.tensor(counts, dtype=torch.int64)


@_dispatch_rows.register_fake
def _(counts_table: torch.Tensor, bad_ids: torch.Tensor, rows: torch.Tensor,
      *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_received = torch.library.get_ctx().new_dynamic_size()
    table = counts_table.new_empty(counts_table.shape[0], counts_table.shape[1] + 1)
    host = torch.empty(table.shape, dtype=torch.int64, device="cpu")
    return rows.new_empty(num_received, rows.shape[1]), table, host


@torch.library.custom_op("dbo_comm::moe_split_rows", mutates_args=())
def _split_rows(
    rows: torch.Tensor, counts: torch.Tensor, back: bool, num_rows: int, group: str,
    differentiable: bool,
) -> torch.Tensor:
    """Rows out by a dispatch's splits (`counts`: its handle's), or `back` the other way."""
    _refuse_shared_backward(differentiable)
    recv_splits, send_splits = splits_of(counts.tolist())  # a host tensor: no device sync
    if back:
        recv_splits, send_splits = send_splits, recv_splits
    return send_rows(rows, recv_splits, send_splits, group_named(group))[0]


@_split_rows.register_fake
def _(rows: torch.Tensor, counts: torch.Tensor, back: bool, num_rows: int,
      *args: Any) -> torch.Tensor:
    return rows.new_empty(num_rows, rows.shape[1])


def _keep_dispatch_rows(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.counts, ctx.num_rows, ctx.group = output[2], inputs[2].shape[0], inputs[3]
    ctx.mark_non_differentiable(output[1], output[2])


def _keep_split_rows(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.counts, ctx.back, ctx.num_rows, ctx.group = (
        inputs[1], inputs[2], inputs[0].shape[0], inputs[4])


def _dispatch_rows_backward(ctx: Any, grad_rows: torch.Tensor, *_: Any) -> tuple[Any, ...]:
    grad = torch.ops.dbo_comm.moe_split_rows(grad_rows, ctx.counts, True, ctx.num_rows,
                                             ctx.group, False)
    return None, None, grad, None, None, None


def _split_rows_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    back = torch.ops.dbo_comm.moe_split_rows(grad, ctx.counts, not ctx.back, ctx.num_rows,
                                             ctx.group, False)
    return back, None, None, None, None, None


_dispatch_rows.register_autograd(_dispatch_rows_backward, setup_context=_keep_dispatch_rows)
_split_rows.register_autograd(_split_rows_backward, setup_context=_keep_split_rows)


def _differentiable(rows: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and rows.requires_grad


def dispatch_exchange(
    counts: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup, check_ids: bool,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(received counts [W, E_local + 1], received rows)`: `counts` [W, E_local + 1]
    with each rank's bad-id flag last, `rows` in equal parts (the send buffer)."""
    return torch.ops.dbo_comm.moe_dispatch_exchange(
        counts, rows.contiguous(), group_name(group), check_ids, num_experts,
        _differentiable(rows))


def exchange_rows(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`rows` exchanged in equal parts."""
    return torch.ops.dbo_comm.moe_exchange_rows(
        rows.contiguous(), group_name(group), _differentiable(rows))


def dispatch_rows(
    counts_table: torch.Tensor, bad_ids: torch.Tensor, rows: torch.Tensor,
    group: dist.ProcessGroup, num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dispatch`'s exchanges: `(recv_x [R, H], received [W, E_local + 1], the handle's
    host counts)`, R known when the node runs (`agree_on_counts`, then the rows)."""
    return torch.ops.dbo_comm.moe_dispatch_rows(
        counts_table, bad_ids, rows.contiguous(), group_name(group), num_experts,
        _differentiable(rows))


def return_rows(
    rows: torch.Tensor, counts: torch.Tensor, num_rows: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """`combine`'s exchange: the `rows` a dispatch brought, back to their `num_rows` pairs."""
    return torch.ops.dbo_comm.moe_split_rows(
        rows.contiguous(), counts, True, num_rows, group_name(group), _differentiable(rows))
