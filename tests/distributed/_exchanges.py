"""The tensor-parallel pair of exchanges (Megatron's f and g) the distributed tests' blocks
use: `comm.all_reduce`, a yield point inside an overlap, in the backward or the forward."""

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
