"""Expert-parallel token routing: `dispatch` tokens to the ranks that own their experts,
`combine` the expert outputs back, weighted, in the original token order.

    recv_x, recv_local_expert_ids, handle = comm.moe.dispatch(x, topk_ids, num_experts)
    expert_out = run_local_experts(recv_x, recv_local_expert_ids)   # row for row
    y = comm.moe.combine(expert_out, handle, topk_weights)

Rank r owns experts `[r * E_local, (r + 1) * E_local)`; each (token, k) pair is one row
on the wire; counts go first, so uneven loads and empty ranks work. Inside an overlap
the all-to-alls yield while in flight (`dispatch` twice, `combine` once); outside they
block. Results are bitwise those of the same calls made serially. `dispatch` reads the
split sizes on the host once; `dispatch_fixed`/`combine_fixed` (comm/_moe_fixed.py) route
into fixed-size blocks per expert with no host read, for decode and CUDA graphs.
`shard_experts(model)` does all this for a Hugging Face MoE model.

Backward takes the same all-to-alls back, in one order on every rank, which autograd
does not give for graphs recorded in several threads. So each differentiable exchange
takes zero-element *order tokens* and returns one, and its backward runs before those
of the exchanges whose tokens it took: `combine` takes `dispatch`'s, and inside an
overlap each exchange takes the run's latest (`dbo.run_state()`) and publishes its own
before it yields. When only the experts train, `combine` in grad mode first all-reduces
whether any rank's `expert_out` requires grad. Gradients are first order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm._checks import require_same_device, require_tensor, resolve_group
from comm.collectives import CollectiveWork, all_reduce, all_to_all_single
from dbo.graphs import refuse_under_capture

__all__ = [
    "DispatchHandle", "FixedDispatchHandle", "combine", "combine_fixed", "dispatch",
    "dispatch_fixed", "shard_experts",
]


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs to route the outputs back: valid for one `combine` on the
    same ranks (the same ubatch, inside an overlap)."""

    group: dist.ProcessGroup  # the base group the tokens were dispatched over
    num_tokens: int  # T: rows of dispatch's `x`
    topk: int  # K: experts per token
    num_local_experts: int  # E_local: experts per rank
    sort_order: torch.Tensor
    """[T * K] int64: sent row j is the (token, k) pair `sort_order[j]` = `token * K + k`."""
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank
    num_recv_tokens_per_expert: torch.Tensor
    """[world_size, E_local] int64 on the host: the rows received per source and expert."""
    order_token: torch.Tensor | None = None  # dispatch's (module docstring); None: no graph
    rows_per_local_expert: tuple[int, ...] = ()
    """Rows of `recv_x` per local expert, over all sources (host ints: grouping the rows
    by expert needs no host read)."""

    @property
    def num_recv_tokens(self) -> int:
        """Rows of `recv_x`, and of the `expert_out` that `combine` expects."""
        return sum(self.recv_splits)


def dispatch(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks that own its top-k experts.

    Args:
        x: [T, H] tokens (any dtype the backend moves; T may be 0).
        topk_ids: [T, K] integer global expert ids in `[0, num_experts)`, same device as x.
        num_experts: total experts over the group, divisible by its size.
        group: the expert-parallel group; None: the default group.

    Returns `(recv_x, recv_local_expert_ids, handle)`: `recv_x` [R, H] (x's dtype and
    device), the rows this rank's experts process, grouped by source rank, then local
    expert, then the source's (token, k) order; `recv_local_expert_ids` [R] int64 in
    `[0, E_local)`; `handle` for `combine`.

    Inside an overlap the all-to-alls run on the ubatch's comm stream; the results are
    ready on its compute stream on return. The split sizes are read on the host once,
    after the counts exchange (one synchronization on CUDA). TypeError / ValueError
    before any communication for a bad shape, dtype, device or `num_experts`; an
    expert id outside `[0, num_experts)` on any rank raises ValueError on every rank
    after the counts exchange. Under CUDA-graph capture use `dispatch_fixed`.
    """
    refuse_under_capture("comm.moe.dispatch")
    base = resolve_group(group)
    world_size = base.size()
    x, topk_ids, num_experts = check_dispatch(x, topk_ids, num_experts, world_size)
    num_tokens, topk = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    num_local_experts = num_experts // world_size
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    bad_ids = ((flat_ids < 0) | (flat_ids >= num_experts)).any()
    # Clamped only so that the count runs (bad ids raise below, on every rank);
    # scatter_add_ rather than bincount, which synchronizes on CUDA.
    clamped_ids = flat_ids.clamp(0, num_experts - 1)
    counts_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts_per_expert.scatter_add_(0, clamped_ids, torch.ones_like(clamped_ids))  # [E]
    sort_order = torch.argsort(flat_ids, stable=True)
    send_rows = x.index_select(0, torch.div(sort_order, topk, rounding_mode="floor"))

    # Rank r gets counts_per_expert[r * E_local:(r + 1) * E_local] and every rank's flag.
    counts_table = counts_per_expert.view(world_size, num_local_experts)
    received, _ = exchange_counts(counts_table, bad_ids, base)
    # The one host read, after the counts exchange (which yields inside an overlap, so
    # the other ubatch's work is queued before this thread waits): splits both ways.
    # Row s: the rows rank s sends to each local expert, its flag, the rows for rank s.
    rows = torch.cat([received, counts_table.sum(dim=1, keepdim=True)], dim=1).tolist()
    raise_if_bad_ids([row[-2] for row in rows], 0, num_experts)
    send_splits = [row[-1] for row in rows]
    recv_counts = [row[:-2] for row in rows]
    recv_splits = [sum(counts) for counts in recv_counts]

    recv_x, order_token = exchange_rows(send_rows, tuple(recv_splits), tuple(send_splits), base)
    recv_local_expert_ids = torch.repeat_interleave(
        torch.arange(num_local_experts, device=x.device).repeat(world_size),
        received[:, :-1].reshape(-1), output_size=recv_x.shape[0],
    )
    handle = DispatchHandle(
        base, num_tokens, topk, num_local_experts, sort_order, tuple(send_splits),
        tuple(recv_splits), torch.tensor(recv_counts, dtype=torch.int64), order_token,
        tuple(map(sum, zip(*recv_counts))) if recv_counts else (0,) * num_local_experts,
    )
    return recv_x, recv_local_expert_ids, handle


def check_dispatch(
    x: Any, topk_ids: Any, num_experts: Any, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    x = require_tensor("x", x)
    topk_ids = require_tensor("topk_ids", topk_ids)
    num_experts = _check_num_experts(num_experts, world_size)
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


def exchange_counts(
    counts_table: torch.Tensor, bad_ids: torch.Tensor, group: dist.ProcessGroup,
    async_op: bool = False,
) -> tuple[torch.Tensor, CollectiveWork | None]:
    """Send row r of `counts_table` [W, E_local] to rank r, with this rank's bad-id flag
    (a bool scalar) as one more column: `(received [W, E_local + 1], work)`, row s from
    rank s, its flag last. Even splits: no host read."""
    flags = bad_ids.to(torch.int64).expand(counts_table.shape[0], 1)
    sent = torch.cat([counts_table, flags], dim=1)
    received = torch.empty_like(sent)
    return received, all_to_all_single(received, sent, group=group, async_op=async_op)


def raise_if_bad_ids(flags: list[int], low: int, num_experts: int) -> None:
    """ValueError on every rank when any rank's flag is set: every rank read the same
    flags from the counts exchange, so none is left waiting in the next collective."""
    bad_ranks = [rank for rank, flag in enumerate(flags) if flag]
    if bad_ranks:
        raise ValueError(
            f"topk_ids must be in [{low}, num_experts) = [{low}, {num_experts}); the group's "
            f"rank(s) {bad_ranks} passed expert ids outside it"
        )


def combine(
    expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Send expert outputs back and sum them per token: `y[t] = sum_k w[t, k] * out(t, k)`.

    `expert_out` [R, H_out]: row i the expert output for `recv_x[i]` of the `dispatch`
    that returned `handle`. `topk_weights` [T, K] floating, same device. Returns `y`
    [T, H_out] in token order and `expert_out`'s dtype (summed over k in order in the
    promoted dtype). One all-to-all, one yield inside an overlap (and one small
    all-reduce when only the experts train); TypeError / ValueError before any
    communication for bad shapes or dtypes.
    """
    expert_out, topk_weights = _check_combine(expert_out, handle, topk_weights)
    anchor = handle.order_token
    if anchor is None and torch.is_grad_enabled() and not run_has_order_token():
        anchor = _agree_on_grad(expert_out, handle.group)
    returned, _ = exchange_rows(
        expert_out, handle.send_splits, handle.recv_splits, handle.group, anchor
    )
    # Row j came back for the pair sort_order[j]: put the pairs back in (token, k) order.
    per_pair = torch.empty_like(returned).index_copy_(0, handle.sort_order, returned)
    return weighted_sum(per_pair, topk_weights)


def weighted_sum(per_pair: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`y[t] = sum_k w[t, k] * per_pair[t * K + k]`: [T, H] in `per_pair`'s dtype, summed
    over k in order in the promoted dtype."""
    num_tokens, topk = topk_weights.shape
    dtype = torch.promote_types(per_pair.dtype, topk_weights.dtype)
    pairs = per_pair.view(num_tokens, topk, per_pair.shape[1]).to(dtype)
    return (pairs * topk_weights.to(dtype).unsqueeze(-1)).sum(dim=1).to(per_pair.dtype)


def _check_combine(
    expert_out: Any, handle: Any, topk_weights: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}"
        )
    expert_out = require_tensor("expert_out", expert_out)
    topk_weights = require_tensor("topk_weights", topk_weights)
    if expert_out.ndim != 2 or expert_out.shape[0] != handle.num_recv_tokens:
        raise ValueError(
            f"expert_out must be [num_recv_tokens = {handle.num_recv_tokens} (the rows "
            f"dispatch returned), hidden], got shape {tuple(expert_out.shape)}"
        )
    check_weights(topk_weights, expert_out, handle.num_tokens, handle.topk)
    if handle.sort_order.device != expert_out.device:
        raise ValueError(
            f"expert_out is on {expert_out.device} but dispatch ran on "
            f"{handle.sort_order.device}; keep the expert outputs on the tokens' device"
        )
    return expert_out, topk_weights


Splits = tuple[int, ...] | None  # rows to/from each rank; None: equal parts
def check_weights(
    topk_weights: torch.Tensor, expert_out: torch.Tensor, num_tokens: int, topk: int
) -> None:
    """`topk_weights` is [T, K] floating point, on `expert_out`'s device."""
    if topk_weights.shape != (num_tokens, topk):
        raise ValueError(
            f"topk_weights must be [num_tokens, k] = [{num_tokens}, {topk}] (the shape of "
            f"the dispatch's topk_ids), got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    require_same_device("expert_out", expert_out, "topk_weights", topk_weights)


_ORDER_TOKEN_KEY = "comm.moe.order_token"  # `dbo.run_state()` key: the run's latest token


def run_has_order_token() -> bool:
    state = dbo.run_state()
    return state is not None and state.get(_ORDER_TOKEN_KEY) is not None


def _agree_on_grad(expert_out: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """For a `combine` in grad mode with no order token to take: all-reduce (MAX) whether
    any rank's `expert_out` requires grad. Returns an anchor that makes this rank's
    exchange differentiable when its own `expert_out` would not, else None."""
    needs_grad = expert_out.requires_grad
    # torch.full: a copy from host memory would be one more host sync.
    flag = torch.full((1,), int(needs_grad), dtype=torch.int32, device=expert_out.device)
    all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if needs_grad or not bool(flag.item()):
        return None
    return torch.zeros(0, dtype=torch.float32, device=expert_out.device, requires_grad=True)


def exchange_rows(
    rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
    group: dist.ProcessGroup, anchor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exchange `rows` (`dispatch` and `combine`): `(received, order_token)`. Through
    `_ExchangeRows` when grad mode is on and `rows`, `anchor` or the run's latest token
    requires grad (inside an overlap its token becomes the run's latest before it
    yields); else a plain all-to-all and no token."""
    if not torch.is_grad_enabled():
        return _send_rows(rows, output_splits, input_splits, group)[0], None
    state = dbo.run_state()
    latest = None if state is None else state.get(_ORDER_TOKEN_KEY)
    tokens: tuple[torch.Tensor, ...] = () if latest is None else (latest,)
    if anchor is not None and anchor.requires_grad and not any(t is anchor for t in tokens):
        tokens = (*tokens, anchor)
    if not (rows.requires_grad or tokens):
        return _send_rows(rows, output_splits, input_splits, group)[0], None
    if state is None:
        return _ExchangeRows.apply(rows, output_splits, input_splits, group, None, *tokens)
    # Launch, publish the token, then yield and wait: the chain follows the launch order.
    pending: list[CollectiveWork] = []
    received, token = _ExchangeRows.apply(
        rows, output_splits, input_splits, group, pending, *tokens
    )
    state[_ORDER_TOKEN_KEY] = token
    pending[0].wait()
    return received, token


def _send_rows(
    rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
    group: dist.ProcessGroup, async_op: bool = False,
) -> tuple[torch.Tensor, CollectiveWork | None]:
    """The row all-to-all: `rows` out by `input_splits`, `(received, handle)` in by
    `output_splits` (None: equal parts, as many rows in as out); the handle is None
    unless `async_op`."""
    num_rows = rows.shape[0] if output_splits is None else sum(output_splits)
    received = rows.new_empty((num_rows, *rows.shape[1:]))
    work = all_to_all_single(
        received, rows.contiguous(), output_splits, input_splits, group=group,
        async_op=async_op,
    )
    return received, work


class _ExchangeRows(torch.autograd.Function):
    """`all_to_all_single` of rows that autograd differentiates: the gradient takes the
    same exchange back, splits swapped, where autograd runs it (blocking, usually).

    Inputs: `rows`, the splits, the group, `pending` (None: blocking; a list: launch only
    and append the `CollectiveWork`), then any order tokens. Outputs: the received rows
    and a new zero-element float32 token. A backward with `create_graph=True` raises on
    every rank before its exchange: a second order would lack the exchange's part.
    """

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_splits: Splits, input_splits: Splits,
        group: dist.ProcessGroup,
        pending: list[CollectiveWork] | None, *tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        ctx.token_devices = tuple(token.device for token in tokens)
        received, work = _send_rows(
            rows, output_splits, input_splits, group, async_op=pending is not None
        )
        if pending is not None:
            assert work is not None
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
        grad_rows, _ = _send_rows(grad_received, input_splits, output_splits, ctx.group)
        token_grads = tuple(
            torch.zeros(0, dtype=torch.float32, device=device) if needed else None
            for device, needed in zip(ctx.token_devices, ctx.needs_input_grad[5:])
        )
        return (grad_rows if ctx.needs_input_grad[0] else None, None, None, None, None,
                *token_grads)


def _check_num_experts(num_experts: Any, world_size: int) -> int:
    try:
        value = operator.index(num_experts)
    except TypeError:
        raise TypeError(f"num_experts must be an int, got {num_experts!r}") from None
    if isinstance(num_experts, bool) or value < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if value % world_size != 0:
        raise ValueError(
            f"num_experts={value} must be divisible by the group size {world_size} (experts "
            f"are split evenly over the ranks); use a multiple of {world_size}"
        )
    return value


# Last: both build on the names above.
from comm._hf import shard_experts  # noqa: E402
from comm._moe_fixed import FixedDispatchHandle, combine_fixed, dispatch_fixed  # noqa: E402
