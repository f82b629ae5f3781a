"""The dynamic path: `dispatch` sends each (token, k) pair as one row, counts first (so
uneven loads and empty ranks work; the split sizes are read on the host once), and
`combine` brings the rows back. Inside an overlap `dispatch` yields twice, `combine` once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm._checks import resolve_group
from comm.collectives import unchecked_all_reduce
from comm.moe import compiled
from comm.moe._exchange import (
    agree_on_counts,
    check_combine,
    check_dispatch,
    exchange_rows,
    refuse_capture,
    run_has_order_token,
    sort_by_expert,
    splits_of,
    weighted_sum,
)


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
    counts: torch.Tensor
    """[world_size, E_local + 1] int64 on the host: row s the rows received from rank s
    per local expert, then the rows sent to rank s."""
    num_recv_tokens: int
    """Rows of `recv_x`, and of the `expert_out` that `combine` expects (under
    torch.compile a size known when the code runs)."""
    order_token: torch.Tensor | None = None  # dispatch's (module docstring); None: no graph
    send_splits: tuple[int, ...] = ()
    """Rows sent to each rank (host ints; under torch.compile empty: see `counts`)."""
    recv_splits: tuple[int, ...] = ()
    """Rows received from each rank (as `send_splits`)."""
    rows_per_local_expert: tuple[int, ...] = ()
    """Rows of `recv_x` per local expert, over all sources (as `send_splits`: grouping the
    rows by expert needs no host read)."""

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """[world_size, E_local] int64 on the host: the rows received per source and expert."""
        return self.counts[:, :-1]


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
    after the counts exchange. Under CUDA-graph capture use `dispatch_fixed`. Under
    `torch.compile` the exchanges are one node (`comm.moe.compiled`), R a size known when
    it runs, and the handle's split tuples empty (its `counts` hold them).
    """
    if not torch.compiler.is_compiling():  # else its node refuses, when it runs
        refuse_capture()
    base = resolve_group(group)
    world_size = base.size()
    x, topk_ids, num_experts = check_dispatch(x, topk_ids, num_experts, world_size)
    num_tokens, topk = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    num_local_experts = num_experts // world_size
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    # Bad ids are left out of the counts, and raise below, on every rank.
    valid, _, sort_order, counts = sort_by_expert(flat_ids, num_experts)
    send_rows = x.index_select(0, torch.div(sort_order, topk, rounding_mode="floor"))

    # Rank r gets the counts of its experts, [r * E_local, (r + 1) * E_local), and every
    # rank's flag.
    counts_table = counts[:num_experts].view(world_size, num_local_experts)
    if torch.compiler.is_compiling():  # one node: `comm.moe.compiled`
        recv_x, received, host_counts = compiled.dispatch_rows(
            counts_table, ~valid.all(), send_rows, base, num_experts)
        order_token = None
        splits: tuple[tuple[int, ...], ...] = ((), (), ())
    else:
        received, counts_list = agree_on_counts(counts_table, ~valid.all(), base, num_experts)
        recv_splits, send_splits = splits_of(counts_list)
        recv_x, order_token = exchange_rows(send_rows, recv_splits, send_splits, base)
        host_counts = torch.tensor(counts_list, dtype=torch.int64)
        # One list per source rank: never empty.
        per_expert = tuple(map(sum, zip(*(row[:-1] for row in counts_list))))
        splits = (send_splits, recv_splits, per_expert)
    recv_local_expert_ids = torch.repeat_interleave(
        torch.arange(num_local_experts, device=x.device).repeat(world_size),
        received[:, :-1].reshape(-1), output_size=recv_x.shape[0],
    )
    handle = DispatchHandle(
        base, num_tokens, topk, num_local_experts, sort_order, host_counts, recv_x.shape[0],
        order_token, *splits,
    )
    return recv_x, recv_local_expert_ids, handle


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
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}"
        )
    expert_out, topk_weights = check_combine(
        expert_out, topk_weights, handle, (handle.num_recv_tokens,), "num_recv_tokens",
        handle.sort_order,
    )
    if torch.compiler.is_compiling():  # one node: `comm.moe.compiled`
        returned = compiled.return_rows(
            expert_out, handle.counts, handle.sort_order.shape[0], handle.group)
    else:
        anchor = handle.order_token
        if anchor is None and torch.is_grad_enabled() and not run_has_order_token():
            anchor = _agree_on_grad(expert_out, handle.group)
        returned, _ = exchange_rows(
            expert_out, handle.send_splits, handle.recv_splits, handle.group, anchor)
    # Row j came back for the pair sort_order[j]: put the pairs back in (token, k) order.
    per_pair = torch.empty_like(returned).index_copy_(0, handle.sort_order, returned)
    return weighted_sum(per_pair, topk_weights)


def _agree_on_grad(expert_out: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """For a `combine` in grad mode with no order token to take: all-reduce (MAX) whether
    any rank's `expert_out` requires grad. Returns an anchor that makes this rank's
    exchange differentiable when its own `expert_out` would not, else None."""
    needs_grad = expert_out.requires_grad
    # torch.full: a copy from host memory would be one more host sync.
    flag = torch.full((1,), int(needs_grad), dtype=torch.int32, device=expert_out.device)
    unchecked_all_reduce(flag, dist.ReduceOp.MAX, group)
    if needs_grad or not bool(flag.item()):
        return None
    return torch.zeros(0, dtype=torch.float32, device=expert_out.device, requires_grad=True)
