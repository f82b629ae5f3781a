"""Each ubatch's rows of what a model keeps in a DynamicCache of its own making, found by
class name (so `dbo` imports no model):

- Layers of its own (DeepSeek-V4's compressed attention: a sliding window, plus
  compressor buffers and compressed entries kept per row): a copy of the caller's layer
  holds the ubatch's rows of every per-row tensor it keeps, and the layer's own methods
  run on it, making new tensors and leaving the caller's layer untouched; the call's end
  joins the ubatches' tensors into the caller's layer (one copy of each), as
  `WindowRows` does for a plain sliding window.
- A cache class of its own (MiniMax's: a list of per-row linear-attention states, one per
  layer, beside DynamicLayers): each ubatch's cache holds a list of its rows, which the
  model's setter replaces entry by entry; the call's end joins the lists.

The copies are of the model's own classes (the model and `transformers` test their
class), with one method hooked on each copy alone: the first write enters the call.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dbo.hf.attention import all_wrote
from dbo.hf.refusals import check_rows
from dbo.hf.rows import Rows, same

_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
_COMPRESSED = ("keys", "values", "buffer_kv", "buffer_gate", "compressed_kv")
MODEL_LAYERS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    (_DEEPSEEK_V4, "DeepseekV4HCACache"): (_COMPRESSED, ("cumulative_length", "entry_count")),
    (_DEEPSEEK_V4, "DeepseekV4CSACache"): (
        (*_COMPRESSED, "overlap_kv", "overlap_gate"), ("cumulative_length", "entry_count"),
    ),
}
"""Per layer class (module, name): the attributes holding per-row tensors (`[B, ...]`, or
dicts of them), and the counters every ubatch must end a call with the same value of."""

_MINIMAX = "transformers.models.minimax.modeling_minimax"
CACHE_STATES: dict[tuple[str, str], tuple[str, str]] = {
    (_MINIMAX, "MiniMaxCache"): ("linear_cache", "set_linear_cache"),
}
"""Per DynamicCache subclass (module, name): the attribute holding a list of per-row
tensors (`[]` for a layer without one) and the method the model sets an entry with."""

HOOKED = "update"
"""The method hooked on a ubatch's copy of a model's layer (not the model's state)."""


def class_name(kind: type) -> tuple[str, str]:
    """(module, name) of a class: how the tables above know a model's classes."""
    return kind.__module__, kind.__name__


class ModelRows(Rows):
    """A ubatch's rows of a whole layer of a model's own class (listed in `MODEL_LAYERS`):
    `layer`, a copy of it, holds them, from the caller's layer as it is at each run's
    first write (`capture_graph` runs the same parts more than once)."""

    layer: Any = None

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        super().__init__(whole, shared, call, ubatch, rows)
        self.states = MODEL_LAYERS[class_name(type(whole))][0]
        self.layer = copy.copy(whole)
        setattr(self.layer, HOOKED, self.update)  # this copy alone: enters the call first
        self.refresh()

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's own update on this ubatch's rows (the first write of each layer's
        forward: its other methods then work on the same rows)."""
        self.enter()
        self.updated = True
        return type(self.layer).update(self.layer, *args, **kwargs)

    def refresh(self) -> None:
        for name, value in vars(self.whole).items():
            if name in self.states:
                value = self._rows_of(value)
            setattr(self.layer, name, dict(value) if isinstance(value, dict) else value)
        self.updated = False

    def _rows_of(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: self._rows_of(item) for key, item in value.items()}
        if isinstance(value, torch.Tensor) and value.ndim >= 2:  # else empty: no token yet
            check_rows("DynamicCache", value.shape[0], self.whole_batch)
            return value[self.rows]
        return value

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: the ubatches' per-row tensors joined into the caller's layer."""
        if all_wrote(parts, "updated", f"a {type(whole).__name__}"):
            parts[0].shared.bytes_written += join_rows(whole, [part.layer for part in parts])


def join_rows(whole: Any, layers: list[Any]) -> int:
    """`whole` (a layer of a `MODEL_LAYERS` class) holds the rows of `layers`: their states
    joined, the rest as the first's (the counters the same in each); the bytes written."""
    states, agree = MODEL_LAYERS[class_name(type(whole))]
    for name in agree:
        same([getattr(layer, name) for layer in layers], f"{name} in one {type(whole).__name__}")
    joined: dict[tuple[int, ...], Any] = {}  # a tensor two states hold is joined once
    for name, value in vars(layers[0]).items():
        if name == HOOKED:
            continue
        if name in states:
            value = _joined([vars(layer)[name] for layer in layers], joined)
        setattr(whole, name, dict(value) if isinstance(value, dict) else value)  # own dicts
    return sum(tensor.nbytes for tensor in joined.values())


def _joined(values: list[Any], joined: dict[tuple[int, ...], Any]) -> Any:
    """The ubatches' `values` of one state as one of every row (cat along the batch)."""
    if isinstance(values[0], dict):
        return {key: _joined([value[key] for value in values], joined) for key in values[0]}
    if not any(isinstance(value, torch.Tensor) and value.ndim >= 2 for value in values):
        return values[0]  # None, or an empty tensor made before any token
    key = tuple(id(value) for value in values)
    if key not in joined:
        joined[key] = torch.cat(values)
    return joined[key]


def cache_state(cache: Any) -> str | None:
    """The name of the list of per-row states `cache`'s class keeps, if a known one."""
    known = CACHE_STATES.get(class_name(type(cache)))
    return None if known is None else known[0]


def split_cache_state(child: Any, whole: Any, rows: slice, batch_size: int, enter: Any) -> None:
    """`child` (a copy of `whole`) holds its own list of `rows` of `whole`'s states, and
    its setter (hooked on `child` alone) first calls `enter()`: the ubatch's first write
    enters the call."""
    name, setter = CACHE_STATES[class_name(type(whole))]
    for state in getattr(whole, name):
        if isinstance(state, torch.Tensor):
            check_rows(type(whole).__name__, state.shape[0], batch_size)
    setattr(child, name, [state[rows] if isinstance(state, torch.Tensor) else state
                          for state in getattr(whole, name)])
    set_state = getattr(type(whole), setter)

    def entering_set_state(*args: Any, **kwargs: Any) -> Any:
        enter()
        return set_state(child, *args, **kwargs)

    setattr(child, setter, entering_set_state)


def join_cache_state(whole: Any, parts: list[Any]) -> None:
    """`whole` (a cache of a `CACHE_STATES` class) holds the rows of `parts`' states."""
    name = CACHE_STATES[class_name(type(whole))][0]
    lists = [getattr(part, name) for part in parts]
    same([len(states) for states in lists],
         f"numbers of layers' states in one {type(whole).__name__}")
    setattr(whole, name, [  # torch.cat raises if some ubatches set a state and some not
        torch.cat(states) if any(isinstance(state, torch.Tensor) for state in states)
        else states[0] for states in zip(*lists)
    ])
