"""Backward through comm.moe, in one process (a world of 1): gradients reach the experts
and the tokens, and after an overlapped forward the backward all-to-alls run in the
reverse of their launch order, whatever each ubatch thread recorded besides (the
autograd engine alone would order them by each thread's own sequence counter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm
import dbo


def _moe_layer_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0], [0, 1]])
    weights = torch.rand(5, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    expert_weight = torch.randn(4, 4, generator=generator, dtype=torch.float64,
                                requires_grad=True)
    return x, ids, weights, expert_weight


def _dense_reference(
    x: torch.Tensor, weights: torch.Tensor, expert_weight: torch.Tensor
) -> torch.Tensor:
    # Both experts are the same matmul here, so the MoE output is sum_k w[t,k] * x[t] @ W.
    return (weights.unsqueeze(-1) * (x @ expert_weight).unsqueeze(1)).sum(dim=1)


@pytest.mark.timeout(60)
def test_combine_propagates_the_expert_gradient(world_of_one: None) -> None:
    x, ids, weights, expert_weight = _moe_layer_inputs()
    recv_x, _, handle = comm.moe.dispatch(x.detach(), ids, 2)
    y = comm.moe.combine(recv_x @ expert_weight, handle, weights)
    y.sum().backward()
    reference_weight = expert_weight.detach().clone().requires_grad_(True)
    _dense_reference(x.detach(), weights.detach(), reference_weight).sum().backward()
    assert expert_weight.grad is not None, "the experts got no gradient from combine"
    assert torch.allclose(expert_weight.grad, reference_weight.grad)


@pytest.mark.timeout(60)
def test_dispatch_propagates_the_token_gradient(world_of_one: None) -> None:
    x, ids, weights, expert_weight = _moe_layer_inputs()
    recv_x, _, handle = comm.moe.dispatch(x, ids, 2)
    y = comm.moe.combine(recv_x @ expert_weight.detach(), handle, weights.detach())
    assert y.requires_grad, "y does not depend on x for autograd"
    y.sum().backward()
    reference_x = x.detach().clone().requires_grad_(True)
    _dense_reference(reference_x, weights.detach(), expert_weight.detach()).sum().backward()
    assert torch.allclose(x.grad, reference_x.grad)


def _spy_row_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record (phase, rows sent) for each all-to-all of rows (not the count exchanges)."""
    calls: list[tuple[str, int]] = []
    original = dist.all_to_all_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any) -> Any:
        if input.is_floating_point():
            calls.append(("backward" if _in_backward() else "forward", int(input.shape[0])))
        return original(output, input, *args)

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    return calls


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def test_backward_exchanges_run_in_reverse_launch_order(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_row_exchanges(monkeypatch)
    num_experts = 3
    generator = torch.Generator().manual_seed(0)
    # Ubatch 0 has 3 tokens, ubatch 1 has 5 (k = 1): each exchange is told by its size.
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, num_experts, (8, 1), generator=generator)
    gates = torch.rand(8, 1, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 4, generator=generator, dtype=torch.float64, requires_grad=True)

    def layer(x_part: torch.Tensor, ids_part: torch.Tensor, gates_part: torch.Tensor):
        recv, _, handle = comm.moe.dispatch(x_part, ids_part, num_experts)
        out = torch.tanh(recv @ weight)
        if x_part.shape[0] == 3:  # ubatch 0 records many more autograd ops
            for _ in range(300):
                out = out * 1.0
        return comm.moe.combine(out, handle, gates_part)

    splits = [(0, 3), (3, 8)]
    parts = [((x[a:b], ids[a:b], gates[a:b]), {}) for a, b in splits]
    serial = torch.cat([layer(*args) for args, _ in parts])
    expected = torch.autograd.grad(serial.pow(2).sum(), [x, weight])
    calls.clear()
    for _ in range(2):  # a second run must not link to the first run's (freed) graph
        with dbo.UBatchRunner(num_ubatches=2) as runner:  # fresh threads, fresh counters
            y = torch.cat(runner.run(layer, parts))
        assert torch.equal(y, serial)
        launched = [rows for phase, rows in calls if phase == "forward"]
        assert sorted(launched) == [3, 3, 5, 5]
        calls.clear()
        grads = torch.autograd.grad(y.pow(2).sum(), [x, weight])
        backward = [rows for phase, rows in calls if phase == "backward"]
        assert backward == launched[::-1]
        calls.clear()
        for got, want in zip(grads, expected):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_dispatch_handle_carries_an_order_token_only_when_grad_flows(world_of_one: None) -> None:
    x = torch.randn(4, 3)
    ids = torch.tensor([[0], [1], [1], [0]])
    _, _, handle = comm.moe.dispatch(x, ids, 2)
    assert handle.order_token is None  # nothing requires grad
    x.requires_grad_()
    with torch.no_grad():
        _, _, handle = comm.moe.dispatch(x, ids, 2)
    assert handle.order_token is None  # no graph is built in inference
    recv, _, handle = comm.moe.dispatch(x, ids, 2)
    token = handle.order_token
    assert token is not None and token.shape == (0,) and token.dtype == torch.float32
    assert token.requires_grad
    # combine with an expert output that needs no grad still joins the graph (through the
    # token), so its backward exchange runs and so does dispatch's.
    y = comm.moe.combine(torch.zeros_like(recv), handle, torch.ones(4, 1))
    assert y.requires_grad
    (grad,) = torch.autograd.grad(y.sum(), [x])
    assert torch.equal(grad, torch.zeros_like(x))


def test_a_backward_with_create_graph_raises_instead_of_a_wrong_second_order(
    world_of_one: None,
) -> None:
    # The exchange's backward records no graph; a gradient of the gradient would lack
    # every path through it (here 2 of the true 2 + 6x) and still look plausible.
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0], [1], [0], [1]])
    gates = torch.ones(4, 1, dtype=torch.float64)
    recv, _, handle = comm.moe.dispatch(x, ids, 2)
    y = comm.moe.combine(recv.pow(2), handle, gates) + x.pow(3)
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # The first-order backward of the same graph still works.
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(grad, 2 * x.detach() + 3 * x.detach().pow(2))
