"""What the distributed tests' blocks share: the tensor-parallel pair of exchanges
(Megatron's f and g: `comm.all_reduce`, a yield point inside an overlap, in the backward
or the forward), and the README's MoE layer."""

from __future__ import annotations

from typing import Any

import torch

import comm


class SumInBackward(torch.autograd.Function):
    """The identity; the backward sums the gradient over the ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        comm.all_reduce(total)  # inside a ubatch's backward: yields while in flight
        return total


class SumInForward(torch.autograd.Function):
    """The sum over the ranks; the backward is the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        comm.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ReadmeMoELayer(torch.nn.Module):
    """The README's MoE layer ("Making your own model DBO-ready"), as it is printed there."""

    def __init__(self, hidden: int, num_experts: int, topk: int = 2) -> None:
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.mix = torch.nn.Linear(hidden, hidden)
        self.router = torch.nn.Linear(hidden, num_experts)
        local = num_experts // torch.distributed.get_world_size()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(x)
        weights, ids = self.router(x).softmax(-1).topk(self.topk)
        recv, local_ids, handle = comm.moe.dispatch(x, ids, self.num_experts)
        out = torch.empty_like(recv)
        for e, expert in enumerate(self.experts):
            out[local_ids == e] = expert(recv[local_ids == e])
        return x + comm.moe.combine(out, handle, weights)
