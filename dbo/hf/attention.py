"""Each ubatch's attention layers of a `transformers` cache split by rows
(`dbo.hf.cache`), one class per kind of layer it holds views of; linear-attention states
are `dbo.hf.linear_attention`', a DynamicCache's full-attention layers `dbo.hf.dynamic`'s.

- `StaticRows`: rows of a `StaticLayer`, written in place at the caller's length.
- `StaticWindowRows`: rows of a `StaticSlidingWindowLayer`, the layer's own update in place.
- `WindowRows`: rows of a `DynamicSlidingWindowLayer`, the layer's own update on new
  tensors; the call's end joins the windows (`join_windows`).
- `IndexedRows`, `StaticIndexedRows`: rows of the indexed layers of sparse attention
  (DeepSeek-V3.2 and kin): keys and values as a full-attention layer's, the indexer keys
  (`[B, S, D]`) the way of the layer's kind.

Each enters the call (`_Call.enter`) at its first write, which brings the caller's cache
up to date when the last ubatch returns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from dbo.hf.dynamic import GrowingRows, check_rows
from dbo.ubatch import capturing, follow_mark, run_state, stream_mark


def for_every_row(states: torch.Tensor, batch_size: int) -> torch.Tensor:
    """`states` of one ubatch's rows as if of all `batch_size` (a view): what a layer's
    lazy initialization reads its shapes and dtype from, when it makes it for every row."""
    return states[:1].expand((batch_size, *states.shape[1:]))


def refuse_indexer_positions(parts: list[Any]) -> None:
    """ValueError if the model set indexer positions on a ubatch's layer: dbo does not
    split or join them."""
    if any(getattr(part, "indexer_position_ids", None) is not None for part in parts):
        raise ValueError(
            "dbo does not split the indexer positions this model keeps on its cache layers "
            "(indexer_position_ids); pass use_cache=False"
        )


def initialize_once(call: Any, key: Any, initialized: bool, initialize: Any) -> None:
    """`initialize()` the caller's layer (or a part of it) for every row unless
    `initialized`, marking this ubatch's stream after it; else follow the mark another
    ubatch left in this run: the zero fill it queued on its own stream must come before
    this ubatch writes its rows."""
    if not initialized:
        initialize()
        call.marks[key] = stream_mark()
    else:
        follow_mark(call.marks.get(key))


class StaticRows(StaticLayer):
    """Rows [start, stop) of a whole `StaticLayer`: views of its tensors, so writes land in
    place. Every ubatch writes at the whole layer's length, which it reads and does not
    change; the call's end adds the tokens written once (in place: a graph replays it)."""

    def __init__(
        self, whole: Any, shared: None, call: Any, ubatch: int, start: int, stop: int,
        batch_size: int,
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
        _make_whole(self, key_states, value_states)
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

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: the caller's length advanced once by the tokens each wrote."""
        count = _tokens_written(parts)
        if count:
            whole.cumulative_length.add_(count)


def _make_whole(rows: Any, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Make the caller's static layer for every row, on the first write of any ubatch."""
    whole, batch_size = rows.whole, rows.whole_batch
    initialize_once(rows.call, (id(whole), "keys"), whole.is_initialized, lambda: (
        whole.lazy_initialization(for_every_row(key_states, batch_size),
                                  for_every_row(value_states, batch_size))))


def _tokens_written(parts: list[Any], name: str = "written", what: str = "tokens") -> Any:
    """The tokens each ubatch wrote into one StaticCache layer in this run (their `name`:
    the same for all, or RuntimeError), forgotten for the parts' next run
    (`capture_graph`)."""
    written = {getattr(part, name) for part in parts}
    if len(written) != 1:
        raise RuntimeError(
            f"the ubatches wrote different numbers of {what} into one StaticCache layer "
            f"({sorted(written, key=str)}); each must run the same forward on its rows"
        )
    for part in parts:
        setattr(part, name, None)
    (count,) = written
    return count


class WindowRows(DynamicSlidingWindowLayer):
    """Rows [start, stop) of a whole `DynamicSlidingWindowLayer`, as one ubatch's layer:
    `transformers`' own update on views of the rows. It makes new tensors and leaves the
    caller's layer untouched; the call's end joins the ubatches' windows into the caller's
    layer (`join_windows`: one copy of the window, as the layer's own update makes)."""

    def __init__(
        self, whole: Any, shared: Any, call: Any, ubatch: int, start: int, stop: int,
        batch_size: int,
    ) -> None:
        super().__init__(whole.sliding_window)
        self.shared = shared  # counts the bytes written (`dbo.hf.cache_bytes_written`)
        self.whole, self.rows, self.whole_batch = whole, slice(start, stop), batch_size
        self.call, self.ubatch = call, ubatch
        self.run: object = None
        self._take_window()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update on this ubatch's rows, from the caller's layer as it is
        at this run's start (`capture_graph` runs the same parts more than once)."""
        self.call.enter(self.ubatch)
        if self.run is not run_state():
            self.run = run_state()
            self._take_window()
        self.updated = True
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.shared.bytes_written += keys.nbytes + values.nbytes  # the layer's own torch.cat
        return keys, values

    def _take_window(self) -> None:
        whole = self.whole
        for name in ("keys", "values", "is_initialized", "device", "cumulative_length",
                     "record_past", "_sliding_window_tensor"):
            if name in whole.__dict__:  # the device once initialized
                setattr(self, name, getattr(whole, name))
        self.updated = False
        if whole.is_initialized and whole.keys.ndim == 4:
            check_rows("DynamicCache", whole.keys.shape[0], self.whole_batch)
            self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: the ubatches' windows joined into the caller's layer."""
        parts[0].shared.bytes_written += join_windows(whole, parts)


def join_windows(whole: Any, parts: list[WindowRows]) -> int:
    """The caller's sliding-window layer after a call: the ubatches' windows, joined if
    they wrote into it; the bytes written."""
    if not all_wrote(parts, "updated", "a sliding window"):
        return 0
    fill_keys(whole, parts)
    return int(whole.keys.nbytes + whole.values.nbytes)


def all_wrote(parts: list[Any], flag: str, what: str) -> bool:
    """Whether the ubatches wrote `what` (their `flag`, which this clears): all or none."""
    wrote = [getattr(part, flag) for part in parts]
    if any(wrote) and not all(wrote):
        raise RuntimeError(
            f"some ubatches did not write {what} into a cache layer the others wrote it into; "
            "each must run the same forward on its rows"
        )
    for part in parts:
        setattr(part, flag, False)
    return all(wrote)


def fill_keys(whole: Any, parts: list[Any]) -> None:
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


class StaticWindowRows(StaticSlidingWindowLayer):
    """Rows [start, stop) of a whole `StaticSlidingWindowLayer`: `transformers`' own update
    on views of its rows, so writes land in place (once the window is full, it rolls). It
    starts from the caller's lengths at each run's first write, on a length tensor of its
    own; the call's end sets the caller's (the tensor in place). A write that rolls or
    overwrites the window marks the cache until the call ends, so that a failed call's
    cache is refused rather than read with a window that lost tokens. Not in
    `capture_graph`: a graph would keep the fill state and mask offsets of its capture."""

    def __init__(
        self, whole: Any, shared: None, call: Any, ubatch: int, start: int, stop: int,
        batch_size: int,
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
        if self.run is not run_state():
            self.run = run_state()
            _make_whole(self, key_states, value_states)
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

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: the caller's lengths set (the tensor in place) to the ubatches'."""
        count = _tokens_written(parts)
        if count:
            whole.cumulative_length_int += count
            whole.cumulative_length.copy_(parts[0].cumulative_length)


class IndexedRows(GrowingRows, DynamicIndexedLayer):
    """Rows [start, stop) of a whole `DynamicIndexedLayer`: keys and values in the shared
    buffers (`GrowingRows`); the indexer keys by the layer's own update (a `torch.cat`)
    on views of the rows, taken afresh at each run's first, joined into the caller's layer
    at the call's end (`join_indexers`: one copy of the indexer keys, a single head)."""

    def __init__(
        self, whole: Any, shared: Any, call: Any, ubatch: int, start: int, stop: int,
        batch_size: int,
    ) -> None:
        super().__init__(whole, shared, call, ubatch, start, stop, batch_size)
        self.whole = whole
        self.run: object = None
        self.updated_indexer = False
        self._take_indexer()

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """The layer's own update of the indexer keys, on this ubatch's rows."""
        self.call.enter(self.ubatch)
        if self.run is not run_state():
            self.run = run_state()
            self._take_indexer()
        self.updated_indexer = True
        return DynamicIndexedLayer.update_indexer(self, indexer_key_states)

    def _take_indexer(self) -> None:
        whole, self.updated_indexer = self.whole, False
        self.is_indexer_initialized = whole.is_indexer_initialized
        if whole.is_indexer_initialized:
            self.indexer_dtype, self.indexer_device = whole.indexer_dtype, whole.indexer_device
            keys = whole.indexer_keys
            self.indexer_keys = keys[self.rows] if keys.ndim == 3 else keys

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: keys and values as `GrowingRows`', the indexer keys joined."""
        GrowingRows.end_call(whole, parts)
        parts[0].shared.bytes_written += join_indexers(whole, parts)


def join_indexers(whole: Any, parts: list[IndexedRows]) -> int:
    """The caller's indexer keys after a call: the ubatches', joined if they wrote them;
    the bytes written. Indexer positions set on the layer are refused."""
    refuse_indexer_positions(parts)
    if not all_wrote(parts, "updated_indexer", "indexer keys"):
        return 0
    fill_indexer(whole, parts)
    return int(whole.indexer_keys.nbytes)


def fill_indexer(whole: Any, parts: list[Any]) -> None:
    keys: list[Any] = [part.indexer_keys for part in parts]
    if not whole.is_indexer_initialized:
        whole.lazy_initialization_indexer(keys[0])
    whole.indexer_keys = torch.cat(keys)


class StaticIndexedRows(StaticRows):
    """Rows [start, stop) of a whole `StaticIndexedLayer`: keys and values as
    `StaticRows`; the indexer keys (`[B, max_len, D]`) written in place at the caller's
    indexer length, which every ubatch reads and none changes; the call's end advances it
    once (in place: a graph replays it)."""

    indexer_written: int | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """`StaticIndexedLayer.update_indexer` on this ubatch's rows, leaving the length."""
        self.call.enter(self.ubatch)
        whole = self.whole
        initialize_once(self.call, (id(whole), "indexer"), whole.is_indexer_initialized,
                        lambda: whole.lazy_initialization_indexer(
                            for_every_row(indexer_key_states, self.whole_batch)))
        keys = whole.indexer_keys[self.rows]
        length = indexer_key_states.shape[1]
        positions = torch.arange(length, device=keys.device) + whole.indexer_cumulative_length
        keys.index_copy_(1, positions, indexer_key_states)
        self.indexer_written = length
        return keys

    @staticmethod
    def end_call(whole: Any, parts: list[Any]) -> None:
        """After a call: keys and values as `StaticRows`', the caller's indexer length
        advanced once by the tokens each ubatch wrote."""
        StaticRows.end_call(whole, parts)
        refuse_indexer_positions(parts)
        count = _tokens_written(parts, "indexer_written", "indexer keys")
        if count:
            whole.indexer_cumulative_length.add_(count)
