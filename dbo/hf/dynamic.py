"""A DynamicCache kept by rows: per layer, `[B, H, capacity, D]` buffers for keys and
values that the caller's layer and each ubatch's hold views of (`dbo.hf.cache` uses it).

A ubatch's `GrowingRows` layer writes its new tokens at its own length and returns views
of its rows; the caller's layer gets views of the filled part when the call ends. A
buffer grows by half again when full (one copy of the filled part); when the caller's
layer no longer holds the buffer's view, the buffer is made anew from its contents.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
)

from dbo.hf.refusals import check_rows, refuse_grad
from dbo.hf.rows import Rows, same
from dbo.ubatch import wait_for_every_ubatch

KEPT_IN_BUFFERS = (DynamicLayer, DynamicIndexedLayer, LinearAttentionAndFullAttentionLayer)
"""The layers whose keys and values are kept here (the others' are not)."""


class _SharedLayer:
    """One layer's keys and values for every row of a DynamicCache: `[B, H, capacity, D]`
    buffers. The caller's layer holds views of the filled part (`whole_keys` is the keys
    view, or the layer's own keys the buffers were filled from); during a call each ubatch
    appends to its rows from its own length."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.whole_keys: torch.Tensor | None = None
        self.lengths: list[int] = []
        self.bytes_written = 0  # new tokens, and the copies of growth and refill

    @property
    def length(self) -> int:
        """The tokens the caller's layer holds."""
        return 0 if self.whole_keys is None else self.whole_keys.shape[-2]

    def holds(self, layer: Any) -> bool:
        """Whether `layer` holds this buffer's view (nothing changed it since the last call)."""
        if self.whole_keys is None:
            return not layer.is_initialized
        return layer.keys is self.whole_keys

    def refill(self, layer: Any) -> None:
        """Make the buffers anew from `layer`'s contents (one copy)."""
        self.keys = self.values = self.whole_keys = None
        length = layer.get_seq_length() if layer.is_initialized else 0
        if length:
            check_rows("DynamicCache", layer.keys.shape[0], self.batch_size)
            self._allocate(layer.keys, layer.values, length)
            self.keys[:, :, :length].copy_(layer.keys)  # type: ignore[index]
            self.values[:, :, :length].copy_(layer.values)  # type: ignore[index]
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
        refuse_grad(keys, values)
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
        if filled:
            wait_for_every_ubatch()  # the copy reads rows other ubatches write
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
        length = same(self.lengths, "numbers of tokens in one cache layer")
        if not layer.is_initialized:
            layer.lazy_initialization(self.keys, self.values)
        layer.keys = self.keys[:, :, :length]
        layer.values = self.values[:, :, :length]
        self.whole_keys = layer.keys


class Growing:
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


_STATES: weakref.WeakKeyDictionary[Any, Growing] = weakref.WeakKeyDictionary()
"""Each DynamicCache's buffers (they live as long as the cache)."""


def bytes_written(cache: Any) -> int:
    """What dbo wrote into the buffers of a DynamicCache it split (0 for any other cache)."""
    growing = _STATES.get(cache)
    return 0 if growing is None else sum(shared.bytes_written for shared in growing.layers)


def growing_state(cache: Any, batch_size: int, num_ubatches: int) -> Growing:
    """The buffers of `cache`, each layer's made anew where the cache changed since."""
    growing = _STATES.get(cache)
    if growing is None or growing.batch_size != batch_size:
        growing = _STATES[cache] = Growing(batch_size)
    growing.num_ubatches = num_ubatches
    for index, layer in enumerate(cache.layers):
        shared = growing.layer(index)
        if type(layer) in KEPT_IN_BUFFERS and not shared.holds(layer):
            shared.refill(layer)
    for shared in growing.layers:
        shared.start(num_ubatches)
    return growing


class GrowingRows(Rows, DynamicLayer):
    """A ubatch's rows of a `_SharedLayer`, as a DynamicLayer: an update writes the new
    tokens into the shared buffer and returns views of its rows."""

    def __init__(self, whole: Any, shared: _SharedLayer, call: Any, ubatch: int,
                 rows: slice) -> None:
        DynamicLayer.__init__(self)
        Rows.__init__(self, whole, shared, call, ubatch, rows)
        views = shared.view(ubatch, rows)
        if views is not None:
            self.keys, self.values = views
            self.device, self.is_initialized = self.keys.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.enter()
        self.keys, self.values = self.shared.append(self.ubatch, self.rows, key_states,
                                                    value_states)
        self.device, self.is_initialized = key_states.device, True
        return self.keys, self.values

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: the caller's layer holds views of the filled part."""
        parts[0].shared.finish(whole)


class NewLayer:
    """A ubatch cache's `layer_class_to_replicate`: its next layer, on the shared buffers."""

    def __init__(self, call: Any, child: Any, ubatch: int, rows: slice) -> None:
        self.call, self.child, self.ubatch, self.rows = call, child, ubatch, rows

    def __call__(self) -> GrowingRows:
        assert self.call.growing is not None, "a DynamicCache's call"
        index = len(self.child.layers)
        shared = self.call.growing.layer(index)
        return self.call.add_part(index, self.ubatch,
                                  GrowingRows(None, shared, self.call, self.ubatch, self.rows))
