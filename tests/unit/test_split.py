"""balanced_token_split, and the default split and merge on torch.utils._pytree containers."""

from __future__ import annotations

import collections
import dataclasses
import random
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils import _pytree as pytree

import dbo

TIMEOUT_S = 30.0


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
def test_a_tensor_the_default_split_cannot_cut_raises_rather_than_split_wrongly(
    kind: str,
) -> None:
    """Sparse and nested tensors are unsupported by the default split: torch refuses them."""
    parts = [torch.ones(2), torch.ones(3), torch.ones(1), torch.ones(4)]
    if kind == "sparse":
        tensor = torch.eye(4).to_sparse()
    else:
        layout = torch.strided if kind == "nested-strided" else torch.jagged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype feature
            tensor = torch.nested.nested_tensor(parts, layout=layout)
    with pytest.raises((RuntimeError, NotImplementedError)):
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


def test_a_leaf_argument_and_what_it_holds_are_not_kept_alive_after_the_call() -> None:
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


def test_the_ubatch_count_is_capped_alike_everywhere() -> None:
    """A typo such as 2**31 must fail at once, not build that many threads or slots."""
    assert dbo.check_num_ubatches(dbo.MAX_NUM_UBATCHES) == dbo.MAX_NUM_UBATCHES
    too_many = dbo.MAX_NUM_UBATCHES + 1
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.UBatchRunner(too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.overlap(lambda x: x, num_ubatches=too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.balanced_token_split([1] * 4, too_many)
    with pytest.raises(ValueError, match="num_ubatches"):
        dbo.default_split((torch.zeros(4),), {}, too_many)


# ---------------------------------------------------------------- containers
class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


@dataclasses.dataclass
class Registered:
    tokens: torch.Tensor
    scale: float
    num_rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.num_rows = int(self.tokens.shape[0])  # derived: the constructor runs per part


pytree.register_dataclass(Registered)


@dataclasses.dataclass
class Unregistered:
    tokens: torch.Tensor


def _round_trip(make: Any) -> tuple[Any, Any]:
    """`make(x)` split into 2 parts, `make` applied to each part, and those merged."""
    x = torch.arange(12.0).reshape(6, 2)
    parts = dbo.default_split((make(x),), {}, 2)
    merged = dbo.default_merge([make(x_part) for x_part in torch.tensor_split(x, 2)])
    return [args[0] for args, _ in parts], merged


@pytest.mark.parametrize(
    "make",
    [
        lambda x: Pair(x, "t"),
        lambda x: collections.OrderedDict(b=x, a=[x, 3]),
        lambda x: collections.defaultdict(list, {"h": x}),
        lambda x: collections.deque([x, x + 1]),
        lambda x: x.max(dim=1),  # torch.return_types.max
        lambda x: {"nested": (x, {"mask": x > 2})},
    ],
    ids=["namedtuple", "OrderedDict", "defaultdict", "deque", "return_types", "dict"],
)
def test_torch_pytree_containers_split_and_merge_as_their_own_type(make: Any) -> None:
    x = torch.arange(12.0).reshape(6, 2)
    whole = make(x)
    parts, merged = _round_trip(make)
    leaves, spec = pytree.tree_flatten(whole)
    for part, rows in zip(parts, torch.tensor_split(x, 2)):
        assert type(part) is type(whole) and pytree.tree_structure(part) == spec
        assert all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(pytree.tree_leaves(part), pytree.tree_leaves(make(rows)))
        )
    assert type(merged) is type(whole) and pytree.tree_structure(merged) == spec
    for got, expected in zip(pytree.tree_leaves(merged), leaves):
        assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected
    if isinstance(whole, collections.defaultdict):
        assert merged.default_factory is list


def test_a_registered_dataclass_is_split_and_merged_through_its_constructor() -> None:
    seen: list[tuple[int, int, float]] = []

    def fn(batch: Registered) -> Registered:
        seen.append((int(batch.tokens.shape[0]), batch.num_rows, batch.scale))
        return Registered(batch.tokens * batch.scale, batch.scale)

    tokens = torch.arange(10.0).reshape(5, 2)
    out = dbo.overlap(fn, timeout_s=TIMEOUT_S)(Registered(tokens, 3.0))
    assert seen == [(3, 3, 3.0), (2, 2, 3.0)]  # num_rows derived again for each part
    assert type(out) is Registered and torch.equal(out.tokens, tokens * 3.0)
    assert out.num_rows == 5 and out.scale == 3.0


def test_an_unregistered_dataclass_holding_a_batch_tensor_is_refused_with_the_fix() -> None:
    step = dbo.overlap(lambda batch: batch.tokens, timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match=r"args\[0\].*register_dataclass\(Unregistered\)"):
        step(Unregistered(torch.zeros(4, 2)))
    with pytest.raises(ValueError, match=r"kwargs\['extra'\]\[1\].*split="):
        dbo.default_split((torch.zeros(4),), {"extra": [1, Unregistered(torch.zeros(4))]}, 2)
    with pytest.raises(ValueError, match=r"cannot merge output\[1\].*register_dataclass"):
        dbo.default_merge([(x, Unregistered(x)) for x in torch.zeros(4, 1).tensor_split(2)])


def test_other_unregistered_containers_holding_batch_tensors_are_refused() -> None:
    class Encoding(collections.UserDict):
        pass

    class Rows(tuple):
        pass

    for value in (Encoding(ids=torch.zeros(4)), Rows([torch.zeros(4)])):
        with pytest.raises(ValueError, match=r"args\[1\].*register_pytree_node"):
            dbo.default_split((torch.zeros(4), value), {}, 2)
    # A custom split is trusted with them.
    split = dbo.overlap(
        lambda x, enc: x * 1,
        split=lambda args, kwargs, n: [((x, args[1]), {}) for x in args[0].tensor_split(n)],
        timeout_s=TIMEOUT_S,
    )
    assert split(torch.ones(4), Encoding(ids=torch.zeros(4))).shape == (4,)


def test_leaves_without_batch_tensors_reach_every_ubatch_as_the_same_object() -> None:
    @dataclasses.dataclass
    class Config:
        name: str
        weight: torch.Tensor  # 0-dim: not split

    config, size = Config("c", torch.tensor(2.0)), torch.Size([3, 2])
    stats: dict[str, list[int]] = {"calls": []}
    parts = dbo.default_split((torch.zeros(4), config, size), {"stats": stats}, 2)
    for args, kwargs in parts:
        assert args[1] is config and args[2] is size and kwargs["stats"] is stats

    def fn(x: torch.Tensor, stats: dict[str, list[int]]) -> torch.Tensor:
        stats["calls"].append(dbo.current_ubatch_id())  # reaches the caller's dict
        return x

    dbo.overlap(fn, timeout_s=TIMEOUT_S)(torch.zeros(4), stats=stats)
    assert sorted(stats["calls"]) == [0, 1]


def test_a_nested_container_without_batch_tensors_stays_the_same_object() -> None:
    state: dict[str, list[int]] = {"seen": []}
    batch = {"x": torch.zeros(4, 2), "state": state, "pairs": [(1, "a")]}
    parts = dbo.default_split((batch,), {}, 2)
    for (part,), _ in parts:
        assert part["state"] is state and part["pairs"] is batch["pairs"]
        assert part["x"].shape == (2, 2)

    def fn(batch: dict[str, Any]) -> torch.Tensor:
        batch["state"]["seen"].append(batch["x"].shape[0])  # reaches the caller's dict
        return batch["x"]

    dbo.overlap(fn, timeout_s=TIMEOUT_S)(batch)
    assert state["seen"] == [2, 2]


def test_a_torch_size_is_one_leaf_merged_when_equal_and_named_when_not() -> None:
    out = dbo.overlap(lambda x: (x, x.shape[1:]), timeout_s=TIMEOUT_S)(torch.zeros(4, 3))
    assert out[1] == torch.Size([3]) and type(out[1]) is torch.Size
    with pytest.raises(ValueError, match=r"output\[1\]: the ubatches returned different"):
        dbo.overlap(lambda x: (x, x.shape), timeout_s=TIMEOUT_S)(torch.zeros(5, 3))


def test_error_paths_name_arguments_keys_indices_and_fields() -> None:
    batch = {"ids": torch.zeros(4), "extra": [torch.zeros(4), Pair(torch.zeros(3), "t")]}
    with pytest.raises(ValueError) as raised:
        dbo.default_split((torch.zeros(4),), {"batch": batch}, 2)
    message = str(raised.value)
    assert "args[0]: 4" in message and "kwargs['batch']['ids']: 4" in message
    assert "kwargs['batch']['extra'][1].x: 3" in message

    def fn(x: torch.Tensor) -> dict[str, Any]:
        return {"logits": x, "aux": Pair(x, f"ubatch {dbo.current_ubatch_id()}")}

    with pytest.raises(ValueError, match=r"cannot merge output\['aux'\]\.tag: .*different"):
        dbo.overlap(fn, timeout_s=TIMEOUT_S)(torch.zeros(4))


def test_transformers_model_outputs_split_and_merge() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    output_type = modeling_outputs.MoeModelOutputWithPast

    def fn(hidden: torch.Tensor) -> Any:
        return output_type(last_hidden_state=hidden * 2, router_logits=(hidden[:, :1],))

    hidden = torch.arange(12.0).reshape(6, 2)
    out = dbo.overlap(fn, timeout_s=TIMEOUT_S)(hidden)
    assert type(out) is output_type
    assert torch.equal(out.last_hidden_state, hidden * 2)
    assert torch.equal(out["last_hidden_state"], hidden * 2)  # item and attribute agree
    assert torch.equal(out.router_logits[0], hidden[:, :1])
    (part, _), _ = dbo.default_split((out,), {}, 2)
    assert type(part[0]) is output_type and part[0].last_hidden_state.shape == (3, 2)


def test_a_loss_stops_the_merge_and_caches_made_in_the_ubatches_are_joined_by_rows() -> None:
    cache_utils = pytest.importorskip("transformers.cache_utils")
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"output\['loss'\]: .*weight each ubatch's by its rows"):
        dbo.default_merge([{"loss": logits.sum(), "logits": logits}] * 2)
    keys = torch.randn(5, 2, 3, 4)
    caches = []
    for rows in keys.tensor_split(2):
        cache = cache_utils.DynamicCache()
        cache.update(rows, -rows, 0)
        caches.append({"cache": cache})
    joined = dbo.default_merge(caches)["cache"]
    assert type(joined) is cache_utils.DynamicCache and joined.get_seq_length() == 3
    assert torch.equal(joined.layers[0].keys, keys) and torch.equal(joined.layers[0].values, -keys)


def test_sliding_window_caches_made_in_the_ubatches_are_joined_by_rows_with_their_length() -> None:
    cache_utils = pytest.importorskip("transformers.cache_utils")
    keys = torch.randn(5, 2, 3, 4)

    def window_cache(rows: torch.Tensor) -> object:
        cache = cache_utils.DynamicCache()
        cache.layers = [cache_utils.DynamicSlidingWindowLayer(sliding_window=2)]
        cache.update(rows, -rows, 0)
        return cache

    joined = dbo.default_merge([{"cache": window_cache(rows)} for rows in keys.tensor_split(2)])
    layer = joined["cache"].layers[0]
    assert type(layer) is cache_utils.DynamicSlidingWindowLayer and layer.sliding_window == 2
    assert layer.get_seq_length() == 3  # tokens seen; the window keeps the last one
    assert torch.equal(layer.keys, keys[:, :, -1:]) and torch.equal(layer.values, -keys[:, :, -1:])
    uneven = [window_cache(keys[:2]), window_cache(keys[2:, :, :2])]
    with pytest.raises(RuntimeError, match=r"different numbers of tokens .*\[3, 2\]"):
        dbo.default_merge(uneven)
