"""Which ubatch the calling thread runs, if any.

Each ubatch thread of a running overlap is *registered* with a `UBatchContext` for the
duration of its run, in a `threading.local` (a lookup is one attribute read, no lock); a
thread never registered (the caller, a helper thread) sees none: outside an overlap.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dbo.runtime.run import OverlapRun


@dataclass(frozen=True)
class UBatchContext:
    """What a registered ubatch thread knows about itself."""

    ubatch_id: int
    """This thread's ubatch id, 0 .. num_ubatches - 1."""
    num_ubatches: int
    """How many ubatches the running overlap has."""
    run: OverlapRun | None = None
    """The run this thread belongs to; None for a bare registration (tests)."""

    def __post_init__(self) -> None:
        if not 0 <= self.ubatch_id < self.num_ubatches:
            raise ValueError(
                f"ubatch_id must be in [0, {self.num_ubatches}), got {self.ubatch_id}"
            )


class _ThreadState(threading.local):
    context: UBatchContext | None = None


thread_state = _ThreadState()
_threads: set[int] = set()
"""`threading.get_ident()` of the registered threads (the tests count them: none may be
left registered). Single set operations, atomic under the GIL: no lock."""


def reset_after_fork() -> None:
    """In a forked child: the parent's other threads, and their registrations, are gone."""
    _threads.clear()


def current_context() -> UBatchContext | None:
    """The calling thread's context, or None outside a ubatch thread."""
    return thread_state.context


def num_registered_threads() -> int:
    """How many threads are registered right now (0 when no overlap runs)."""
    return len(_threads)


class registered:  # noqa: N801 - used like the function-style context managers
    """`with registered(context):` registers the calling thread as `context.ubatch_id`
    for the body's duration, even when it raises. RuntimeError if the thread is already
    registered. A class, not a generator: it runs in every ubatch of every call."""

    __slots__ = ("_context",)

    def __init__(self, context: UBatchContext) -> None:
        self._context = context

    def __enter__(self) -> UBatchContext:
        if thread_state.context is not None:
            raise RuntimeError(
                f"this thread already runs ubatch {thread_state.context.ubatch_id}; "
                "a thread can be registered for one ubatch at a time"
            )
        _threads.add(threading.get_ident())
        thread_state.context = self._context
        return self._context

    def __exit__(self, *exc_info: object) -> None:
        thread_state.context = None
        _threads.discard(threading.get_ident())
