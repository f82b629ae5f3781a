"""What both `comm.moe` paths share: argument checks, the counts exchange (which
carries every rank's bad-id flag), the weighted sum, and the row exchange.

Backward takes the same all-to-alls back, in one order on every rank, which autograd
does not give for graphs recorded in several threads. So each differentiable exchange
takes zero-element *order tokens* and returns one, and its backward runs before those
of the exchanges whose tokens it took: `combine` takes `dispatch`'s, and inside an
overlap each exchange takes the latest of the code whose backward runs in one thread
(`dbo.backward_state()`: its ubatch's, or the run's) and publishes its own before it
yields. Gradients are first order.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm._checks import require_same_device, require_tensor
from comm.collectives import CollectiveWork, unchecked_all_to_all_single

Splits = tuple[int, ...] | None  # rows to/from each rank; None: equal parts


def check_dispatch(
    x: Any, topk_ids: Any, num_experts: Any, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    x = require_tensor("x", x)
    topk_ids = require_tensor("topk_ids", topk_ids)
    num_experts = check_positive_int("num_experts", num_experts)
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the group size {world_size} "
            f"(experts are split evenly over the ranks); use a multiple of {world_size}"
        )
    if x.ndim != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor (torch.int64), got {topk_ids.dtype}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(
            f"topk_ids must be [num_tokens, k] with num_tokens = x.shape[0] = {x.shape[0]} "
            f"and k >= 1, got shape {tuple(topk_ids.shape)}"
        )
    require_same_device("x", x, "topk_ids", topk_ids)
    return x, topk_ids, num_experts


def sort_by_expert(
    flat_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(valid, keys, order, counts)` of the [T * K] ids: `keys` the ids with the invalid
    ones (outside [0, num_experts)) as num_experts, `order` the stable argsort of `keys`
    (pairs by expert, (token, k) order within one, invalid last), `counts` [E + 1] the
    pairs per key; scatter_add_ rather than bincount, which synchronizes on CUDA."""
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    keys = torch.where(valid, flat_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    return valid, keys, torch.argsort(keys, stable=True), counts


def exchange_counts(
    counts_table: torch.Tensor, bad_ids: torch.Tensor, group: dist.ProcessGroup,
    async_op: bool = False,
) -> tuple[torch.Tensor, CollectiveWork | None]:
    """Send row r of `counts_table` [W, E_local] to rank r, with this rank's bad-id flag
    (a bool scalar) as one more column: `(received [W, E_local + 1], work)`, row s from
    rank s, its flag last. Even splits: no host read."""
    return send_rows(counts_with_flags(counts_table, bad_ids), None, None, group, async_op)


def counts_with_flags(counts_table: torch.Tensor, bad_ids: torch.Tensor) -> torch.Tensor:
    """`counts_table` [W, E_local] with the bad-id flag (a bool scalar) as a last column."""
    return torch.cat([counts_table, bad_ids.to(torch.int64).expand(counts_table.shape[0], 1)], 1)


Counts = list[list[int]]
"""A dispatch's counts on the host, one list per source rank s: the rows received from s
per local expert, then the rows sent to s."""


def splits_of(counts: Counts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(recv_splits, send_splits)`: the rows received from and sent to each rank."""
    return tuple(sum(row[:-1]) for row in counts), tuple(row[-1] for row in counts)


def agree_on_counts(
    counts_table: torch.Tensor, bad_ids: torch.Tensor, group: dist.ProcessGroup,
    num_experts: int,
) -> tuple[torch.Tensor, Counts]:
    """Exchange the counts (`counts_table` [W, E_local]: row r the rows for rank r's
    experts) and every rank's bad-id flag; raise on every rank if any is set. Returns the
    received table [W, E_local + 1] (flags last) and the `Counts`: the one host read,
    after the exchange (which yields inside an overlap, so the other ubatch's work is
    queued before this thread waits)."""
    received, _ = exchange_counts(counts_table, bad_ids, group)
    rows = torch.cat([received, counts_table.sum(dim=1, keepdim=True)], dim=1).tolist()
    raise_if_bad_ids([row[-2] for row in rows], 0, num_experts)
    return received, [[*row[:-2], row[-1]] for row in rows]


def refuse_capture() -> None:
    """`dispatch` under `dbo.capture_graph`: RuntimeError naming the fixed-shape path."""
    if dbo.capturing():
        raise RuntimeError(
            "comm.moe.dispatch cannot be captured in a CUDA graph (dbo.capture_graph): it "
            "reads the routing counts on the host and its output shapes depend on them. Use "
            "comm.moe.dispatch_fixed / comm.moe.combine_fixed (fixed shapes, no host read)"
        )


def check_fixed_ids(received: torch.Tensor, check_ids: bool, num_experts: int) -> None:
    """`dispatch_fixed`'s id check on its received counts (every rank's flag last): one
    host read, skipped without `check_ids` and while a CUDA graph is being captured."""
    if check_ids and not (received.is_cuda and torch.cuda.is_current_stream_capturing()):
        raise_if_bad_ids(received[:, -1].tolist(), -1, num_experts)


def raise_if_bad_ids(flags: list[int], low: int, num_experts: int) -> None:
    """ValueError on every rank when any rank's flag is set: every rank read the same
    flags from the counts exchange, so none is left waiting in the next collective."""
    bad_ranks = [rank for rank, flag in enumerate(flags) if flag]
    if bad_ranks:
        raise ValueError(
            f"topk_ids must be in [{low}, num_experts) = [{low}, {num_experts}); the group's "
            f"rank(s) {bad_ranks} passed expert ids outside it"
        )


def weighted_sum(per_pair: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`y[t] = sum_k w[t, k] * per_pair[t * K + k]`: [T, H] in `per_pair`'s dtype, summed
    over k in order in the promoted dtype."""
    num_tokens, topk = topk_weights.shape
    dtype = torch.promote_types(per_pair.dtype, topk_weights.dtype)
    pairs = per_pair.view(num_tokens, topk, per_pair.shape[1]).to(dtype)
    return (pairs * topk_weights.to(dtype).unsqueeze(-1)).sum(dim=1).to(per_pair.dtype)


def check_combine(
    expert_out: Any, topk_weights: Any, handle: Any, rows: tuple[int, ...], layout: str,
    dispatched: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A combine's tensors, once `handle` has the right type: `expert_out` [*rows, H]
    (`layout` names the dims of `rows`), `topk_weights` [T, K] floating point, both on
    the device of `dispatched` (a tensor the dispatch made)."""
    expert_out = require_tensor("expert_out", expert_out)
    topk_weights = require_tensor("topk_weights", topk_weights)
    if expert_out.ndim != len(rows) + 1 or tuple(expert_out.shape[:-1]) != rows:
        raise ValueError(
            f"expert_out must be [{layout}, hidden] = [{', '.join(map(str, rows))}, hidden] "
            f"(recv_x's layout), got shape {tuple(expert_out.shape)}"
        )
    if topk_weights.shape != (handle.num_tokens, handle.topk):
        raise ValueError(
            f"topk_weights must be [num_tokens, k] = [{handle.num_tokens}, {handle.topk}] (the "
            f"shape of the dispatch's topk_ids), got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    require_same_device("expert_out", expert_out, "topk_weights", topk_weights)
    require_same_device("expert_out", expert_out, "the dispatch's x", dispatched)
    return expert_out, topk_weights


_ORDER_TOKEN_KEY = "comm.moe.order_token"  # `dbo.backward_state()` key: the latest token


def run_has_order_token() -> bool:
    state = dbo.backward_state()
    return state is not None and state.get(_ORDER_TOKEN_KEY) is not None


def exchange_rows(
    rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
    group: dist.ProcessGroup, anchor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exchange `rows` (`dispatch` and `combine`): `(received, order_token)`. Through
    `_ExchangeRows` when grad mode is on and `rows`, `anchor` or the run's latest token
    requires grad (inside an overlap its token becomes the latest before its wait
    yields); else a plain all-to-all and no token."""
    if not torch.is_grad_enabled():
        return send_rows(rows, output_splits, input_splits, group)[0], None
    state = dbo.backward_state()
    latest = None if state is None else state.get(_ORDER_TOKEN_KEY)
    tokens: tuple[torch.Tensor, ...] = () if latest is None else (latest,)
    if anchor is not None and anchor.requires_grad and not any(t is anchor for t in tokens):
        tokens = (*tokens, anchor)
    if not (rows.requires_grad or tokens):
        return send_rows(rows, output_splits, input_splits, group)[0], None
    # Launch, publish the token, then yield and wait: the chain follows the launch order.
    pending: list[CollectiveWork] = []
    received, token = _ExchangeRows.apply(
        rows, output_splits, input_splits, group, pending, *tokens
    )
    if state is not None:
        state[_ORDER_TOKEN_KEY] = token
    pending[0].wait()
    return received, token


def send_rows(
    rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
    group: dist.ProcessGroup, async_op: bool = False,
) -> tuple[torch.Tensor, CollectiveWork | None]:
    """The row all-to-all: `rows` out by `input_splits`, `(received, handle)` in by
    `output_splits` (None: equal parts, as many rows in as out); the handle is None
    unless `async_op`."""
    num_rows = rows.shape[0] if output_splits is None else sum(output_splits)
    received = rows.new_empty((num_rows, *rows.shape[1:]))
    work = unchecked_all_to_all_single(
        received, rows.contiguous(), output_splits, input_splits, group, async_op
    )
    return received, work


class _ExchangeRows(torch.autograd.Function):
    """`all_to_all_single` of rows that autograd differentiates: the gradient takes the
    same exchange back, splits swapped, where autograd runs it (blocking, usually).

    Inputs: `rows`, the splits, the group, `pending` (a list: the forward only launches
    and appends the `CollectiveWork`), then any order tokens. Outputs: the received rows
    and a new zero-element float32 token. A backward with `create_graph=True` raises on
    every rank before its exchange: a second order would lack the exchange's part.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
        group: dist.ProcessGroup,
        pending: list[CollectiveWork], *tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        ctx.token_devices = tuple(token.device for token in tokens)
        received, work = send_rows(rows, output_splits, input_splits, group, async_op=True)
        assert work is not None, "an async launch returns its handle"
        pending.append(work)
        return received, torch.empty(0, dtype=torch.float32, device=rows.device)

    @staticmethod
    def backward(ctx: Any, grad_received: torch.Tensor, grad_token: Any) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            # The exchange below records no graph. Every rank runs the same backward, so
            # every rank raises here, before the collective: none is left waiting.
            raise RuntimeError(
                "comm.moe.dispatch/combine support first-order gradients only: a backward "
                "with create_graph=True (a gradient penalty, double backward) through "
                "them is not supported"
            )
        output_splits, input_splits = ctx.splits
        # A missing gradient arrives as zeros: a rank whose rows were unused still sends.
        grad_rows, _ = send_rows(grad_received, input_splits, output_splits, ctx.group)
        token_grads = tuple(
            torch.zeros(0, dtype=torch.float32, device=device) if needed else None
            for device, needed in zip(ctx.token_devices, ctx.needs_input_grad[5:])
        )
        return (grad_rows if ctx.needs_input_grad[0] else None, None, None, None, None,
                *token_grads)


def check_positive_int(name: str, value: Any, meaning: str = "") -> int:
    """`value` as an int >= 1: TypeError for a non-integer, ValueError for a bool or < 1."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{name} must be an int >= 1{meaning}, got {value!r}")
    return number
