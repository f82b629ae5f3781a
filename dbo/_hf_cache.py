"""The split rule for `transformers`' KV caches: each ubatch works on its own rows of the
cache the caller holds, and that cache stays a true cache of every row after each call.

- `StaticCache` (preallocated `[B, H, max_len, D]` per layer): ubatch i gets views of its
  rows, so its writes land in place, at the caller's layer's length; when the call ends
  that length advances by the tokens written (in place: a captured graph replays it).
  Nothing is copied. Its sliding-window layers run the layer's own update on views of
  their rows (in place too: once full, the window rolls); not in `capture_graph`.
- `DynamicCache` (grows by one `torch.cat` of the whole layer per call in `transformers`):
  each layer's keys and values live in a `[B, H, capacity, D]` buffer with room to grow
  (`dbo._hf_growing`); the caller's layer holds a view of the filled part, each ubatch a
  view of its rows, and a call writes only its new tokens. Its sliding-window layers
  (a window of the last tokens, remade by `torch.cat` every call in `transformers`): each
  ubatch runs the layer's own update on views of its rows, and the call's end joins the
  ubatches' windows (one more copy of the window per call). Not in `capture_graph`: its
  lengths live in Python, which a replay does not run.

The caller's cache is brought up to date as the last ubatch returns (`_Call`), whether
or not the function returns the cache. Caches of other kinds, layers of other kinds
(quantized, linear attention, indexed) and offloading are refused, named. Caches that
the ubatches create themselves (a forward called without one, `use_cache=True`) are
joined once along the batch. This module imports `transformers`: `dbo` imports it only
once `transformers` is (a cache is met, or `dbo.hf` is used).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from dbo import stateful
from dbo._hf_growing import Growing, GrowingRows, NewLayer, check_rows, growing_state
from dbo.api import at_ubatch_exit, run_state
from dbo.graphs import capturing

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
        kinds: dict[Any, Any] = {
            StaticSlidingWindowLayer: _StaticWindowRows, LinearAttentionLayer: _StateRows
        }
        call.children = [
            _child(cache, call, [
                layer if type(layer) is DummyLayer  # holds nothing: shared
                else kinds.get(type(layer), _StaticRows)(
                    layer, call, ubatch, start, stop, batch_size)
                for layer in cache.layers
            ])
            for ubatch, (start, stop) in enumerate(bounds)
        ]
        return call.children
    call.growing = growing = growing_state(cache, batch_size, len(rows))
    for ubatch, (start, stop) in enumerate(bounds):
        child = _child(cache, call, [])
        child.layers = [
            _WindowRows(layer, shared, call, ubatch, start, stop, batch_size)
            if type(layer) is DynamicSlidingWindowLayer
            else _StateRows(layer, call, ubatch, start, stop, batch_size)
            if type(layer) is LinearAttentionLayer
            else layer if type(layer) is DummyLayer  # holds nothing: shared
            else GrowingRows(shared, call, ubatch, start, stop)
            for layer, shared in zip(cache.layers, growing.layers)
        ]
        if cache.layer_class_to_replicate is not None:  # layers made at the first update
            child.layer_class_to_replicate = NewLayer(call, child, ubatch, start, stop)
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
        self.growing: Growing | None = None
        self._run: dict[str, Any] | None = None
        """The run the counts are of: the same parts can run again (`capture_graph`
        splits once, then runs them for its warmup and its capture)."""

    def enter(self, ubatch: int) -> None:
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
        if not self.entered[ubatch]:
            self.entered[ubatch] = True
            at_ubatch_exit(self._returned)  # outside an overlap (a part used alone): never

    def _returned(self) -> None:
        self.returned += 1
        if self.returned == len(self.entered):
            self._finish()

    def _finish(self) -> None:
        for index, layer in enumerate(self.whole.layers):
            if type(layer) is LinearAttentionLayer:
                _StateRows.finish(layer, [child.layers[index] for child in self.children])
        self.whole._dbo_overwritten = False  # the call ended: windows and states are right
        if self.growing is not None:
            while len(self.whole.layers) < len(self.growing.layers):
                self.whole.layers.append(self.whole.layer_class_to_replicate())
            for index, (layer, shared) in enumerate(zip(self.whole.layers, self.growing.layers)):
                if type(layer) is DynamicSlidingWindowLayer:
                    parts = [child.layers[index] for child in self.children]
                    shared.bytes_written += _join_windows(layer, parts)
                elif type(layer) is DynamicLayer:
                    shared.finish(layer)
            return
        for index, layer in enumerate(self.whole.layers):
            if type(layer) not in (StaticLayer, StaticSlidingWindowLayer):
                continue
            written = {child.layers[index].written for child in self.children}
            if len(written) != 1:
                raise RuntimeError(
                    f"the ubatches wrote different numbers of tokens into layer {index} of "
                    f"one StaticCache ({sorted(written, key=str)}); each must run the same "
                    "forward on its rows"
                )
            (count,) = written
            if count and type(layer) is StaticSlidingWindowLayer:
                layer.cumulative_length_int += count
                layer.cumulative_length.copy_(self.children[0].layers[index].cumulative_length)
            elif count:
                layer.cumulative_length.add_(count)
            for child in self.children:
                child.layers[index].written = None  # for the parts' next run (capture_graph)


def _check_supported(cache: Any) -> None:
    supported = {
        DynamicCache: (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer,
                       DummyLayer),
        StaticCache: (StaticLayer, StaticSlidingWindowLayer, LinearAttentionLayer, DummyLayer),
    }
    layer_kinds = supported.get(type(cache), ())
    odd = [type(layer).__name__ for layer in cache.layers if type(layer) not in layer_kinds]
    odd += [f"{type(layer).__name__} (recording past states)" for layer in cache.layers
            if type(layer) is LinearAttentionLayer and layer.record_past]
    lazy = cache.layer_class_to_replicate
    if not layer_kinds or odd or getattr(cache, "offloading", False) or (
        lazy is not None and lazy is not layer_kinds[0]
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
        kind = type(layers[0])
        if kind not in _JOINS or any(type(layer) is not kind for layer in layers):
            raise ValueError(
                "the ubatches returned DynamicCaches with layers dbo cannot join "
                f"({', '.join(type(layer).__name__ for layer in layers)}); pass use_cache=False"
            )
        joined.layers.append(_JOINS[kind](list(layers)))
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
            check_rows("StaticCache", whole.keys.shape[0], batch_size)
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


class _WindowRows(DynamicSlidingWindowLayer):
    """Rows [start, stop) of a whole `DynamicSlidingWindowLayer`, as one ubatch's layer:
    `transformers`' own update on views of the rows. It makes new tensors and leaves the
    caller's layer untouched; the call's end joins the ubatches' windows into the caller's
    layer (`_join_windows`: one copy of the window, as the layer's own update makes)."""

    def __init__(
        self, whole: Any, shared: Any, call: _Call, ubatch: int, start: int, stop: int,
        batch_size: int,
    ) -> None:
        super().__init__(whole.sliding_window)
        self.shared = shared  # counts the bytes written (`dbo.hf.cache_bytes_written`)
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.call, self.ubatch = call, ubatch
        self.run: object = None
        self._take_rows()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update on this ubatch's rows, from the caller's layer as it is
        at this run's start (`capture_graph` runs the same parts more than once)."""
        self.call.enter(self.ubatch)
        if self.run is not run_state():
            self.run = run_state()
            self._take_rows()
        self.updated = True
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.shared.bytes_written += keys.nbytes + values.nbytes  # the layer's own torch.cat
        return keys, values

    def _take_rows(self) -> None:
        whole = self.whole
        self.__dict__.update(whole.__dict__)
        self.updated = False
        if whole.is_initialized and whole.keys.ndim == 4:
            check_rows("DynamicCache", whole.keys.shape[0], self.whole_batch)
            self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]


def _join_windows(whole: Any, parts: list[_WindowRows]) -> int:
    """The caller's sliding-window layer after a call: the ubatches' windows, joined if
    they wrote into it; the bytes written."""
    if not any(part.updated for part in parts):
        return 0
    if not all(part.updated for part in parts):
        raise RuntimeError(
            "some ubatches did not write into a sliding-window cache layer the others wrote "
            "into; each must run the same forward on its rows"
        )
    _fill(whole, parts)
    for part in parts:
        part.updated = False
    return int(whole.keys.nbytes + whole.values.nbytes)


def _joined_keys(parts: list[Any]) -> Any:
    """One DynamicLayer or sliding-window layer of the rows of `parts`."""
    kind = type(parts[0])
    layer = kind(parts[0].sliding_window) if kind is DynamicSlidingWindowLayer else kind()
    if all(part.is_initialized for part in parts):
        _fill(layer, parts)
    return layer


def _joined_states(parts: list[Any]) -> Any:
    """One LinearAttentionLayer of the rows of `parts` (the same states of each)."""
    layer = LinearAttentionLayer(number_of_states=parts[0].number_of_states)
    for name in ("device", "dtype", "conv_kernel_size", "has_previous_state",
                 "is_conv_states_initialized", "is_recurrent_states_initialized"):
        values = [getattr(part, name) for part in parts]
        if any(value != values[0] for value in values):
            raise RuntimeError(
                f"the ubatches' caches differ in {name} of a linear-attention layer ({values}); "
                "each must run the same forward on its rows"
            )
        setattr(layer, name, copy.copy(values[0]))
    for name in ("conv_states", "recurrent_states"):
        getattr(layer, name).update({
            index: None if states[0] is None else torch.cat(states)
            for index, states in zip(getattr(parts[0], name), zip(
                *(getattr(part, name).values() for part in parts)))
        })
    return layer


_JOINS: dict[Any, Any] = {
    DynamicLayer: _joined_keys, DynamicSlidingWindowLayer: _joined_keys,
    LinearAttentionLayer: _joined_states, DummyLayer: lambda parts: DummyLayer(),
}
"""How to join each kind of layer the ubatches made in caches of their own."""


def _fill(whole: Any, parts: list[Any]) -> None:
    """`whole` holds the rows of `parts` (DynamicLayers, or sliding windows of one length)."""
    if isinstance(whole, DynamicSlidingWindowLayer):
        lengths = {part.cumulative_length for part in parts}
        if len(lengths) != 1:
            raise RuntimeError(
                "the ubatches wrote different numbers of tokens into one sliding-window "
                f"cache layer ({[part.cumulative_length for part in parts]}); each must run "
                "the same forward on its rows"
            )
        (whole.cumulative_length,) = lengths
    if not whole.is_initialized:
        whole.lazy_initialization(parts[0].keys, parts[0].values)
    whole.keys = torch.cat([part.keys for part in parts])
    whole.values = torch.cat([part.values for part in parts])


class _StaticWindowRows(StaticSlidingWindowLayer):
    """Rows [start, stop) of a whole `StaticSlidingWindowLayer`: `transformers`' own update
    on views of its rows, so writes land in place (once the window is full, it rolls). It
    starts from the caller's lengths at each run's first write, on a length tensor of its
    own; the call's end sets the caller's (the tensor in place). A write that rolls or
    overwrites the window marks the cache until the call ends, so that a failed call's
    cache is refused rather than read with a window that lost tokens. Not in
    `capture_graph`: a graph would keep the fill state and mask offsets of its capture."""

    def __init__(
        self, whole: Any, call: _Call, ubatch: int, start: int, stop: int, batch_size: int
    ) -> None:
        self.__dict__.update(whole.__dict__)
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.call, self.ubatch = call, ubatch
        self.run: object = None
        self.written: int | None = None
        if whole.is_initialized:
            check_rows("StaticCache", whole.keys.shape[0], batch_size)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update on this ubatch's rows, from the caller's lengths."""
        if capturing():
            raise ValueError(
                "a StaticCache with sliding-window layers cannot be in a dbo.capture_graph: "
                "a replay would keep the window's fill state and attention-mask offsets of the "
                "capture; run these steps without capture_graph"
            )
        self.call.enter(self.ubatch)
        whole = self.whole
        if not whole.is_initialized:  # all rows, on the first write of any ubatch
            whole.lazy_initialization(
                key_states[:1].expand((self.whole_batch, *key_states.shape[1:])),
                value_states[:1].expand((self.whole_batch, *value_states.shape[1:])),
            )
        if self.run is not run_state():
            self.run = run_state()
            for name in ("device", "num_heads", "k_head_dim", "v_head_dim",
                         "cumulative_length_int"):
                setattr(self, name, getattr(whole, name))
            self.batch_size = self.rows.stop - self.rows.start
            self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]
            self.cumulative_length = whole.cumulative_length.clone()
            self.is_initialized = True
        length = key_states.shape[-2]
        if self.cumulative_length_int + length > self.max_cache_len:
            self.call.whole._dbo_overwritten = True  # until the call ends
        self.written = length
        return super().update(key_states, value_states, *args, **kwargs)


class _StateRows(LinearAttentionLayer):
    """Rows [start, stop) of a whole `LinearAttentionLayer`: views of the rows of its conv
    and recurrent states (`[B, ...]` each), which the layer's updates and the model's own
    kernels write in place, so the writes land in the caller's states. `transformers`'
    Cache reads `has_previous_state` before it hands out a state, and the updates go
    through this layer: either enters the call and, at each run's first, takes the views
    afresh. Each call overwrites the states, which a failed call cannot undo: the cache
    is marked until the call ends (and a marked cache is refused)."""

    def __init__(
        self, whole: Any, call: _Call, ubatch: int, start: int, stop: int, batch_size: int
    ) -> None:
        self.call: _Call | None = None  # not entered while the base class sets its fields
        super().__init__(number_of_states=whole.number_of_states)
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.run: object = None
        for states in (*whole.conv_states.values(), *whole.recurrent_states.values()):
            if states is not None:
                check_rows(type(call.whole).__name__, states.shape[0], batch_size)
        self._take_rows()
        self.call, self.ubatch = call, ubatch

    @property  # reads come before every state the Cache hands out
    def has_previous_state(self) -> dict[int, bool]:
        """This ubatch's flags, entering the call."""
        self._enter()
        return self._flags

    @has_previous_state.setter
    def has_previous_state(self, flags: dict[int, bool]) -> None:
        self._flags = flags

    def update_conv_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._enter()
        return super().update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._enter()
        return super().update_recurrent_state(*args, **kwargs)

    def lazy_initialization(
        self, conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None, state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        """Initialize the state in the whole layer (all rows), then take this ubatch's
        views; a state another ubatch initialized is only viewed."""
        whole = self.whole

        def all_rows(states: torch.Tensor | None, done: dict[int, bool]) -> Any:
            if states is None or done[state_idx]:
                return None
            return states[:1].expand((self.whole_batch, *states.shape[1:])).contiguous()

        conv = all_rows(conv_states, whole.is_conv_states_initialized)
        recurrent = all_rows(recurrent_states, whole.is_recurrent_states_initialized)
        if conv is not None or recurrent is not None:
            whole.lazy_initialization(conv_states=conv, recurrent_states=recurrent,
                                      state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        flags = self._flags
        self._take_rows()
        self._flags = flags  # this ubatch's, as the call left them so far

    def _enter(self) -> None:
        if self.call is None:
            return
        self.call.enter(self.ubatch)
        self.call.whole._dbo_overwritten = True  # until the call ends
        if self.run is not run_state():
            self.run = run_state()
            self._take_rows()

    def _take_rows(self) -> None:
        whole = self.whole
        self._flags = dict(whole.has_previous_state)
        self.device, self.dtype = whole.device, whole.dtype
        self.conv_kernel_size = dict(whole.conv_kernel_size)
        self.is_conv_states_initialized = dict(whole.is_conv_states_initialized)
        self.is_recurrent_states_initialized = dict(whole.is_recurrent_states_initialized)
        self.conv_states = {index: None if states is None else states[self.rows]
                            for index, states in whole.conv_states.items()}
        self.recurrent_states = {index: None if states is None else states[self.rows]
                                 for index, states in whole.recurrent_states.items()}

    @staticmethod
    def finish(whole: Any, parts: list[_StateRows]) -> None:
        """The caller's flags after a call: the ubatches' (the states are written in place)."""
        flags = [part._flags for part in parts if part.run is run_state()]
        if any(flag != flags[0] for flag in flags):
            raise RuntimeError(
                "the ubatches left different linear-attention states in one cache layer "
                f"({flags}); each must run the same forward on its rows"
            )
        if flags:
            whole.has_previous_state = dict(flags[0])
