"""Stateful arguments: split rules users register, the refusal of objects that hold batch
rows without one, and `overlap_if`."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import dbo

TIMEOUT_S = 30


class RowState:
    """Per-row state that lives across calls: a running sum per row."""

    def __init__(self, rows: int) -> None:
        self.sums = torch.zeros(rows, 3)


class RowStateView(RowState):
    """One ubatch's rows of a RowState (a view: writes land in the whole); a subclass, so
    the merge finds the rule by the outputs' type."""

    def __init__(self, whole: RowState, start: int, stop: int) -> None:  # noqa: D107
        self.whole, self.sums = whole, whole.sums[start:stop]


def split_rows(state: RowState, rows: list[int]) -> list[RowStateView]:
    starts = [sum(rows[:i]) for i in range(len(rows))]
    return [RowStateView(state, start, start + count) for start, count in zip(starts, rows)]


def merge_rows(parts: list[RowStateView]) -> RowState:
    assert all(part.whole is parts[0].whole for part in parts)
    return parts[0].whole


@pytest.fixture
def registered() -> Any:
    dbo.register_split_rule(RowState, split=split_rows, merge=merge_rows)
    yield


def accumulate(x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
    state.sums += x
    dbo.yield_()
    return x * 2, state


def test_a_registered_type_gets_each_ubatch_its_rows_and_merges_back_to_the_whole(
    registered: None,
) -> None:
    for batch in range(2, 8):
        x = torch.arange(batch * 3, dtype=torch.float32).reshape(batch, 3)
        state = RowState(batch)
        step = dbo.overlap(accumulate, timeout_s=TIMEOUT_S)
        for _ in range(3):  # the state persists across calls, written in place
            y, merged = step(x, state)
        assert merged is state
        assert torch.equal(state.sums, 3 * x)  # every row written exactly once per call
        assert torch.equal(y, 2 * x)


def test_rows_are_those_tensor_split_gives_with_three_ubatches(registered: None) -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(x: torch.Tensor, state: Any) -> torch.Tensor:
        with lock:
            seen.append((x.shape[0], state.sums.shape[0]))
        return x

    dbo.overlap(record, num_ubatches=3, timeout_s=TIMEOUT_S)(torch.zeros(7, 3), RowState(7))
    assert sorted(seen) == sorted((len(p), len(p)) for p in torch.zeros(7).tensor_split(3))


def test_a_split_rule_returning_the_wrong_count_is_named(registered: None) -> None:
    class Odd(RowState):
        pass

    dbo.register_split_rule(Odd, split=lambda obj, rows: [obj], merge=merge_rows)
    with pytest.raises(ValueError, match=r"Odd returned 1 parts of kwargs\['state'\] for 2"):
        dbo.overlap(accumulate, timeout_s=TIMEOUT_S)(torch.zeros(4, 3), state=Odd(4))


def test_an_unregistered_object_holding_batch_rows_is_refused_naming_path_and_fixes() -> None:
    class Cache:
        def __init__(self, rows: int) -> None:
            self.layers = [type("Layer", (), {})() for _ in range(2)]
            for layer in self.layers:
                layer.keys = torch.zeros(rows, 4)

    step = dbo.overlap(accumulate, timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError) as raised:
        step(torch.zeros(4, 3), state=Cache(4))
    message = str(raised.value)
    assert "kwargs['state']" in message and ".layers[" in message and "].keys" in message
    for fix in ("dbo.register_split_rule(Cache", "no_split=", "split="):
        assert fix in message
    # Passed whole on purpose, or the batch is inline anyway: no refusal.
    whole = dbo.overlap(lambda x, state: x, no_split="state", timeout_s=TIMEOUT_S)
    assert whole(torch.zeros(4, 3), state=Cache(4)).shape == (4, 3)
    small = dbo.overlap(lambda x, state: x, min_batch_size=8, timeout_s=TIMEOUT_S)
    assert small(torch.zeros(4, 3), state=Cache(4)).shape == (4, 3)


def test_objects_without_batch_rows_and_modules_pass_whole_as_before() -> None:
    class Settings:
        def __init__(self) -> None:
            self.scale = torch.ones(3)  # 3 rows, not the batch's 4
            self.name = "s"

    module = torch.nn.Linear(3, 4)  # a weight of 4 rows: modules are shared weights
    seen = []

    def fn(x: torch.Tensor, settings: Settings, layer: torch.nn.Module) -> torch.Tensor:
        seen.append((settings, layer))
        return x * settings.scale

    settings = Settings()
    dbo.overlap(fn, timeout_s=TIMEOUT_S)(torch.ones(4, 3), settings, module)
    assert seen == [(settings, module)] * 2


def test_register_split_rule_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="needs a class"):
        dbo.register_split_rule(RowState(2), split=split_rows, merge=merge_rows)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="merge must be callable"):
        dbo.register_split_rule(RowState, split=split_rows, merge=None)  # type: ignore[arg-type]


def test_overlap_if_decides_per_call_with_the_call_arguments() -> None:
    ids: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        ids.append(dbo.current_ubatch_id() if dbo.enabled() else -1)
        return x

    step = dbo.overlap(fn, overlap_if=lambda x: x.numel() >= 12, timeout_s=TIMEOUT_S)
    step(torch.zeros(4, 2))  # 8 elements: inline
    assert ids == [-1]
    step(torch.zeros(4, 3))  # 12: overlapped
    assert sorted(ids[1:]) == [0, 1]
    with pytest.raises(TypeError, match="overlap_if must be callable"):
        dbo.overlap(fn, overlap_if=3)  # type: ignore[arg-type]
