"""Each ubatch's rows of the DynamicCache layers a model defines itself (DeepSeek-V4's
compressed attention: a sliding window, plus compressor buffers and compressed entries
kept per row): the layer's own methods run on the ubatch's rows of every per-row tensor
it keeps, making new tensors and leaving the caller's layer untouched; the call's end
joins the ubatches' tensors into the caller's layer (one copy of each), as `WindowRows`
does for a plain sliding window. Found by class name, so `dbo` imports no model.
"""

from __future__ import annotations

from typing import Any

import torch

from dbo._hf_growing import check_rows
from dbo._hf_layers import _all_wrote
from dbo.api import run_state

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

_made: dict[type, type] = {}
_OWN = frozenset({"whole", "rows", "whole_batch", "shared", "call", "ubatch", "run", "updated"})


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
    write (`capture_graph` runs the same parts more than once)."""

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
        if _all_wrote(parts, "updated", f"a {type(whole).__name__}"):
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
    for name, value in vars(parts[0]).items():
        if name in states:
            value = _joined([vars(part)[name] for part in parts], joined)
        if name not in _OWN:  # a dict of counters stays this ubatch's
            setattr(whole, name, dict(value) if isinstance(value, dict) else value)
    return sum(tensor.nbytes for tensor in joined.values())


def _joined(values: list[Any], joined: dict[tuple[int, ...], Any]) -> Any:
    """The ubatches' `values` of one state as one of every row (cat along the batch)."""
    if isinstance(values[0], dict):
        return {key: _joined([value[key] for value in values], joined) for key in values[0]}
    if not (isinstance(values[0], torch.Tensor) and values[0].ndim >= 2):
        return values[0]  # None, or an empty tensor made before any token
    key = tuple(id(value) for value in values)
    if key not in joined:
        joined[key] = torch.cat(values)
    return joined[key]
