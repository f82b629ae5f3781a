"""balanced_token_split and the default split/merge helpers."""

from __future__ import annotations

import collections
import random
import warnings
from typing import Any

import pytest
import torch

import dbo


def _check_tiling(splits: list[dbo.TokenSplit], counts: list[int]) -> None:
    total = sum(counts)
    assert splits[0].token_slice.start == 0 and splits[-1].token_slice.stop == total
    for a, b in zip(splits, splits[1:]):
        assert a.token_slice.stop == b.token_slice.start
    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    for split in splits:
        lo, hi = split.token_slice.start, split.token_slice.stop
        touching = [r for r in range(len(counts)) if starts[r] < hi and starts[r + 1] > lo]
        if touching:
            assert split.request_slice == slice(touching[0], touching[-1] + 1)
        else:
            assert split.request_slice.start == split.request_slice.stop


@pytest.mark.parametrize("num_ubatches", [1, 2, 3, 4])
def test_straddling_split_is_balanced_to_one_token(num_ubatches: int) -> None:
    rng = random.Random(num_ubatches)
    for _ in range(50):
        counts = [rng.randint(0, 20) for _ in range(rng.randint(0, 12))]
        splits = dbo.balanced_token_split(counts, num_ubatches)
        assert len(splits) == num_ubatches
        sizes = [s.token_slice.stop - s.token_slice.start for s in splits]
        assert max(sizes) - min(sizes) <= 1
        _check_tiling(splits, counts)


def test_a_straddling_request_appears_in_both_ubatches() -> None:
    splits = dbo.balanced_token_split([5, 3, 2, 7], 2)
    assert [s.token_slice for s in splits] == [slice(0, 9), slice(9, 17)]
    assert [s.request_slice for s in splits] == [slice(0, 3), slice(2, 4)]


def _best_max(counts: list[int], num_ubatches: int) -> int:
    """Brute force: the smallest possible largest ubatch with cuts on request boundaries."""
    import itertools

    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    best = sum(counts)
    for cuts in itertools.combinations_with_replacement(range(len(starts)), num_ubatches - 1):
        bounds = [0, *(starts[c] for c in cuts), starts[-1]]
        best = min(best, max(b - a for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_request_boundary_split_minimises_the_largest_ubatch(num_ubatches: int) -> None:
    rng = random.Random(7 + num_ubatches)
    for _ in range(100):
        counts = [rng.randint(0, 15) for _ in range(rng.randint(1, 7))]
        splits = dbo.balanced_token_split(counts, num_ubatches, allow_straddle=False)
        _check_tiling(splits, counts)
        starts = {sum(counts[:r]) for r in range(len(counts) + 1)}
        assert all(s.token_slice.start in starts for s in splits), "cuts on request boundaries"
        sizes = [s.token_slice.stop - s.token_slice.start for s in splits]
        assert max(sizes) == _best_max(counts, num_ubatches)
        ranges = [s.request_slice for s in splits if s.request_slice.start < s.request_slice.stop]
        for a, b in zip(ranges, ranges[1:]):
            assert a.stop <= b.start, "no request appears in two ubatches"
        if sum(1 for count in counts if count > 0) >= num_ubatches:
            assert min(sizes) > 0, f"{counts} into {num_ubatches}: {sizes} leaves one empty"


@pytest.mark.parametrize(
    ("counts", "num_ubatches", "expected"),
    [([6, 5, 1], 3, [6, 5, 1]), ([10, 1, 1, 1], 3, [10, 2, 1]), ([3, 0, 0, 3], 2, [3, 3])],
)
def test_request_boundary_split_leaves_no_ubatch_empty_when_it_can(
    counts: list[int], num_ubatches: int, expected: list[int]
) -> None:
    splits = dbo.balanced_token_split(counts, num_ubatches, allow_straddle=False)
    assert [s.token_slice.stop - s.token_slice.start for s in splits] == expected


def test_token_split_accepts_tensors_and_rejects_bad_input() -> None:
    splits = dbo.balanced_token_split(torch.tensor([4, 4]), 2, allow_straddle=False)
    assert [s.token_slice for s in splits] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError):
        dbo.balanced_token_split([3, -1], 2)
    with pytest.raises(ValueError):
        dbo.balanced_token_split([3], 0)
    with pytest.raises(TypeError):
        dbo.balanced_token_split([3], "2")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dbo.balanced_token_split([3.5], 2)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="integer counts"):
        dbo.balanced_token_split(torch.tensor([2.7, 1.9]), 2)  # not truncated to [2, 1]
    with pytest.raises(TypeError, match="integer counts"):
        dbo.balanced_token_split(torch.tensor([True, False]), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental in torch
        complex_counts = torch.tensor([1, 2], dtype=torch.complex32)
    with pytest.raises(TypeError, match="integer counts"):
        dbo.balanced_token_split(complex_counts, 2)


@pytest.mark.parametrize(
    "counts",
    [
        [True, False, True],  # a bool tensor is refused: so is a list of bools
        [torch.tensor(True), torch.tensor(False)],
        [2.0, 3.0],
        [[1, 2], [3, 4]],
        ["3"],
    ],
)
def test_token_split_refuses_counts_that_are_not_ints_naming_the_argument(counts: Any) -> None:
    with pytest.raises(TypeError, match="num_tokens_per_request"):
        dbo.balanced_token_split(counts, 2)


@pytest.mark.parametrize(("num_ubatches", "error"), [(0, ValueError), (-1, ValueError),
                                                     (True, TypeError), (2.5, TypeError)])
def test_default_split_checks_its_ubatch_count(num_ubatches: Any, error: type) -> None:
    for args in ((torch.arange(6.0),), (3,)):  # with a tensor to split, and without
        with pytest.raises(error, match="num_ubatches"):
            dbo.default_split(args, {}, num_ubatches)


def test_default_merge_of_no_outputs_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no ubatch outputs"):
        dbo.default_merge([])


@pytest.mark.parametrize("kind", ["nested-strided", "nested-jagged", "sparse"])
def test_a_tensor_the_default_split_cannot_cut_is_named_with_a_hint(kind: str) -> None:
    parts = [torch.ones(2), torch.ones(3), torch.ones(1), torch.ones(4)]
    if kind == "sparse":
        tensor = torch.eye(4).to_sparse()
    else:
        layout = torch.strided if kind == "nested-strided" else torch.jagged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype feature
            tensor = torch.nested.nested_tensor(parts, layout=layout)
    with pytest.raises(ValueError, match=r"args\[0\].*split="):
        dbo.overlap(lambda t: t, merge=list, timeout_s=30)(tensor)


def test_a_nested_tensor_reaches_a_custom_split() -> None:
    """The batch size of a nested tensor is its number of components (size(0)); its
    `shape` raises for a strided nested tensor, and that failed before `split=` ran."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor = torch.nested.nested_tensor([torch.ones(2), torch.ones(3), torch.ones(1)])

    def split(args: tuple, kwargs: dict, num_ubatches: int) -> list:
        components = args[0].unbind()
        return [((list(components[i::num_ubatches]),), {}) for i in range(num_ubatches)]

    sizes = dbo.overlap(lambda parts: len(parts), split=split, merge=list, timeout_s=30)(tensor)
    assert sizes == [2, 1]


def test_default_split_matches_tensor_split_and_shares_memory() -> None:
    x = torch.arange(14.0).reshape(7, 2)
    parts = dbo.default_split((x, 3), {"y": x[:, 0]}, 3)
    for (args, kwargs), expected in zip(parts, torch.tensor_split(x, 3)):
        assert torch.equal(args[0], expected) and args[1] == 3
        assert torch.equal(kwargs["y"], expected[:, 0])
        assert args[0].data_ptr() == expected.data_ptr()  # views, not copies


def test_the_leaf_type_cache_is_bounded_and_does_not_change_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbo import _pytree

    monkeypatch.setattr(_pytree, "_leaf_types", {})
    monkeypatch.setattr(_pytree, "_MAX_LEAF_TYPES", 3)
    leaf_types = [type(f"Leaf{i}", (), {}) for i in range(5)]
    for _ in range(2):  # the second pass answers from the cache where it can
        for leaf_type in leaf_types:
            assert _pytree.children(leaf_type()) is None
        assert _pytree.children(torch.zeros(2)) is None
        assert _pytree.children((1, 2))[0] == "tuple"
        assert _pytree.children(collections.OrderedDict(a=1))[0] == "dict"
    assert len(_pytree._leaf_types) == 3


def test_the_leaf_type_cache_does_not_keep_local_classes_or_their_closures_alive() -> None:
    import gc
    import weakref

    def make() -> tuple[object, weakref.ref[torch.Tensor]]:
        big = torch.zeros(1000)

        class Handle:  # a leaf: its methods close over `big`
            def get(self) -> torch.Tensor:
                return big

        return Handle(), weakref.ref(big)

    handle, big_ref = make()
    dbo.overlap(lambda x, h: x, timeout_s=30)(torch.zeros(4), handle)
    del handle
    gc.collect()
    assert big_ref() is None


def test_the_dataclass_caches_do_not_keep_local_classes_or_their_closures_alive() -> None:
    import dataclasses
    import gc
    import weakref

    def make() -> tuple[object, weakref.ref[torch.Tensor]]:
        big = torch.zeros(1000)

        @dataclasses.dataclass
        class Batch:  # split as a container: its fields are read and cached per class
            x: torch.Tensor
            n: int = dataclasses.field(init=False, default=0)

            def __post_init__(self) -> None:
                self.n = int(self.x.shape[0]) + 0 * int(big.numel())

        return Batch(torch.ones(4, 2)), weakref.ref(big)

    batch, big_ref = make()
    out = dbo.overlap(lambda b: b.x * b.n, timeout_s=30)(batch)
    assert torch.equal(out, torch.full((4, 2), 2.0))  # n derived per ubatch: 2 rows each
    del batch
    gc.collect()
    assert big_ref() is None


def test_tensor_only_calls_split_and_merge_like_the_general_path() -> None:
    """Arguments that are all tensors, and one tensor per ubatch out, skip the tree walk;
    the results and errors must be those of the general path (here: inside a list)."""
    x, y = torch.arange(14.0).reshape(7, 2), torch.arange(7)
    fast = dbo.default_split((x, y), {}, 3)
    general = dbo.default_split(([x, y],), {}, 3)
    for (fast_args, fast_kwargs), (general_args, _) in zip(fast, general):
        assert fast_kwargs == {}
        assert all(torch.equal(a, b) for a, b in zip(fast_args, general_args[0]))
        assert fast_args[0].data_ptr() == general_args[0][0].data_ptr()
    with pytest.raises(ValueError, match=r"args\[0\]: 7, args\[1\]: 6"):
        dbo.default_split((x, y[:6]), {}, 2)

    parts = [part[0][0] for part in fast]
    assert torch.equal(dbo.default_merge(parts), x)
    assert torch.equal(dbo.default_merge([[part] for part in parts])[0], x)
    with pytest.raises(ValueError, match="same tensor object"):
        dbo.default_merge([x, x])
    with pytest.raises(ValueError, match="0-dim"):
        dbo.default_merge([x.sum(), x.sum()])
    empty = torch.zeros(0, 2)  # the same zero-row tensor from every ubatch merges
    assert dbo.default_merge([empty, empty]).shape == (0, 2)


def test_a_tuple_subclass_is_split_and_merged_as_its_own_type() -> None:
    class Pair(tuple):  # type: ignore[type-arg]
        def __new__(cls, first: torch.Tensor, second: torch.Tensor) -> Pair:
            return super().__new__(cls, (first, second))

    seen: list[tuple[int, int]] = []

    def fn(pair: Pair) -> Pair:
        seen.append((int(pair[0].shape[0]), int(pair[1].shape[0])))
        return Pair(pair[0] + 1, pair[1] * 2)

    x, y = torch.arange(4.0), torch.arange(8.0).reshape(4, 2)
    pair = Pair(x, y)
    pair.note = "kept"  # type: ignore[attr-defined]
    out = dbo.overlap(fn, timeout_s=30)(pair)
    assert seen == [(2, 2), (2, 2)]  # split, not passed whole to every ubatch
    assert type(out) is Pair and torch.equal(out[0], x + 1) and torch.equal(out[1], y * 2)
    first_args, _ = dbo.default_split((pair,), {}, 2)[0]
    assert type(first_args[0]) is Pair
    assert first_args[0].note == "kept"  # type: ignore[attr-defined]
    size = torch.Size([3, 2])  # a shape stays a leaf
    assert dbo.default_split((torch.zeros(4), size), {}, 2)[1][0][1] is size


def test_fields_derived_in_a_base_or_helper_post_init_are_derived_again_per_ubatch() -> None:
    import dataclasses

    from dbo import _pytree

    @dataclasses.dataclass
    class Base:
        tokens: torch.Tensor
        num_tokens: int = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.num_tokens = int(self.tokens.shape[0])

    @dataclasses.dataclass
    class Child(Base):  # derives num_tokens through super()
        scale: float = 1.0

        def __post_init__(self) -> None:
            super().__post_init__()

    @dataclasses.dataclass
    class Helper:  # derives it in a method __post_init__ calls
        tokens: torch.Tensor
        num_tokens: int = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self._count()

        def _count(self) -> None:
            self.num_tokens = int(self.tokens.shape[0])

    @dataclasses.dataclass
    class Counts:
        tokens: torch.Tensor
        num_seen: int = dataclasses.field(init=False, default=0)

        def __post_init__(self) -> None:
            self.num_seen = 1

    @dataclasses.dataclass
    class Overrides(Counts):  # its own __post_init__ does not call the base's
        def __post_init__(self) -> None:
            pass

    for cls in (Base, Child, Helper):
        seen: list[tuple[int, int]] = []

        def fn(batch: object, seen: list[tuple[int, int]] = seen) -> torch.Tensor:
            seen.append((int(batch.tokens.shape[0]), batch.num_tokens))
            return batch.tokens * 1

        dbo.overlap(fn, timeout_s=30)(cls(torch.arange(6.0)))
        assert seen == [(3, 3), (3, 3)], cls.__name__
    @dataclasses.dataclass
    class Movable:  # __post_init__ calls a tensor's to(), not the class's own to()
        tokens: torch.Tensor
        positions: Any = dataclasses.field(init=False, default=None)

        def __post_init__(self) -> None:
            self.tokens = self.tokens.to(torch.float32)

        def to(self, device: str) -> None:
            self.positions = self.positions.to(device)

    batch = Movable(torch.arange(6))
    batch.positions = torch.arange(6) * 10  # data, filled in after construction
    seen_positions: list[list[int]] = []
    dbo.overlap(lambda b: seen_positions.append(b.positions.tolist()) or b.tokens, timeout_s=30)(
        batch
    )
    assert seen_positions == [[0, 10, 20], [30, 40, 50]]
    # A field only an overridden (never called) base __post_init__ names stays data.
    assert _pytree._derived_by_post_init(Overrides) is None  # None: every field exposed
    assert _pytree._derived_by_post_init(Counts) == frozenset({"tokens"})


def _count_rows(batch: Any) -> None:
    """A module-level helper that a dataclass's __post_init__ derives a field with."""
    batch.num_rows = int(batch.x.shape[0])


def test_a_field_derived_by_a_module_level_helper_is_derived_again_both_ways() -> None:
    """Only code run on self or super() was followed: a field set by `_count_rows(self)`
    was taken for data, so each ubatch saw the whole batch's count, and the merged output
    kept one ubatch's (found in review)."""
    import dataclasses

    @dataclasses.dataclass
    class Rows:
        x: torch.Tensor
        num_rows: int = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            _count_rows(self)

    seen: list[tuple[int, int]] = []

    def fn(batch: Rows) -> torch.Tensor:
        seen.append((int(batch.x.shape[0]), batch.num_rows))
        return batch.x * 2

    dbo.overlap(fn, timeout_s=30)(Rows(torch.ones(6, 2)))
    assert seen == [(3, 3), (3, 3)]
    merged = dbo.overlap(lambda x: Rows(x * 2), timeout_s=30)(torch.ones(6, 2))
    assert merged.num_rows == 6


def test_the_ubatch_count_is_capped_alike_everywhere() -> None:
    """A typo such as 2**31 must fail at once, not build that many threads or slots."""
    from dbo._checks import MAX_NUM_UBATCHES, check_num_ubatches

    assert check_num_ubatches(MAX_NUM_UBATCHES) == MAX_NUM_UBATCHES
    too_many = MAX_NUM_UBATCHES + 1
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.UBatchRunner(too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.overlap(lambda x: x, num_ubatches=too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.balanced_token_split([1] * 4, too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.default_split((torch.zeros(4),), {}, too_many)
