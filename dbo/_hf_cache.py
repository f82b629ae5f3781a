"""The split rule for `transformers`' KV caches: each ubatch works on its own rows of the
cache the caller holds, and that cache stays a true cache of every row after each call.

- `StaticCache` (preallocated `[B, H, max_len, D]` per layer): ubatch i gets views of its
  rows, so its writes land in place, at the caller's layer's length; after the call the
  merge adds the tokens written to that length (in place: a captured graph replays it).
  Nothing is copied.
- `DynamicCache` (grows by one `torch.cat` of the whole layer per call in `transformers`):
  each layer's keys and values live in a `[B, H, capacity, D]` buffer with room to grow;
  the caller's layer holds a view of the filled part, each ubatch a view of its rows, and a
  call writes only its new tokens. A buffer grows by half again when full (one copy).
  When the caller's cache was changed outside an overlap (a `crop`, an inline call), its
  layer no longer holds the buffer's view and the buffer is made anew from its contents.

Caches of other kinds, layers of other kinds (sliding windows, quantized, linear
attention) and offloading are refused with an error naming them. Caches that the
ubatches create themselves (a forward called without one, `use_cache=True`) are joined
once along the batch. This module imports `transformers`: `dbo` imports it only once
`transformers` is (a cache is met, or `dbo.hf` is used).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    StaticCache,
    StaticLayer,
)

from dbo import stateful
from dbo.api import at_ubatch_exit

_REGISTERED = False


def register() -> None:
    """Register the rule for `transformers.cache_utils.Cache` (once)."""
    global _REGISTERED
    if not _REGISTERED:
        stateful.register_split_rule(Cache, split=split_cache, merge=merge_caches)
        _REGISTERED = True


def split_cache(cache: Any, rows: list[int]) -> list[Any]:
    """One cache per ubatch: views of its rows of `cache`."""
    _check_supported(cache)
    batch_size = sum(rows)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    bounds = [(start, start + count) for start, count in zip(starts, rows)]
    call = _Call(cache, len(rows))
    if isinstance(cache, StaticCache):
        call.children = [
            _child(cache, call, [_StaticRows(layer, call, ubatch, start, stop, batch_size)
                                 for layer in cache.layers])
            for ubatch, (start, stop) in enumerate(bounds)
        ]
        return call.children
    call.growing = growing = _growing_state(cache, batch_size, len(rows))
    for ubatch, (start, stop) in enumerate(bounds):
        child = _child(cache, call, [])
        child.layers = [_GrowingRows(shared, call, ubatch, start, stop)
                        for shared in growing.layers]
        if cache.layer_class_to_replicate is not None:  # layers made at the first update
            child.layer_class_to_replicate = _NewLayer(call, child, ubatch, start, stop)
        call.children.append(child)
    return call.children


def merge_caches(parts: list[Any]) -> Any:
    """The caller's cache when `parts` are its ubatches' caches (brought up to date as the
    last ubatch returned); caches the ubatches made themselves joined along the batch."""
    call = getattr(parts[0], "_dbo_call", None)
    if call is not None and all(getattr(part, "_dbo_call", None) is call for part in parts):
        return call.whole
    return _joined(parts)


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
        self.growing: _Growing | None = None

    def enter(self, ubatch: int) -> None:
        if not self.entered[ubatch]:
            self.entered[ubatch] = True
            at_ubatch_exit(self._returned)  # outside an overlap (a part used alone): never

    def _returned(self) -> None:
        self.returned += 1
        if self.returned == len(self.entered):
            self._finish()

    def _finish(self) -> None:
        if self.growing is not None:
            while len(self.whole.layers) < len(self.growing.layers):
                self.whole.layers.append(self.whole.layer_class_to_replicate())
            for layer, shared in zip(self.whole.layers, self.growing.layers):
                shared.finish(layer)
            return
        for index, layer in enumerate(self.whole.layers):
            written = {child.layers[index].written for child in self.children}
            if len(written) != 1:
                raise RuntimeError(
                    f"the ubatches wrote different numbers of tokens into layer {index} of "
                    f"one StaticCache ({sorted(written, key=str)}); each must run the same "
                    "forward on its rows"
                )
            (count,) = written
            if count:
                layer.cumulative_length.add_(count)
            for child in self.children:
                child.layers[index].written = None  # a captured graph's next replay


def _check_supported(cache: Any) -> None:
    supported = {DynamicCache: DynamicLayer, StaticCache: StaticLayer}
    layer_kind = supported.get(type(cache))
    odd = [type(layer).__name__ for layer in cache.layers if type(layer) is not layer_kind]
    lazy = cache.layer_class_to_replicate
    if layer_kind is None or odd or getattr(cache, "offloading", False) or (
        lazy is not None and lazy is not layer_kind
    ):
        what = f"a {type(cache).__name__}"
        if odd:
            what += f" with {', '.join(sorted(set(odd)))} layers"
        elif getattr(cache, "offloading", False):
            what += " that offloads"
        raise ValueError(
            f"dbo.overlap splits a transformers DynamicCache or StaticCache of full-attention "
            f"layers (DynamicLayer, StaticLayer) by rows, but got {what}; pass use_cache=False "
            "(or cache_implementation='dynamic' or 'static'), or register a rule for it with "
            "dbo.register_split_rule"
        )


def _child(cache: Any, call: _Call, layers: list[Any]) -> Any:
    """A shallow copy of `cache` with other layers, knowing the call it is part of."""
    child = copy.copy(cache)
    child.layers = layers
    child._dbo_call = call
    return child


def _check_rows(kind: str, have: int, batch_size: int) -> None:
    if have != batch_size:
        raise ValueError(
            f"the {kind} passed to dbo.overlap holds {have} rows but the batch has "
            f"{batch_size}; pass a cache made for this batch (a new generate starts a new one)"
        )


def _joined(parts: list[Any]) -> Any:
    """Dynamic caches the ubatches made themselves, one cache of every row (one copy)."""
    if not all(type(part) is DynamicCache for part in parts) or len(
        {len(part.layers) for part in parts}
    ) != 1:
        raise ValueError(
            "the ubatches returned transformers caches that are not their parts of one cache "
            f"passed in ({', '.join(type(part).__name__ for part in parts)}), and only "
            "DynamicCaches of the same layers made inside the call can be joined; pass a cache "
            "in, or use_cache=False"
        )
    joined = copy.copy(parts[0])
    joined.layers = []
    for layers in zip(*(part.layers for part in parts)):
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise ValueError(
                "the ubatches returned DynamicCaches with layers other than DynamicLayer "
                f"({', '.join(type(layer).__name__ for layer in layers)}), which dbo cannot "
                "join; pass use_cache=False"
            )
        layer = DynamicLayer()
        if all(part.is_initialized for part in layers):
            layer.lazy_initialization(layers[0].keys, layers[0].values)
            layer.keys = torch.cat([part.keys for part in layers])
            layer.values = torch.cat([part.values for part in layers])
        joined.layers.append(layer)
    return joined


class _StaticRows(StaticLayer):
    """Rows [start, stop) of a whole `StaticLayer`: views of its tensors, so writes land in
    place. Every ubatch writes at the whole layer's length, which it reads and does not
    change; the call's end adds the tokens written once (in place: a graph replays it)."""

    def __init__(
        self, whole: Any, call: _Call, ubatch: int, start: int, stop: int, batch_size: int
    ) -> None:
        self.__dict__.update(whole.__dict__)  # max_cache_len and, once initialized, the rest
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.call, self.ubatch = call, ubatch
        self.written: int | None = None
        if whole.is_initialized:
            _check_rows("StaticCache", whole.keys.shape[0], batch_size)
            self._take_views()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Initialize the whole layer (all rows, on the first write of any ubatch), then
        take this ubatch's views of it."""
        if not self.whole.is_initialized:
            self.whole.lazy_initialization(
                key_states[:1].expand((self.whole_batch, *key_states.shape[1:])),
                value_states[:1].expand((self.whole_batch, *value_states.shape[1:])),
            )
        self._take_views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`StaticLayer.update` on this ubatch's rows, leaving the length to the call's end."""
        self.call.enter(self.ubatch)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None, "views taken at initialization"
        length = key_states.shape[-2]
        positions = torch.arange(length, device=self.device) + self.cumulative_length
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        self.written = length
        return keys, values

    def _take_views(self) -> None:
        whole = self.whole
        for name in ("device", "num_heads", "k_head_dim", "v_head_dim", "cumulative_length"):
            setattr(self, name, getattr(whole, name))
        self.batch_size = self.rows.stop - self.rows.start
        self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]
        self.is_initialized = True


class _SharedLayer:
    """One layer's keys and values for every row of a DynamicCache: `[B, H, capacity, D]`
    buffers. The caller's layer holds `whole_keys`/`whole_values`, views of the filled
    part; during a call each ubatch appends to its rows from its own length."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self.whole_keys: torch.Tensor | None = None
        self.lengths: list[int] = []
        self.bytes_written = 0  # new tokens, and the copies of growth and refill

    def holds(self, layer: Any) -> bool:
        """Whether `layer` holds this buffer's view (nothing changed it since the last call)."""
        if self.whole_keys is None:
            return not layer.is_initialized
        return layer.keys is self.whole_keys

    def refill(self, layer: Any) -> None:
        """Make the buffers anew from `layer`'s contents (one copy)."""
        self.keys = self.values = self.whole_keys = None
        self.length = layer.get_seq_length() if layer.is_initialized else 0
        if self.length:
            _check_rows("DynamicCache", layer.keys.shape[0], self.batch_size)
            self._allocate(layer.keys, layer.values, self.length)
            self.keys[:, :, : self.length].copy_(layer.keys)  # type: ignore[index]
            self.values[:, :, : self.length].copy_(layer.values)  # type: ignore[index]
            self.bytes_written += layer.keys.nbytes + layer.values.nbytes
            self.whole_keys = layer.keys

    def start(self, num_ubatches: int) -> None:
        self.lengths = [self.length] * num_ubatches

    def view(self, ubatch: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.keys is None or self.values is None or self.lengths[ubatch] == 0:
            return None
        end = self.lengths[ubatch]
        return self.keys[rows, :, :end], self.values[rows, :, :end]

    def append(
        self, ubatch: int, rows: slice, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            raise RuntimeError(
                "dbo's split DynamicCache writes each ubatch's keys and values in place, which "
                "autograd cannot follow; run generation under torch.no_grad(), or pass "
                "use_cache=False when training"
            )
        begin = self.lengths[ubatch]
        end = begin + keys.shape[-2]
        if self.keys is None or end > self.keys.shape[2]:
            self._allocate(keys, values, end)
        assert self.keys is not None and self.values is not None, "allocated above"
        self.keys[rows, :, begin:end].copy_(keys)
        self.values[rows, :, begin:end].copy_(values)
        self.bytes_written += keys.nbytes + values.nbytes
        self.lengths[ubatch] = end
        return self.keys[rows, :, :end], self.values[rows, :, :end]

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        """Buffers for `needed` tokens and half as many again (64 at least), keeping what is
        filled: the longest length of any ubatch, or of the caller's layer."""
        capacity = needed + max(needed // 2, 64)
        old = (self.keys, self.values)
        filled = max(self.lengths, default=self.length) if old[0] is not None else 0
        new = []
        for source, buffer in zip((keys, values), old):
            shape = (self.batch_size, source.shape[1], capacity, source.shape[-1])
            grown = torch.empty(shape, dtype=source.dtype, device=source.device)
            if buffer is not None and filled:
                grown[:, :, :filled].copy_(buffer[:, :, :filled])
                self.bytes_written += buffer[:, :, :filled].nbytes
            new.append(grown)
        self.keys, self.values = new

    def finish(self, layer: Any) -> None:
        """After a call: the caller's layer holds views of the filled part."""
        if not self.lengths or self.keys is None or self.values is None:
            return
        if len(set(self.lengths)) != 1:
            raise RuntimeError(
                f"the ubatches wrote different numbers of tokens into one cache layer "
                f"({self.lengths}); each must run the same forward on its rows"
            )
        self.length = self.lengths[0]
        if not layer.is_initialized:
            layer.lazy_initialization(self.keys, self.values)
        layer.keys = self.keys[:, :, : self.length]
        layer.values = self.values[:, :, : self.length]
        self.whole_keys = layer.keys


class _Growing:
    """The buffers of one DynamicCache, one `_SharedLayer` per layer."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.layers: list[_SharedLayer] = []
        self.num_ubatches = 0

    def layer(self, index: int) -> _SharedLayer:
        while len(self.layers) <= index:
            shared = _SharedLayer(self.batch_size)
            shared.start(self.num_ubatches)
            self.layers.append(shared)
        return self.layers[index]


_STATES: weakref.WeakKeyDictionary[Any, _Growing] = weakref.WeakKeyDictionary()
"""Each DynamicCache's buffers (they live as long as the cache)."""


def bytes_written(cache: Any) -> int:
    """What dbo wrote into the buffers of a DynamicCache it split (0 for any other cache)."""
    growing = _STATES.get(cache)
    return 0 if growing is None else sum(shared.bytes_written for shared in growing.layers)


def _growing_state(cache: Any, batch_size: int, num_ubatches: int) -> _Growing:
    """The buffers of `cache`, each layer's made anew where the cache changed since."""
    growing = _STATES.get(cache)
    if growing is None or growing.batch_size != batch_size:
        growing = _STATES[cache] = _Growing(batch_size)
    growing.num_ubatches = num_ubatches
    for index, layer in enumerate(cache.layers):
        shared = growing.layer(index)
        if not shared.holds(layer):
            shared.refill(layer)
    for shared in growing.layers:
        shared.start(num_ubatches)
    return growing


class _GrowingRows(DynamicLayer):
    """Rows [start, stop) of a `_SharedLayer`, as one ubatch's DynamicLayer: an update
    writes the new tokens into the shared buffer and returns views of its rows."""

    def __init__(
        self, shared: _SharedLayer, call: _Call, ubatch: int, start: int, stop: int
    ) -> None:
        super().__init__()
        self.shared, self.call = shared, call
        self.ubatch, self.rows = ubatch, slice(start, stop)
        views = shared.view(ubatch, self.rows)
        if views is not None:
            self.keys, self.values = views
            self.device, self.is_initialized = self.keys.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.call.enter(self.ubatch)
        keys, values = self.shared.append(self.ubatch, self.rows, key_states, value_states)
        self.keys, self.values = keys, values
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values


class _NewLayer:
    """A ubatch cache's `layer_class_to_replicate`: its next layer, on the shared buffers."""

    def __init__(self, call: _Call, child: Any, ubatch: int, start: int, stop: int) -> None:
        self.call, self.child, self.ubatch = call, child, ubatch
        self.start, self.stop = start, stop

    def __call__(self) -> _GrowingRows:
        assert self.call.growing is not None, "a DynamicCache's call"
        shared = self.call.growing.layer(len(self.child.layers))
        return _GrowingRows(shared, self.call, self.ubatch, self.start, self.stop)
