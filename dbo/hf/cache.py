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

The caller's cache is brought up to date as the last ubatch returns (`Call`), whether
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

from transformers import cache_utils as hf

from dbo.hf import attention, linear_attention, model_caches
from dbo.hf.dynamic import Growing, GrowingRows, NewLayer, growing_state
from dbo.hf.joins import joined
from dbo.hf.model_caches import ModelRows, cache_state, join_cache_state, split_cache_state
from dbo.hf.refusals import check_splittable, refuse_in_capture
from dbo.hf.rows import Rows, same
from dbo.hf.versions import check_transformers
from dbo.split import rules
from dbo.ubatch import at_ubatch_exit, capturing, run_state, wait_for_every_ubatch

ROWS: dict[Any, dict[Any, type[Rows]]] = {
    hf.DynamicCache: {
        hf.DynamicLayer: GrowingRows, hf.DynamicSlidingWindowLayer: attention.WindowRows,
        hf.DynamicIndexedLayer: attention.IndexedRows,
        hf.LinearAttentionLayer: linear_attention.StateRows,
        hf.LinearAttentionAndFullAttentionLayer: linear_attention.HybridRows,
        hf.LinearAttentionAndSlidingWindowAttentionLayer: linear_attention.SlidingHybridRows,
        **dict.fromkeys(model_caches.MODEL_LAYERS, ModelRows),  # by (module, name)
    },
    hf.StaticCache: {
        hf.StaticLayer: attention.StaticRows,
        hf.StaticSlidingWindowLayer: attention.StaticWindowRows,
        hf.StaticIndexedLayer: attention.StaticIndexedRows,
        hf.LinearAttentionLayer: linear_attention.StateRows,
        hf.LinearAttentionAndStaticFullAttentionLayer: linear_attention.StaticHybridRows,
        hf.LinearAttentionAndStaticSlidingWindowAttentionLayer:
            linear_attention.StaticSlidingHybridRows,
    },
}
"""For each cache class, the row class (`dbo.hf.rows.Rows`) of each kind of layer it
splits; a `DummyLayer`, which holds nothing, is shared. A model's own DynamicCache class
(`dbo.hf.model_caches`) has a DynamicCache's."""

_REGISTERED = False


def register() -> None:
    """Register the rule for `transformers.cache_utils.Cache` (once)."""
    global _REGISTERED
    if not _REGISTERED:
        rules.register_split_rule(hf.Cache, split=split_cache, merge=merge_caches)
        _REGISTERED = True


def rows_class(cache: Any, layer: Any) -> type[Rows] | None:
    """The row class of `layer` of `cache` (None: dbo does not split it)."""
    kinds = ROWS.get(type(cache))
    if kinds is None and cache_state(cache) is not None:
        kinds = ROWS[hf.DynamicCache]
    if kinds is None:
        return None
    return kinds.get(type(layer)) or kinds.get(model_caches.class_name(type(layer)))


def split_cache(cache: Any, rows: list[int]) -> list[Any]:
    """One cache per ubatch: views of its rows of `cache`."""
    check_transformers()
    layers = [(layer, rows_class(cache, layer)) for layer in cache.layers]
    check_splittable(cache, type(cache) in ROWS or cache_state(cache) is not None,
                     [type(layer).__name__ for layer, kind in layers
                      if kind is None and type(layer) is not hf.DummyLayer])
    call = Call(cache, rows)
    shared = call.growing.layers if call.growing is not None else [None] * len(layers)
    start = 0
    for ubatch, count in enumerate(rows):
        bounds = slice(start, start + count)
        start += count
        child = copy.copy(cache)
        child.layers = [
            layer if kind is None  # a DummyLayer holds nothing: shared
            else call.add_part(index, ubatch, kind(layer, buffers, call, ubatch, bounds)).layer
            for index, ((layer, kind), buffers) in enumerate(zip(layers, shared))
        ]
        child._dbo_call = call
        if cache.layer_class_to_replicate is not None:  # layers made at the first update
            child.layer_class_to_replicate = NewLayer(call, child, ubatch, bounds)
        if cache_state(cache) is not None:
            split_cache_state(child, cache, bounds, call.batch_size,
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


class Call:
    """One overlapped call's use of one cache. Each ubatch registers at its first write,
    and when the last of them returns (in its thread, before the caller's stream joins
    the ubatches') the caller's cache is brought up to date: its lengths, and a
    DynamicCache's views. So it holds every row after the call whether or not the
    function returns the cache; after a failed call it is as before."""

    def __init__(self, whole: Any, rows: list[int]) -> None:
        self.whole = whole
        self.batch_size = sum(rows)
        self.entered = [False] * len(rows)
        self.returned = 0
        self.children: list[Any] = []
        self.parts: dict[int, list[Any]] = {}
        """Per layer index, each ubatch's rows of it (`Rows`)."""
        self.growing: Growing | None = None
        if isinstance(whole, hf.DynamicCache):
            self.growing = growing_state(whole, self.batch_size, len(rows))
        self.marks: dict[Any, Any] = {}
        """Per caller's layer (and part of it) one ubatch made for every row in this run,
        the mark on its stream after the zero fill, which the others follow."""
        self._run: dict[str, Any] | None = None
        """The run the counts are of: the same parts can run again (`capture_graph`
        splits once, then runs them for its warmup and its capture)."""

    def add_part(self, index: int, ubatch: int, part: Rows) -> Any:
        """Keep `part`, ubatch `ubatch`'s rows of layer `index`; returns it."""
        self.parts.setdefault(index, [None] * len(self.entered))[ubatch] = part
        return part

    def enter(self, ubatch: int) -> None:
        """Count ubatch `ubatch` in at its first write in a run (every row class calls
        this before it touches the caller's layer)."""
        if self.growing is not None and capturing():
            refuse_in_capture("DynamicCache")
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
            wait_for_every_ubatch()  # their writes are queued on their own streams
            self.bring_up_to_date()

    def bring_up_to_date(self) -> None:
        """The caller's cache holds every ubatch's rows (the last ubatch's exit runs it)."""
        whole = self.whole
        same([len(child.layers) for child in self.children], "numbers of cache layers")
        while len(whole.layers) < len(self.children[0].layers):
            whole.layers.append(whole.layer_class_to_replicate())
        for index, layer in enumerate(whole.layers):
            parts = self.parts.get(index)
            if parts is not None:
                type(parts[0]).end_call(layer, parts)
        if cache_state(whole) is not None:
            join_cache_state(whole, self.children)
        whole._dbo_overwritten = False  # the call ended: windows and states are right
