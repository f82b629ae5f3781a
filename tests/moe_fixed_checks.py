"""Shared by the fixed-shape MoE tests (one process and several): experts that act on
either layout with the same arithmetic, the reference drops, and the host-read counter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import comm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _host_reads import HostReads  # noqa: E402, F401 - the examples' counter, re-exported


def expert_scales(num_local_experts: int, rank: int) -> torch.Tensor:
    """Local expert e multiplies by the global id + 1 (after a tanh)."""
    return torch.arange(num_local_experts, dtype=torch.float64) + 1 + rank * num_local_experts


def fixed_experts(recv_x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E_local, N, H] -> [E_local, N, H], row by row."""
    return torch.tanh(recv_x) * scales.to(recv_x.dtype).view(-1, 1, 1)


def dynamic_experts(recv_x: torch.Tensor, recv_ids: torch.Tensor, scales: torch.Tensor):
    """The same arithmetic on dispatch's [R, H] rows."""
    return torch.tanh(recv_x) * scales.to(recv_x.dtype)[recv_ids].unsqueeze(1)


def fixed_round_trip(x, ids, weights, num_experts, capacity, scales, check_ids=False):
    recv_x, _, handle = comm.moe.dispatch_fixed(
        x, ids, num_experts, capacity, check_ids=check_ids
    )
    return comm.moe.combine_fixed(fixed_experts(recv_x, scales), handle, weights)


def dynamic_round_trip(x, ids, weights, num_experts, scales):
    recv_x, recv_ids, handle = comm.moe.dispatch(x, ids, num_experts)
    return comm.moe.combine(dynamic_experts(recv_x, recv_ids, scales), handle, weights)


def kept_pairs(ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, K] bool: the pairs dispatch_fixed documents as sent (valid id, among the first
    `capacity` pairs of its expert in (token, k) order), computed the slow way."""
    seen = [0] * num_experts
    kept = torch.zeros(ids.shape, dtype=torch.bool)
    for token in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            expert = int(ids[token, k])
            if 0 <= expert < num_experts:
                kept[token, k] = seen[expert] < capacity
                seen[expert] += 1
    return kept
