"""What every row class keeps (`dbo.hf.cache.ROWS` maps each kind of layer to one).

A row class stands for one ubatch's rows of one layer of the caller's cache. It derives
from `Rows` and from the `transformers` layer class it stands for, so the cache and the
model use it as that layer, on views of the ubatch's rows:

- `__init__(whole, shared, call, ubatch, rows)`: the caller's layer, the buffers the
  ubatches share for it (a DynamicCache's, or None), the call (`dbo.hf.cache.Call`), the
  ubatch's index and its rows of the batch.
- `enter()`, before every write and every read the model makes of the layer's state:
  counts the ubatch into the call (whose end then brings the caller's cache up to date)
  and, at each run's first, `refresh()`es the views (`capture_graph` runs the same parts
  more than once).
- `end_call(whole, parts)`, when the last ubatch returns: the caller's layer holds what
  every ubatch wrote. Where the ubatches disagree, `same` raises the one error of them all.
"""

from __future__ import annotations

from typing import Any

from dbo.ubatch import run_state


def same(values: list[Any], what: str) -> Any:
    """The value every ubatch ended with (`values`, one each), or RuntimeError naming
    `what` differs: every ubatch must run the same forward on its rows."""
    if any(value != values[0] for value in values):
        raise RuntimeError(
            f"the ubatches ended with different {what} ({values}); each must run the same "
            "forward on its rows"
        )
    return values[0]


class Rows:
    """One ubatch's rows of one layer of the caller's cache (see the module's contract)."""

    def __init__(self, whole: Any, shared: Any, call: Any, ubatch: int, rows: slice) -> None:
        self.whole, self.shared, self.call, self.ubatch, self.rows = (
            whole, shared, call, ubatch, rows)
        self.run: object = None

    @property
    def layer(self) -> Any:
        """What the ubatch's cache holds for this layer: the row object itself."""
        return self

    @property
    def whole_batch(self) -> int:
        """The rows of the caller's layer: every ubatch's."""
        return int(self.call.batch_size)

    def enter(self) -> None:
        """Count this ubatch into the call; at this run's first entry, `refresh()`."""
        self.call.enter(self.ubatch)
        if self.run is not run_state():
            self.run = run_state()
            self.refresh()

    def refresh(self) -> None:
        """Take this ubatch's views of the caller's layer afresh (each run's first entry);
        row classes that take theirs once, at the split, leave it empty. Cooperative: a
        row class of two kinds (the hybrid layers) refreshes as both."""

    @classmethod
    def end_call(cls, whole: Any, parts: list[Any]) -> None:
        """After a call: `whole`, the caller's layer, holds what `parts` (every ubatch's
        rows, in order) wrote."""
        raise NotImplementedError(f"{cls.__name__} does not say how a call ends")
