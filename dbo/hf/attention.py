"""Each ubatch's attention layers of a `transformers` cache split by rows
(`dbo.hf.cache`), one row class (`dbo.hf.rows.Rows`) per kind of layer; linear-attention
states are `dbo.hf.linear_attention`'s, a DynamicCache's full-attention layers
`dbo.hf.dynamic`'s.

- `StaticRows`: rows of a `StaticLayer`, written in place at the caller's length.
- `StaticWindowRows`: rows of a `StaticSlidingWindowLayer`, the layer's own update in place.
- `WindowRows`: rows of a `DynamicSlidingWindowLayer`, the layer's own update on new
  tensors; the call's end joins the windows (`fill_keys`).
- `IndexedRows`, `StaticIndexedRows`: rows of the indexed layers of sparse attention
  (DeepSeek-V3.2 and kin): keys and values as a full-attention layer's, the indexer keys
  (`[B, S, D]`) the way of the layer's kind.
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

from dbo.hf.dynamic import GrowingRows
from dbo.hf.refusals import check_indexer_positions, check_rows, refuse_in_capture
from dbo.hf.rows import Rows, same
from dbo.ubatch import capturing, follow_mark, stream_mark


def for_every_row(states: torch.Tensor, batch_size: int) -> torch.Tensor:
    """`states` of one ubatch's rows as if of all `batch_size` (a view): what a layer's
    lazy initialization reads its shapes and dtype from, when it makes it for every row."""
    return states[:1].expand((batch_size, *states.shape[1:]))


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


def tokens_written(parts: list[Any], name: str = "written", what: str = "tokens") -> Any:
    """The tokens each ubatch wrote into one StaticCache layer in this run (their `name`,
    the same for all), forgotten for the parts' next run (`capture_graph`)."""
    count = same([getattr(part, name) for part in parts],
                 f"numbers of {what} written into one StaticCache layer")
    for part in parts:
        setattr(part, name, None)
    return count


def all_wrote(parts: list[Any], flag: str, what: str) -> bool:
    """Whether the ubatches wrote `what` (their `flag`, which this clears): all or none."""
    wrote = same([bool(getattr(part, flag)) for part in parts], f"writes of {what}")
    for part in parts:
        setattr(part, flag, False)
    return bool(wrote)


def fill_keys(whole: Any, parts: list[Any]) -> None:
    """`whole` holds the rows of `parts` (DynamicLayers, or sliding windows of one length)."""
    if isinstance(whole, DynamicSlidingWindowLayer):
        whole.cumulative_length = same([part.cumulative_length for part in parts],
                                       "numbers of tokens in one sliding-window cache layer")
    if not whole.is_initialized:
        whole.lazy_initialization(parts[0].keys, parts[0].values)
    whole.keys = torch.cat([part.keys for part in parts])
    whole.values = torch.cat([part.values for part in parts])


def fill_indexer(whole: Any, parts: list[Any]) -> None:
    """`whole` holds the indexer keys of `parts`."""
    keys: list[Any] = [part.indexer_keys for part in parts]
    if not whole.is_indexer_initialized:
        whole.lazy_initialization_indexer(keys[0])
    whole.indexer_keys = torch.cat(keys)


class StaticRows(Rows, StaticLayer):
    """A ubatch's rows of a whole `StaticLayer`: views of its tensors, so writes land in
    place. Every ubatch writes at the whole layer's length, which it reads and does not
    change; the call's end adds the tokens written once (in place: a graph replays it)."""

    written: int | None = None

    def __init__(self, whole: Any, shared: None, call: Any, ubatch: int, rows: slice) -> None:
        StaticLayer.__init__(self, max_cache_len=whole.max_cache_len)
        Rows.__init__(self, whole, shared, call, ubatch, rows)
        if whole.is_initialized:
            check_rows("StaticCache", whole.keys.shape[0], self.whole_batch)
            self._take_views()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Initialize the whole layer (all rows, on the first write of any ubatch), then
        take this ubatch's views of it."""
        self._make_whole(key_states, value_states)
        self._take_views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`StaticLayer.update` on this ubatch's rows, leaving the length to the call's end."""
        self.enter()
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

    def _make_whole(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make the caller's layer for every row, on the first write of any ubatch."""
        whole, batch_size = self.whole, self.whole_batch
        initialize_once(self.call, (id(whole), "keys"), whole.is_initialized, lambda: (
            whole.lazy_initialization(for_every_row(key_states, batch_size),
                                      for_every_row(value_states, batch_size))))

    def _take_views(self, *lengths: str) -> None:
        whole = self.whole
        for name in ("device", "num_heads", "k_head_dim", "v_head_dim", *lengths):
            setattr(self, name, getattr(whole, name))
        self.batch_size = self.rows.stop - self.rows.start
        self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]
        self.cumulative_length = whole.cumulative_length
        self.is_initialized = True

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: the caller's length advanced once by the tokens each wrote."""
        count = tokens_written(parts)
        if count:
            whole.cumulative_length.add_(count)


class StaticWindowRows(StaticRows, StaticSlidingWindowLayer):
    """A ubatch's rows of a whole `StaticSlidingWindowLayer`: `transformers`' own update
    on views of its rows, so writes land in place (once the window is full, it rolls). It
    starts from the caller's lengths at each run's first write, on a length tensor of its
    own; the call's end sets the caller's (the tensor in place). A write that rolls or
    overwrites the window marks the cache until the call ends, so that a failed call's
    cache is refused rather than read with a window that lost tokens. Not in
    `capture_graph`: a graph would keep the fill state and mask offsets of its capture."""

    def __init__(self, whole: Any, shared: None, call: Any, ubatch: int, rows: slice) -> None:
        StaticSlidingWindowLayer.__init__(self, max_cache_len=whole.max_cache_len,
                                          sliding_window=whole.max_cache_len)
        Rows.__init__(self, whole, shared, call, ubatch, rows)
        self.cumulative_length_int = whole.cumulative_length_int  # what the masks read
        if whole.is_initialized:
            check_rows("StaticCache", whole.keys.shape[0], self.whole_batch)

    def refresh(self) -> None:
        self.is_initialized = False  # views and lengths taken at this run's first write
        super().refresh()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update on this ubatch's rows, from the caller's lengths."""
        if capturing():
            refuse_in_capture("sliding windows")
        self.enter()
        if not self.is_initialized:
            self._make_whole(key_states, value_states)
            self._take_views("cumulative_length_int")
            self.cumulative_length = self.whole.cumulative_length.clone()
        length = key_states.shape[-2]
        if self.cumulative_length_int + length > self.max_cache_len:
            self.call.whole._dbo_overwritten = True  # until the call ends
        self.written = length
        return StaticSlidingWindowLayer.update(self, key_states, value_states, *args, **kwargs)

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: the caller's lengths set (the tensor in place) to the ubatches'."""
        count = tokens_written(parts)
        if count:
            whole.cumulative_length_int += count
            whole.cumulative_length.copy_(parts[0].cumulative_length)


class WindowRows(Rows, DynamicSlidingWindowLayer):
    """A ubatch's rows of a whole `DynamicSlidingWindowLayer`: `transformers`' own update
    on views of the rows. It makes new tensors and leaves the caller's layer untouched;
    the call's end joins the ubatches' windows into the caller's layer (one copy of the
    window, as the layer's own update makes)."""

    WINDOW = ("keys", "values", "is_initialized", "device", "cumulative_length",
              "record_past", "_sliding_window_tensor")
    """What a ubatch takes of the caller's layer (those it has: the device once initialized)."""

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        DynamicSlidingWindowLayer.__init__(self, whole.sliding_window)
        Rows.__init__(self, whole, shared, call, ubatch, rows)
        WindowRows.refresh(self)  # its own part (a hybrid's states are its other base's)

    def refresh(self) -> None:
        whole = self.whole
        for name in self.WINDOW:
            if name in vars(whole):
                setattr(self, name, getattr(whole, name))
        self.updated = False
        if whole.is_initialized and whole.keys.ndim == 4:
            check_rows("DynamicCache", whole.keys.shape[0], self.whole_batch)
            self.keys, self.values = whole.keys[self.rows], whole.values[self.rows]
        super().refresh()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own update on this ubatch's rows, from the caller's layer as it is
        at this run's start."""
        self.enter()
        self.updated = True
        keys, values = DynamicSlidingWindowLayer.update(self, key_states, value_states,
                                                        *args, **kwargs)
        self.shared.bytes_written += keys.nbytes + values.nbytes  # the layer's own torch.cat
        return keys, values

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: the ubatches' windows joined into the caller's layer."""
        if all_wrote(parts, "updated", "a sliding window"):
            fill_keys(whole, parts)
            parts[0].shared.bytes_written += whole.keys.nbytes + whole.values.nbytes


class IndexedRows(GrowingRows, DynamicIndexedLayer):
    """A ubatch's rows of a whole `DynamicIndexedLayer`: keys and values in the shared
    buffers (`GrowingRows`); the indexer keys by the layer's own update (a `torch.cat`)
    on views of the rows, taken afresh at each run's first, joined into the caller's layer
    at the call's end (one copy of the indexer keys, a single head)."""

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        GrowingRows.__init__(self, whole, shared, call, ubatch, rows)
        IndexedRows.refresh(self)

    def refresh(self) -> None:
        whole, self.updated_indexer = self.whole, False
        self.is_indexer_initialized = whole.is_indexer_initialized
        if whole.is_indexer_initialized:
            self.indexer_dtype, self.indexer_device = whole.indexer_dtype, whole.indexer_device
            keys = whole.indexer_keys
            self.indexer_keys = keys[self.rows] if keys.ndim == 3 else keys
        super().refresh()

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """The layer's own update of the indexer keys, on this ubatch's rows."""
        self.enter()
        self.updated_indexer = True
        return DynamicIndexedLayer.update_indexer(self, indexer_key_states)

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: keys and values as `GrowingRows`', the indexer keys joined."""
        GrowingRows.end_call(whole, parts)
        check_indexer_positions(parts)
        if all_wrote(parts, "updated_indexer", "indexer keys"):
            fill_indexer(whole, parts)
            parts[0].shared.bytes_written += whole.indexer_keys.nbytes


class StaticIndexedRows(StaticRows):
    """A ubatch's rows of a whole `StaticIndexedLayer`: keys and values as `StaticRows`;
    the indexer keys (`[B, max_len, D]`) written in place at the caller's indexer length,
    which every ubatch reads and none changes; the call's end advances it once (in place:
    a graph replays it)."""

    indexer_written: int | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """`StaticIndexedLayer.update_indexer` on this ubatch's rows, leaving the length."""
        self.enter()
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

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: keys and values as `StaticRows`', the caller's indexer length
        advanced once by the tokens each ubatch wrote."""
        StaticRows.end_call(whole, parts)
        check_indexer_positions(parts)
        count = tokens_written(parts, "indexer_written", "indexer keys")
        if count:
            whole.indexer_cumulative_length.add_(count)
