"""The split rule for `transformers`' KV caches: each ubatch works on its own rows of the
cache the caller holds, and that cache stays a true cache of every row after each call.
Each ubatch's cache holds one view per layer (`dbo.hf.dynamic`, `dbo.hf.attention`,
`dbo.hf.linear_attention`):

- `StaticCache` (preallocated `[B, H, max_len, D]` per layer): views of the ubatch's
  rows, so its writes land in place, at the caller's layer's length; when the call ends
  that length advances by the tokens written (in place: a captured graph replays it).
  Nothing is copied. Sliding-window layers run the layer's own update on views of their
  rows (in place too: once full, the window rolls); not in `capture_graph`.
- `DynamicCache` (grows by one `torch.cat` of the whole layer per call in `transformers`):
  each layer's keys and values live in a `[B, H, capacity, D]` buffer with room to grow;
  the caller's layer holds a view of the filled part, each ubatch a view of its rows, and
  a call writes only its new tokens. Sliding-window layers (remade by `torch.cat` every
  call in `transformers`): each ubatch runs the layer's own update on views of its rows,
  and the call's end joins the windows (one more copy of the window per call). Not in
  `capture_graph`: its lengths live in Python, which a replay does not run.
- Linear-attention (Mamba) layers, in either: views of the rows of their conv and
  recurrent states, written in place; layers holding keys and states both combine the
  two ways. Layers that hold nothing are shared. Indexed layers (sparse attention:
  DeepSeek-V3.2 and kin) keep their keys and values as a full-attention layer of their
  cache kind does, and indexer keys beside them.

The caller's cache is brought up to date as the last ubatch returns (`_Call`), whether
or not the function returns the cache. A call that fails leaves it as before, except
where it wrote in place over what it cannot restore (a full window, linear-attention
states): such a cache is refused afterwards. DeepSeek-V4's layers and MiniMax's cache
class, their own, are split too (`dbo.hf.model_caches`). Caches of other kinds, layers of other
kinds (quantized, another model's own) and offloading are refused, named. Caches that the
ubatches create themselves (a forward called without one, `use_cache=True`) are joined
once along the batch. This module imports `transformers`: `dbo` imports it only once
`transformers` is (a cache is met, or `dbo.hf` is used).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionLayer,
    StaticCache,
    StaticIndexedLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from dbo.hf.attention import (
    IndexedRows,
    StaticIndexedRows,
    StaticRows,
    StaticWindowRows,
    WindowRows,
)
from dbo.hf.dynamic import Growing, GrowingRows, NewLayer, growing_state
from dbo.hf.joins import joined
from dbo.hf.linear_attention import (
    HybridRows,
    SlidingHybridRows,
    StateRows,
    StaticHybridRows,
    StaticSlidingHybridRows,
)
from dbo.hf.model_caches import cache_state, join_cache_state, model_rows, split_cache_state
from dbo.hf.versions import check_transformers
from dbo.split import rules
from dbo.ubatch import at_ubatch_exit, capturing, run_state, wait_for_every_ubatch

ROWS: dict[Any, dict[Any, Any]] = {
    DynamicCache: {
        DynamicLayer: GrowingRows, DynamicSlidingWindowLayer: WindowRows,
        DynamicIndexedLayer: IndexedRows, LinearAttentionLayer: StateRows,
        LinearAttentionAndFullAttentionLayer: HybridRows,
        LinearAttentionAndSlidingWindowAttentionLayer: SlidingHybridRows,
    },
    StaticCache: {
        StaticLayer: StaticRows, StaticSlidingWindowLayer: StaticWindowRows,
        StaticIndexedLayer: StaticIndexedRows, LinearAttentionLayer: StateRows,
        LinearAttentionAndStaticFullAttentionLayer: StaticHybridRows,
        LinearAttentionAndStaticSlidingWindowAttentionLayer: StaticSlidingHybridRows,
    },
}
"""For each cache class, the class of a ubatch's rows of each kind of layer it splits
(a `DummyLayer`, which holds nothing, is shared). Each takes (the caller's layer, its
shared buffers or None, the call, the ubatch, its first and last row, the batch size)
and has `end_call(caller's layer, the ubatches' layers)`, run when the call ends."""

_REGISTERED = False


def register() -> None:
    """Register the rule for `transformers.cache_utils.Cache` (once)."""
    global _REGISTERED
    if not _REGISTERED:
        rules.register_split_rule(Cache, split=split_cache, merge=merge_caches)
        _REGISTERED = True


def split_cache(cache: Any, rows: list[int]) -> list[Any]:
    """One cache per ubatch: views of its rows of `cache`."""
    check_transformers()
    _check_supported(cache)
    batch_size = sum(rows)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    bounds = [(start, start + count) for start, count in zip(starts, rows)]
    call = _Call(cache, len(rows))
    kinds = _kinds(cache)
    if isinstance(cache, DynamicCache):
        call.growing = growing_state(cache, batch_size, len(rows))
    shared = call.growing.layers if call.growing is not None else [None] * len(cache.layers)
    for ubatch, (start, stop) in enumerate(bounds):
        child = _child(cache, call, [
            layer if type(layer) is DummyLayer  # holds nothing: shared
            else _rows_class(kinds, layer)(layer, buffers, call, ubatch, start, stop, batch_size)
            for layer, buffers in zip(cache.layers, shared)
        ])
        if cache.layer_class_to_replicate is not None:  # layers made at the first update
            child.layer_class_to_replicate = NewLayer(call, child, ubatch, start, stop)
        if cache_state(cache) is not None:
            split_cache_state(child, cache, slice(start, stop), batch_size,
                              functools.partial(call.enter, ubatch))
        call.children.append(child)
    return call.children


def merge_caches(parts: list[Any]) -> Any:
    """The caller's cache when `parts` are its ubatches' caches (brought up to date as the
    last ubatch returned); caches the ubatches made themselves joined along the batch."""
    call = getattr(parts[0], "_dbo_call", None)
    if call is not None and all(getattr(part, "_dbo_call", None) is call for part in parts):
        return call.whole
    return joined(parts)


class _Call:
    """One overlapped call's use of one cache. Each ubatch registers at its first write,
    and when the last of them returns (in its thread, before the caller's stream joins
    the ubatches') the caller's cache is brought up to date: its lengths, and a
    DynamicCache's views. So it holds every row after the call whether or not the
    function returns the cache; after a failed call it is as before."""

    def __init__(self, whole: Any, num_ubatches: int) -> None:
        self.whole = whole
        self.entered = [False] * num_ubatches
        self.returned = 0
        self.children: list[Any] = []
        self.growing: Growing | None = None
        self.marks: dict[Any, Any] = {}
        """Per caller's layer (and part of it) one ubatch made for every row in this run,
        the mark on its stream after the zero fill, which the others follow."""
        self._run: dict[str, Any] | None = None
        """The run the counts are of: the same parts can run again (`capture_graph`
        splits once, then runs them for its warmup and its capture)."""

    def enter(self, ubatch: int) -> None:
        """Count ubatch `ubatch` in at its first write in a run (every row class calls
        this before it touches the caller's layer)."""
        if self.growing is not None and capturing():
            raise ValueError(
                "a transformers DynamicCache cannot be in a dbo.capture_graph: its lengths and "
                "views are kept in Python, which a replay does not run, so every replay would "
                "write its token at the same position; pass a StaticCache "
                "(cache_implementation='static') to a captured decode step"
            )
        state = run_state()
        if state is not self._run:  # another run of the same parts: count afresh
            self._run, self.entered, self.returned = state, [False] * len(self.entered), 0
            self.marks = {}
        if not self.entered[ubatch]:
            self.entered[ubatch] = True
            at_ubatch_exit(self._returned)  # outside an overlap (a part used alone): never

    def _returned(self) -> None:
        self.returned += 1
        if self.returned == len(self.entered):
            self._finish()

    def _finish(self) -> None:
        wait_for_every_ubatch()  # their writes are queued on their own streams
        self._bring_up_to_date()

    def _bring_up_to_date(self) -> None:
        whole = self.whole
        if self.growing is not None:
            while len(whole.layers) < len(self.growing.layers):
                whole.layers.append(whole.layer_class_to_replicate())
        for index, layer in enumerate(whole.layers):
            parts = [child.layers[index] for child in self.children]
            end_call = getattr(type(parts[0]), "end_call", None)  # none: a DummyLayer
            if end_call is not None:
                end_call(layer, parts)
        if cache_state(whole) is not None:
            join_cache_state(whole, self.children)
        whole._dbo_overwritten = False  # the call ended: windows and states are right


def _kinds(cache: Any) -> dict[Any, Any]:
    """`ROWS` of `cache`'s class; a model's own DynamicCache class (`dbo.hf.model_caches`) has
    a DynamicCache's ({} for any other class)."""
    if type(cache) in ROWS:
        return ROWS[type(cache)]
    return ROWS[DynamicCache] if cache_state(cache) is not None else {}


def _rows_class(kinds: dict[Any, Any], layer: Any) -> Any:
    """The class of a ubatch's rows of `layer` (None: dbo does not split it)."""
    found = kinds.get(type(layer))
    if found is None and kinds is ROWS[DynamicCache]:
        found = model_rows(type(layer))
    return found


def _check_supported(cache: Any) -> None:
    kinds = _kinds(cache)
    odd = [type(layer).__name__ for layer in cache.layers
           if type(layer) is not DummyLayer and _rows_class(kinds, layer) is None]
    odd += [f"{type(layer).__name__} (recording past states)" for layer in cache.layers
            if isinstance(layer, LinearAttentionLayer) and layer.record_past]
    odd += [f"{type(layer).__name__} (with indexer positions)" for layer in cache.layers
            if getattr(layer, "indexer_position_ids", None) is not None]
    lazy = cache.layer_class_to_replicate
    if not kinds or odd or getattr(cache, "offloading", False) or (
        lazy not in (None, DynamicLayer)
    ):
        what = f"a {type(cache).__name__}"
        if odd:
            what += f" with {', '.join(sorted(set(odd)))} layers"
        elif getattr(cache, "offloading", False):
            what += " that offloads"
        raise ValueError(
            f"dbo.overlap cannot split {what} by rows (it splits transformers' DynamicCache "
            "and StaticCache of full-attention, sliding-window and linear-attention layers); "
            "pass "
            "use_cache=False (or cache_implementation='dynamic'), or register a rule for it "
            "with dbo.register_split_rule"
        )
    if getattr(cache, "_dbo_overwritten", False):
        raise ValueError(
            f"this {type(cache).__name__}'s sliding windows or linear-attention states were "
            "written in place by an overlapped call that failed, so they no longer match its "
            "tokens; start a new cache (a new generate does)"
        )


def _child(cache: Any, call: _Call, layers: list[Any]) -> Any:
    """A shallow copy of `cache` with other layers, knowing the call it is part of."""
    child = copy.copy(cache)
    child.layers = layers
    child._dbo_call = call
    return child
