"""Each ubatch's linear-attention (Mamba) layers of a `transformers` cache split by rows
(`dbo.hf.cache`): views of the rows of their conv and recurrent states, written in place.

- `StateRows`: rows of a `LinearAttentionLayer`'s states.
- `HybridRows`, `SlidingHybridRows`, `StaticHybridRows`, `StaticSlidingHybridRows`: rows
  of a layer holding both attention keys (or a window) and states (Falcon-H1, Zaya,
  Inkling: `transformers`' four `LinearAttentionAnd...Layer`s): `StateRows` and the row
  class of the attention layer of its kind (`Hybrid`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import LinearAttentionLayer

from dbo.hf.attention import (
    StaticRows,
    StaticWindowRows,
    WindowRows,
    for_every_row,
    initialize_once,
)
from dbo.hf.dynamic import GrowingRows
from dbo.hf.refusals import check_rows
from dbo.hf.rows import Rows, same
from dbo.ubatch import follow_mark, run_state


class StateRows(Rows, LinearAttentionLayer):
    """A ubatch's rows of a whole `LinearAttentionLayer`: views of the rows of its conv
    and recurrent states (`[B, ...]` each), which the layer's updates and the model's own
    kernels write in place, so the writes land in the caller's states. `transformers`'
    Cache reads `has_previous_state` before it hands out a state, and the updates go
    through this layer: either enters the call. Each call overwrites the states, which a
    failed call cannot undo: the cache is marked until the call ends (and a marked cache
    is refused)."""

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        self.entering = False  # not while the base class sets its fields
        LinearAttentionLayer.__init__(self, number_of_states=whole.number_of_states)
        Rows.__init__(self, whole, shared, call, ubatch, rows)
        for states in (*whole.conv_states.values(), *whole.recurrent_states.values()):
            if states is not None:
                check_rows(type(call.whole).__name__, states.shape[0], self.whole_batch)
        self._take_states()
        self.entering = True

    @property  # reads come before every state the Cache hands out
    def has_previous_state(self) -> dict[int, bool]:
        """This ubatch's flags, entering the call."""
        self.enter()
        return self._flags

    @has_previous_state.setter
    def has_previous_state(self, flags: dict[int, bool]) -> None:
        self._flags = flags

    def update_conv_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.enter()
        return LinearAttentionLayer.update_conv_state(self, *args, **kwargs)

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.enter()
        return LinearAttentionLayer.update_recurrent_state(self, *args, **kwargs)

    def increase_count(self, *args: Any, **kwargs: Any) -> None:
        """This ubatch's token count (`transformers` >= 5.25 counts in the layer)."""
        self.enter()
        LinearAttentionLayer.increase_count(self, *args, **kwargs)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> Any:
        """This ubatch's token count, entering the call."""
        self.enter()
        return LinearAttentionLayer.get_seq_length(self, *args, **kwargs)

    def lazy_initialization(
        self, conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | list[torch.Tensor] | None = None, state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        """Initialize the state in the whole layer (all rows), then take this ubatch's
        views; a state another ubatch initialized is only viewed. Recurrent states given
        as a list (one per token, `transformers` >= 5.25) are shaped as their last."""
        whole = self.whole

        def all_rows(states: torch.Tensor | list[torch.Tensor] | None,
                     done: dict[int, bool]) -> Any:
            if states is None or done[state_idx]:
                return None
            if not isinstance(states, torch.Tensor):
                states = states[-1]
            return for_every_row(states, self.whole_batch).contiguous()

        given = dict(  # only those given: transformers' hybrid layers count them
            conv_states=all_rows(conv_states, whole.is_conv_states_initialized),
            recurrent_states=all_rows(recurrent_states, whole.is_recurrent_states_initialized),
            conv_kernel_size=conv_kernel_size,
        )
        given = {name: value for name, value in given.items() if value is not None}
        key = (id(whole), "states", state_idx)
        initialize_once(self.call, key, "conv_states" not in given and "recurrent_states"
                        not in given, lambda: whole.lazy_initialization(state_idx=state_idx,
                                                                       **given))
        flags = self._flags
        self._take_states()
        self._flags = flags  # this ubatch's, as the call left them so far

    def enter(self) -> None:
        """Count in, and mark the cache: this ubatch is about to write its states."""
        if self.entering:
            super().enter()
            self.call.whole._dbo_overwritten = True  # until the call ends

    def refresh(self) -> None:
        self._take_states()
        for key, mark in self.call.marks.items():
            if key[:2] == (id(self.whole), "states"):  # made by another ubatch
                follow_mark(mark)
        super().refresh()

    def _take_states(self) -> None:
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
        counted = getattr(whole, "cumulative_length_linear", None)  # transformers >= 5.25
        if counted is not None:
            self.cumulative_length_linear = counted.clone()  # every row's: the same count

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """The caller's flags and token count after a call: the ubatches' (the states
        are written in place)."""
        ran = [part for part in parts if part.run is run_state()]
        flags = same([part._flags for part in ran], "linear-attention states in one cache layer")
        if ran:
            whole.has_previous_state = dict(flags)
            if getattr(whole, "cumulative_length_linear", None) is not None:
                # in place, as the layer's own count moves: a captured graph replays it
                whole.cumulative_length_linear.copy_(ran[0].cumulative_length_linear)


class Hybrid(StateRows):
    """The rows of a layer holding both attention keys (or a window) and linear-attention
    states, as `transformers`' hybrid layers do: made as both, its lazy initializations
    told apart as `transformers` does (the attention's takes two positional arguments,
    the states' keywords), its length the keys', and a call ended as both. Each subclass
    names its attention row class second among its bases."""

    attention: type[Any] = Rows

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        self.attention.__init__(self, whole, shared, call, ubatch, rows)
        StateRows.__init__(self, whole, shared, call, ubatch, rows)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        (self.attention if args else StateRows).lazy_initialization(self, *args, **kwargs)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> Any:
        return self.attention.get_seq_length(self, *args, **kwargs)

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        cls.attention.end_call(whole, parts)
        StateRows.end_call(whole, parts)


class HybridRows(Hybrid, GrowingRows):  # type: ignore[misc, override]  # transformers' bases, as its own
    """Rows of a `LinearAttentionAndFullAttentionLayer`."""

    attention = GrowingRows


class SlidingHybridRows(Hybrid, WindowRows):  # type: ignore[misc, override]  # transformers' bases, as its own
    """Rows of a `LinearAttentionAndSlidingWindowAttentionLayer`."""

    attention = WindowRows


class StaticHybridRows(Hybrid, StaticRows):  # type: ignore[misc, override]  # transformers' bases, as its own
    """Rows of a `LinearAttentionAndStaticFullAttentionLayer`."""

    attention = StaticRows


class StaticSlidingHybridRows(Hybrid, StaticWindowRows):  # type: ignore[misc, override]  # transformers' bases, as its own
    """Rows of a `LinearAttentionAndStaticSlidingWindowAttentionLayer`."""

    attention = StaticWindowRows
