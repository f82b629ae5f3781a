"""Each ubatch's rows of what a model keeps in a DynamicCache of its own making, found by
class name (so `dbo` imports no model):

- Layers of its own (DeepSeek-V4's compressed attention: a sliding window, plus
  compressor buffers and compressed entries kept per row): the layer's own methods run
  on the ubatch's rows of every per-row tensor it keeps, making new tensors and leaving
  the caller's layer untouched; the call's end joins the ubatches' tensors into the
  caller's layer (one copy of each), as `WindowRows` does for a plain sliding window.
- A cache class of its own (MiniMax's: a list of per-row linear-attention states, one per
  layer, beside DynamicLayers): each ubatch's cache holds a list of its rows, which the
  model's setter replaces entry by entry; the call's end joins the lists.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo.hf.attention import all_wrote
from dbo.hf.dynamic import check_rows
from dbo.ubatch import run_state

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

_made: dict[type, type] = {}


def model_rows(layer_class: type) -> type | None:
    """The class of a ubatch's rows of a `layer_class` layer, or None if not a known one."""
    known = MODEL_LAYERS.get(_name(layer_class))
    if known is None:
        return None
    if layer_class not in _made:
        # No `_layer_type` of its own: transformers would map the model's layer type to it.
        _made[layer_class] = type(f"{layer_class.__name__}Rows", (ModelRows, layer_class),
                                  {"STATES": known[0], "_layer_type": None})
    return _made[layer_class]


def _name(layer_class: type) -> tuple[str, str]:
    return layer_class.__module__, layer_class.__name__


class ModelRows:
    """Rows [start, stop) of a whole layer of a model's own class (the class this is mixed
    into, listed in `MODEL_LAYERS`), from the caller's layer as it is at each run's first
    write (`capture_graph` runs the same parts more than once). Its own attributes are
    slots, so that the layer's `__dict__` holds the model's state alone (what a join copies)."""

    __slots__ = ("whole", "rows", "whole_batch", "shared", "call", "ubatch", "run", "updated")
    STATES: tuple[str, ...] = ()

    def __init__(
        self, whole: Any, shared: Any, call: Any, ubatch: int, start: int, stop: int,
        batch_size: int,
    ) -> None:
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.shared, self.call, self.ubatch = shared, call, ubatch
        self.run: object = None
        self._take_rows()

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's own update on this ubatch's rows (the first write of each layer's
        forward: its other methods then work on the same rows)."""
        self.call.enter(self.ubatch)
        if self.run is not run_state():
            self.run = run_state()
            self._take_rows()
        self.updated = True
        return super().update(*args, **kwargs)  # type: ignore[misc]

    def _take_rows(self) -> None:
        for name, value in vars(self.whole).items():
            if name in self.STATES:
                value = self._rows_of(value)
            setattr(self, name, dict(value) if isinstance(value, dict) else value)
        self.updated = False

    def _rows_of(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: self._rows_of(item) for key, item in value.items()}
        if isinstance(value, torch.Tensor) and value.ndim >= 2:  # else empty: no token yet
            check_rows("DynamicCache", value.shape[0], self.whole_batch)
            return value[self.rows]
        return value

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: the ubatches' per-row tensors joined into the caller's layer."""
        if all_wrote(parts, "updated", f"a {type(whole).__name__}"):
            parts[0].shared.bytes_written += join_rows(whole, parts)


def join_rows(whole: Any, parts: list[Any]) -> int:
    """`whole` (a layer of a `MODEL_LAYERS` class) holds the rows of `parts`: their states
    joined, the rest as the first's (the counters the same in each); the bytes written."""
    states, agree = MODEL_LAYERS[_name(type(whole))]
    for name in agree:
        values = [getattr(part, name) for part in parts]
        if any(value != values[0] for value in values):
            raise RuntimeError(
                f"the ubatches ended a call with different {name} in one "
                f"{type(whole).__name__} ({values}); each must run the same forward on its rows"
            )
    joined: dict[tuple[int, ...], Any] = {}  # a tensor two states hold is joined once
    for name, value in vars(parts[0]).items():  # the model's state (dbo's is in slots)
        if name in states:
            value = _joined([vars(part)[name] for part in parts], joined)
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
    known = CACHE_STATES.get(_name(type(cache)))
    return None if known is None else known[0]


def split_cache_state(child: Any, whole: Any, rows: slice, batch_size: int, enter: Any) -> None:
    """`child` (a copy of `whole`) holds its own list of `rows` of `whole`'s states, and
    the model's setter first calls `enter()` (the ubatch's first write enters the call)."""
    name, setter = CACHE_STATES[_name(type(whole))]
    for state in getattr(whole, name):
        if isinstance(state, torch.Tensor):
            check_rows(type(whole).__name__, state.shape[0], batch_size)
    setattr(child, name, [state[rows] if isinstance(state, torch.Tensor) else state
                          for state in getattr(whole, name)])
    if type(whole) not in _made:
        def set_state(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._dbo_enter()
            return getattr(super(made, self), setter)(*args, **kwargs)

        made = _made[type(whole)] = type(f"{type(whole).__name__}Rows", (type(whole),),
                                          {setter: set_state})
    child.__class__ = _made[type(whole)]
    child._dbo_enter = enter


def join_cache_state(whole: Any, parts: list[Any]) -> None:
    """`whole` (a cache of a `CACHE_STATES` class) holds the rows of `parts`' states."""
    name = CACHE_STATES[_name(type(whole))][0]
    lists = [getattr(part, name) for part in parts]
    if len({len(states) for states in lists}) != 1:
        raise RuntimeError(
            f"the ubatches' {type(whole).__name__}s hold states of different numbers of layers "
            f"({[len(states) for states in lists]}); each must run the same forward on its rows"
        )
    setattr(whole, name, [  # torch.cat raises if some ubatches set a state and some not
        torch.cat(states) if any(isinstance(state, torch.Tensor) for state in states)
        else states[0] for states in zip(*lists)
    ])
