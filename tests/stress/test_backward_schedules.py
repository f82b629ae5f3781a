"""Randomized overlapped backwards: 2-4 ubatches whose backwards yield unequal numbers of
times at several points (data-dependent per ubatch). The gradients equal those of the
same ubatches in turn (bitwise with two ubatches, allclose and the same bits every run
with more), each ubatch's backward runs in its own ubatch thread, and the backward's
turns go round the baton ring as the forward's do."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from _stress import size
from _ubatch_programs import expected_turns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dbo

pytestmark = pytest.mark.stress

EXAMPLES = size(150, 7_500)
"""Random backwards per ubatch count."""

_SETTINGS = dict(
    derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class _YieldingBackward(torch.autograd.Function):
    """Identity whose backward yields `counts[ubatch id]` times, noting each turn."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], log: list[Any]) -> torch.Tensor:
        ctx.counts, ctx.log = counts, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        me = dbo.current_ubatch_id()
        ctx.log.append((me, threading.current_thread().name))
        for _ in range(ctx.counts[me]):
            dbo.yield_()
            ctx.log.append((me, threading.current_thread().name))
        return grad * 1.5, None, None


def _model(layers: int) -> torch.nn.ModuleList:
    torch.manual_seed(layers)
    return torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(layers))


def _gradients(
    model: torch.nn.ModuleList, x: torch.Tensor, counts: list[list[int]], num_ubatches: int,
    overlapped: bool, log: list[Any],
) -> list[torch.Tensor]:
    def fn(h: torch.Tensor) -> torch.Tensor:
        for layer, layer_counts in zip(model, counts):
            h = _YieldingBackward.apply(torch.tanh(layer(h)), layer_counts, log)
        return h

    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if overlapped:
        y = dbo.overlap(fn, num_ubatches=num_ubatches, timeout_s=30)(x)
    else:
        y = torch.cat([fn(part) for part in x.tensor_split(num_ubatches)])
    (y * y).sum().backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


@pytest.mark.timeout(size(120, 6 * 3600))
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_random_overlapped_backwards_match_the_ubatches_in_turn(
    num_ubatches: int, data: st.DataObject
) -> None:
    layers = data.draw(st.integers(1, 4), label="layers")
    counts = data.draw(st.lists(
        st.lists(st.integers(0, 3), min_size=num_ubatches, max_size=num_ubatches),
        min_size=layers, max_size=layers,
    ), label="yields per layer and ubatch")
    rows = data.draw(st.integers(num_ubatches, 3 * num_ubatches), label="rows")
    model = _model(layers)
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
    log: list[Any] = []
    got = _gradients(model, x, counts, num_ubatches, True, log)
    again = _gradients(model, x, counts, num_ubatches, True, [])
    want = _gradients(model, x, counts, num_ubatches, False, [])
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    if num_ubatches == 2:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    else:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    # Each ubatch's backward takes one turn plus one per yield, round the ring.
    yields = [sum(layer[u] for layer in counts) for u in range(num_ubatches)]
    turns = _turn_order([(ubatch, "") for ubatch, _ in expected_turns(yields)])
    assert _turn_order(log) == turns, (counts, log)
    threads = {ubatch: {name for u, name in log if u == ubatch} for ubatch in range(num_ubatches)}
    assert all(len(names) == 1 and next(iter(names)).startswith("dbo-ubatch-")
               for names in threads.values()), threads
    assert len({next(iter(names)) for names in threads.values()}) == num_ubatches


def _turn_order(log: list[Any]) -> list[int]:
    """The ubatches in turn order, a ubatch that keeps the baton counted once: every turn
    notes at least once (a yield notes as it returns), so a run of one ubatch's notes
    is its turns in a row."""
    order: list[int] = []
    for ubatch, _ in log:
        if not order or order[-1] != ubatch:
            order.append(ubatch)
    return order
