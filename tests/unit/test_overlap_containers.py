"""What reaches `fn` and the caller: an argument with nothing to split is the same object
in every ubatch; dict and namedtuple subclasses keep their type; equal non-tensor
outputs merge into one value, different ones are refused; a function whose body would
run after the overlap is refused when wrapped."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import dbo

TIMEOUT_S = 30.0


def _overlap(fn: Any, **options: Any) -> Any:
    return dbo.overlap(fn, timeout_s=TIMEOUT_S, **options)


def test_mutations_of_a_list_argument_reach_the_caller() -> None:
    """A container with nothing to split reaches every ubatch as the same object: a list
    the caller passes for fn to fill is filled."""
    log: list[int] = []

    def fn(x: torch.Tensor, log: list[int]) -> torch.Tensor:
        log.append(dbo.current_ubatch_id())
        return x

    dbo.overlap(fn)(torch.zeros(4), log)
    assert sorted(log) == [0, 1]


def test_a_defaultdict_argument_is_split_into_defaultdicts() -> None:
    """A defaultdict holding a tensor to split is rebuilt per ubatch as a defaultdict."""
    seen: list[tuple[Any, ...]] = []

    def fn(x: torch.Tensor, table: collections.defaultdict[str, Any]) -> torch.Tensor:
        seen.append((type(table), table.default_factory, tuple(table["a"].shape)))
        return x + table["a"]

    table = collections.defaultdict(list, {"a": torch.zeros(4)})
    assert torch.equal(_overlap(fn)(torch.ones(4), table), torch.ones(4))
    assert seen == [(collections.defaultdict, list, (2,))] * 2


def test_a_counter_argument_reaches_every_ubatch_with_its_counts() -> None:
    """A Counter (no tensors) reaches every ubatch with its counts."""
    seen: list[object] = []

    def fn(x: torch.Tensor, counts: collections.Counter[str]) -> torch.Tensor:
        seen.append(dict(counts))
        return x

    dbo.overlap(fn)(torch.ones(4), collections.Counter(a=3))
    assert seen == [{"a": 3}, {"a": 3}]


class Tagged(collections.namedtuple("Tagged", "x")):  # noqa: PYI024
    def __new__(cls, x: torch.Tensor) -> Tagged:
        self = super().__new__(cls, x)
        self.source = "made"  # an attribute its __new__ sets on the instance
        return self


def test_a_namedtuple_subclass_is_merged_into_its_own_type() -> None:
    out = _overlap(lambda t: Tagged(t * 1))(torch.zeros(4))
    assert type(out) is Tagged
    assert out.source == "made"


class ElementwiseEqual:
    """Like a numpy array: `==` is elementwise, and its truth value is ambiguous."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.shape = (len(values),)

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, ElementwiseEqual):
            return NotImplemented
        return _Elementwise([a == b for a, b in zip(self.values, other.values)])

    __hash__ = None  # type: ignore[assignment]


class _Elementwise:
    def __init__(self, flags: list[bool]) -> None:
        self.flags = flags

    def __bool__(self) -> bool:
        raise ValueError("the truth value of an array with more than one element is ambiguous")

    def all(self) -> bool:
        return all(self.flags)


def test_equal_array_like_leaves_from_every_ubatch_merge_as_one_value() -> None:
    out = _overlap(lambda t: (t * 1, ElementwiseEqual([0, 1, 2])))(torch.zeros(4))
    assert out[1].values == [0, 1, 2]


def test_array_like_leaves_that_differ_are_still_refused() -> None:
    def fn(t: torch.Tensor) -> Any:
        return t * 1, ElementwiseEqual([dbo.current_ubatch_id(), 1])

    with pytest.raises(ValueError, match="different non-tensor values"):
        _overlap(fn)(torch.zeros(4))


async def _coroutine_function(x: torch.Tensor) -> torch.Tensor:
    return x


def _generator_function(x: torch.Tensor) -> Any:
    yield x


@pytest.mark.parametrize("fn", [_coroutine_function, _generator_function])
def test_a_coroutine_or_generator_function_is_refused_when_wrapped(fn: Any) -> None:
    with pytest.raises(TypeError, match="coroutine or generator function"):
        dbo.overlap(fn)
