"""`dbo.overlap(no_split=...)` passes arguments whole to every ubatch; `dbo.yield_between`
passes the baton between consecutive modules through forward pre-hooks."""

from __future__ import annotations

import pytest
import torch

import dbo

TIMEOUT_S = 30.0


def test_a_broadcast_keyword_argument_reaches_every_ubatch_whole() -> None:
    seen: list[torch.Tensor] = []

    def fn(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        seen.append(position_ids)
        return x + position_ids

    x, positions = torch.zeros(4, 3), torch.arange(3.0).unsqueeze(0)  # [B, S] and [1, S]
    out = dbo.overlap(fn, no_split=["position_ids"], timeout_s=TIMEOUT_S)(
        x, position_ids=positions
    )
    assert len(seen) == 2 and all(part is positions for part in seen)
    assert torch.equal(out, x + positions)
    step = dbo.overlap(fn, no_split="position_ids", timeout_s=TIMEOUT_S)
    assert torch.equal(step(x, positions), x + positions)  # the named one, passed by position
    assert len(seen) == 4 and all(part is positions for part in seen)


def test_a_positional_argument_given_by_index_reaches_every_ubatch_whole() -> None:
    seen: list[tuple[int, torch.Tensor]] = []

    @dbo.overlap(no_split=1, timeout_s=TIMEOUT_S)
    def fn(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        seen.append((dbo.current_ubatch_id(), table))
        return x @ table

    x, table = torch.ones(4, 2), torch.eye(2)
    assert torch.equal(fn(x, table), x)
    assert sorted(ubatch for ubatch, _ in seen) == [0, 1]
    assert all(part is table for _, part in seen)


def test_a_name_the_function_does_not_take_is_refused_when_wrapping() -> None:
    def fn(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match=r"'positions'.*those are x, position_ids"):
        dbo.overlap(fn, no_split=["positions"])
    module = torch.nn.Linear(2, 2)  # a module's names are those of its forward
    with pytest.raises(ValueError, match="not a named parameter of Linear.forward"):
        dbo.overlap(module, no_split=["weight"])
    with pytest.raises(TypeError, match="argument names and indices >= 0"):
        dbo.overlap(fn, no_split=[-1])
    with pytest.raises(ValueError, match="no_split= or split="):
        dbo.overlap(fn, no_split=["position_ids"], split=dbo.default_split)


def test_an_index_past_the_calls_arguments_is_refused_at_the_call() -> None:
    step = dbo.overlap(lambda *args: args[0], no_split=[2], timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="positional argument 2, but the call passed 2"):
        step(torch.zeros(4), torch.zeros(4))
    assert torch.equal(step(torch.zeros(4), torch.zeros(4), torch.ones(1)), torch.zeros(4))


def test_an_inline_call_passes_the_arguments_unchanged() -> None:
    positions = torch.arange(3).unsqueeze(0)
    got = dbo.overlap(lambda x, position_ids: position_ids, no_split=["position_ids"],
                      min_batch_size=100, timeout_s=TIMEOUT_S)(torch.zeros(4, 3), positions)
    assert got is positions


class _Recorder(torch.nn.Module):
    def __init__(self, index: int, entries: list[tuple[int, int]]) -> None:
        super().__init__()
        self.index, self.entries = index, entries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entries.append((dbo.current_ubatch_id(), self.index))
        return x + 1


def test_the_ubatches_alternate_at_the_module_boundaries_until_the_hooks_are_removed() -> None:
    entries: list[tuple[int, int]] = []
    model = torch.nn.Sequential(*[_Recorder(index, entries) for index in range(3)])
    step = dbo.overlap(model, timeout_s=TIMEOUT_S)
    hooks = dbo.yield_between(model)
    assert torch.equal(step(torch.zeros(4)), torch.full((4,), 3.0))
    assert entries == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert torch.equal(model(torch.zeros(2)), torch.full((2,), 3.0))  # no-ops outside
    hooks.remove()
    entries.clear()
    step(torch.zeros(4))
    assert entries == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
