"""Expert-parallel routing with fixed shapes and no host read: for decode and CUDA graphs.

    recv_x, recv_counts, handle = comm.moe.dispatch_fixed(x, topk_ids, num_experts, capacity)
    expert_out = torch.bmm(recv_x, w)              # [E_local, W * capacity, H] @ [E_local, H, H']
    y = comm.moe.combine_fixed(expert_out, handle, topk_weights)

Every rank reserves `capacity` rows per (source rank, expert), so both all-to-alls move
equal parts of buffers whose shapes depend only on T, K, `capacity` and the world size;
the slot of each (token, k) pair is computed on the device (a stable sort and an
exclusive cumsum), and the valid rows per block travel as device counts. Nothing is read
on the host (except the optional id check), nothing has a data-dependent shape, so the
path runs ahead of the GPU and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comm._checks import resolve_group
from comm.moe import compiled
from comm.moe._exchange import (
    check_combine,
    check_dispatch,
    check_fixed_ids,
    check_positive_int,
    counts_with_flags,
    exchange_counts,
    exchange_rows,
    run_has_order_token,
    sort_by_expert,
    weighted_sum,
)


@dataclass(frozen=True)
class FixedDispatchHandle:
    """What `combine_fixed` needs: valid for one `combine_fixed` on the same ranks (the
    same ubatch, inside an overlap)."""

    group: dist.ProcessGroup
    num_tokens: int  # T
    topk: int  # K
    num_local_experts: int  # E_local
    capacity: int
    slot_of_pair: torch.Tensor
    """[T * K] int64: the row of pair `token * K + k` in the send buffer [E * capacity]
    (expert-major), or E * capacity for a pair not sent (id -1, dropped)."""
    num_dropped: torch.Tensor
    """[] int64 on x's device: the pairs this rank could not send (over capacity, or an
    id outside [-1, num_experts) with `check_ids=False`); -1 ids are not counted."""
    recv_counts: torch.Tensor  # [E_local, W] int64: dispatch_fixed's second output
    order_token: torch.Tensor | None = None  # as DispatchHandle's

    @property
    def num_rows(self) -> int:
        """W * capacity: rows per local expert in `recv_x` and `expert_out`."""
        return int(self.recv_counts.shape[1]) * self.capacity


def dispatch_fixed(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, capacity: int,
    group: dist.ProcessGroup | None = None, *, check_ids: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, FixedDispatchHandle]:
    """Send each token to its top-k experts into fixed-size blocks.

    Args:
        x: [T, H] tokens; topk_ids: [T, K] integer ids in `[-1, num_experts)`, same
            device; -1 means "no expert" (a padding token): nothing is sent and the pair
            contributes zero in `combine_fixed`.
        num_experts: total experts over the group, divisible by its size W.
        capacity: the most rows one rank sends to one expert, the same on every rank
            (like `num_experts`: the blocks have one size). `capacity >= T` drops
            nothing (a token picks an expert at most once); a smaller one keeps the
            first `capacity` pairs per expert in token order and drops the rest (zero
            contribution, counted in `handle.num_dropped`).
        check_ids: ValueError on every rank together when any rank passes an id
            outside `[-1, num_experts)`, after one host read of the flags carried in
            the counts exchange. False (and always under CUDA-graph capture): no host
            read; such ids are dropped and counted like overflow.

    Returns `(recv_x, recv_counts, handle)`: `recv_x` [E_local, W * capacity, H], rows
    `[s * capacity, s * capacity + recv_counts[e, s])` of local expert e from source
    rank s in its token order, the rest zero padding; `recv_counts` [E_local, W] int64
    on x's device. Two all-to-alls of equal parts launched together (one yield inside
    an overlap); TypeError / ValueError before any communication for bad arguments.
    """
    base = resolve_group(group)
    world_size = base.size()
    x, topk_ids, num_experts = check_dispatch(x, topk_ids, num_experts, world_size)
    capacity = check_capacity(capacity)
    num_tokens, topk = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    num_local_experts = num_experts // world_size
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    valid, keys, order, counts = sort_by_expert(flat_ids, num_experts)
    # A pair's position among the pairs of its expert, in (token, k) order.
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty_like(keys).scatter_(
        0, order, torch.arange(keys.numel(), device=x.device) - starts[keys[order]]
    )
    sent = valid & (positions < capacity)
    no_slot = num_experts * capacity
    slot_of_pair = torch.where(sent, keys * capacity + positions, no_slot)
    num_dropped = (flat_ids != -1).sum() - sent.sum()

    # Row i of the send buffer takes token source[i]; token T is a zero row (padding).
    source = torch.full((no_slot + 1,), num_tokens, dtype=torch.int64, device=x.device)
    pair_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(topk)
    source.scatter_(0, slot_of_pair, pair_tokens)  # unsent pairs all land on the extra row
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    send_rows = padded.index_select(0, source[:no_slot])

    counts_table = counts[:num_experts].clamp(max=capacity).view(world_size, num_local_experts)
    bad_ids = ((flat_ids < -1) | (flat_ids >= num_experts)).any()
    if torch.compiler.is_compiling():  # one node: `comm.moe.compiled`
        received, rows = compiled.dispatch_exchange(
            counts_with_flags(counts_table, bad_ids), send_rows, base, check_ids, num_experts)
        order_token = None
    else:
        received, counts_work = exchange_counts(counts_table, bad_ids, base, async_op=True)
        rows, order_token = exchange_rows(send_rows, None, None, base)
        assert counts_work is not None
        counts_work.wait(yield_first=False)
        check_fixed_ids(received, check_ids, num_experts)
    # rows: [W sources, E_local, capacity, H] -> [E_local, W * capacity, H]
    recv_x = rows.view(world_size, num_local_experts, capacity, -1).transpose(0, 1)
    recv_x = recv_x.reshape(num_local_experts, world_size * capacity, -1)
    recv_counts = received[:, :-1].t().contiguous()
    handle = FixedDispatchHandle(
        base, num_tokens, topk, num_local_experts, capacity, slot_of_pair, num_dropped,
        recv_counts, order_token,
    )
    return recv_x, recv_counts, handle


def combine_fixed(
    expert_out: torch.Tensor, handle: FixedDispatchHandle, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Send expert outputs back and sum them per token, like `combine`.

    `expert_out` [E_local, W * capacity, H_out]: row i of expert e the output for
    `recv_x[e, i]`; padding rows never reach `y`, whatever they hold (NaN included).
    `topk_weights` [T, K] floating. Returns `y` [T, H_out] in token order and
    `expert_out`'s dtype; unsent pairs (-1, dropped) contribute zero. One all-to-all of
    equal parts, no host read. In grad mode `y` requires grad on every rank (so that
    every rank takes the backward exchange, with no host read to agree on it): run
    inference under `torch.no_grad()` or `torch.inference_mode()`.
    """
    if not isinstance(handle, FixedDispatchHandle):
        raise TypeError(
            "handle must be the FixedDispatchHandle returned by dispatch_fixed, got "
            f"{type(handle).__name__}"
        )
    expert_out, topk_weights = check_combine(
        expert_out, topk_weights, handle, (handle.num_local_experts, handle.num_rows),
        "num_local_experts, world_size * capacity", handle.slot_of_pair,
    )
    world_size = int(handle.recv_counts.shape[1])
    # Back to the send layout [W, E_local, capacity, H]: each rank its own rows.
    blocks = expert_out.view(handle.num_local_experts, world_size, handle.capacity, -1)
    blocks = blocks.transpose(0, 1).reshape(-1, expert_out.shape[2])
    if torch.compiler.is_compiling():
        returned = compiled.exchange_rows(blocks, handle.group)
    else:
        anchor = handle.order_token
        if anchor is None and torch.is_grad_enabled() and not run_has_order_token():
            anchor = torch.zeros(0, device=expert_out.device, requires_grad=True)
        returned, _ = exchange_rows(blocks, None, None, handle.group, anchor)
    padded = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])
    per_pair = padded.index_select(0, handle.slot_of_pair)
    # Zero weights for unsent pairs: their zero row times any weight (inf included) is 0.
    unsent = (handle.slot_of_pair == padded.shape[0] - 1).view(topk_weights.shape)
    return weighted_sum(per_pair, topk_weights.masked_fill(unsent, 0))


def check_capacity(capacity: Any) -> int:
    return check_positive_int("capacity", capacity, " (rows per source rank and expert)")
