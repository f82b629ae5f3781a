"""Shared by the fixed-shape MoE tests (one process and several): experts that act on
either layout with the same arithmetic, the dense reference, and a host-read counter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import comm


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


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values and records the all-to-alls' split arguments,
    in the thread that enters it: `_local_scalar_dense` (`item()`, `bool()`, `int()`)
    through the dispatcher, and `tolist()` / `numpy()` / `cpu()`, which do not go through
    it, by wrapping them for the duration."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.all_to_all_splits: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if "alltoall" in str(func):
            self.all_to_all_splits.append((list(args[3]), list(args[4])))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

        def wrap(name: str):
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.reads += 1
                return originals[name](tensor, *args, **kwargs)
            return read

        for name in originals:
            setattr(torch.Tensor, name, wrap(name))
        try:
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
