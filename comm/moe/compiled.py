"""The fixed path's exchanges as torch.library ops, so that `torch.compile` traces
`dispatch_fixed` and `combine_fixed` whole (`fullgraph=True`): the sorting and gathering
around them is ordinary traced tensor code, and each exchange is one node.

- `dbo_comm::moe_dispatch_exchange`: the dispatch's two all-to-alls (the counts with the
  bad-id flags, and the rows), launched together as in eager (one yield inside an
  overlap), then the bad-id check: a host read when the node runs, unless `check_ids`
  is off or a CUDA graph is being captured.
- `dbo_comm::moe_exchange_rows`: one all-to-all of equal parts (the combine's).

Both are differentiable: the gradient of an exchange of equal parts is the same exchange
of the gradient, so the backward is a `moe_exchange_rows` node of the compiled backward.
It yields inside the ubatch's backward as in eager, and, being the same op, has a
gradient itself.

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
from comm.moe._exchange import raise_if_bad_ids, send_rows


def _refuse_shared_backward(differentiable: bool) -> None:
    if differentiable and dbo.num_ubatches() > 1 and dbo.backward_state() is dbo.run_state():
        raise RuntimeError(
            "comm.moe.dispatch_fixed/combine_fixed compiled by torch.compile, in grad mode, "
            "need each ubatch's backward to run as its own sequence: call dbo.overlap with "
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
    if check_ids and not (rows.is_cuda and torch.cuda.is_current_stream_capturing()):
        raise_if_bad_ids(received_counts[:, -1].tolist(), -1, num_experts)
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
