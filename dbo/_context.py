"""Which ubatch the calling thread runs, if any.

Each ubatch thread of a running overlap is *registered* with a `UBatchContext` for
exactly the duration of its run. The context lives in a `threading.local`, so a
lookup is one attribute read, it never needs a lock, and a thread that was never
registered (the caller, a data-loader thread, a thread the user started inside a
ubatch) simply sees no context and behaves as outside an overlap.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UBatchContext:
    """What a registered ubatch thread knows about itself."""

    ubatch_id: int
    """This thread's ubatch id, 0 .. num_ubatches - 1."""
    num_ubatches: int
    """How many ubatches the running overlap has."""
    scheduler: Any = None
    """The run's baton scheduler; None for a bare registration (tests, workspace slots)."""

    def __post_init__(self) -> None:
        if not 0 <= self.ubatch_id < self.num_ubatches:
            raise ValueError(
                f"ubatch_id must be in [0, {self.num_ubatches}), got {self.ubatch_id}"
            )


class _ThreadState(threading.local):
    context: UBatchContext | None = None
    registration: int = 0
    """The number of this thread's current registration (unique in the process); 0
    while it is not registered."""


_state = _ThreadState()
_count_lock = threading.Lock()
_num_registered = 0
_threads: dict[int, int] = {}
"""The registered threads' registration numbers by `threading.get_ident()`, for
questions about *another* thread (the workspace asks whether a slot's last user still
runs the registration it asked from). Numbers, not contexts: a holder of one keeps
nothing of the run alive."""
_registration_numbers = itertools.count(1)


def _after_fork_in_child() -> None:
    """In the child after `os.fork()` (its only thread is the one that forked): a fork
    from inside a ubatch runs the rest of that ubatch's function outside any overlap
    (`dbo.yield_()` is then a no-op, rather than a wait for a baton the parent's
    threads pass), and the count lock, which another thread may have held at the fork,
    is replaced. The registration's exit still balances the count."""
    global _count_lock, _num_registered, _threads
    _count_lock = threading.Lock()
    _num_registered = 1 if _state.context is not None else 0
    _state.context = None
    _state.registration = 0
    _threads = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def current_context() -> UBatchContext | None:
    """The calling thread's context, or None outside a ubatch thread."""
    return _state.context


def current_registration() -> int:
    """The calling thread's registration number (see `registered`); 0 outside one."""
    return _state.registration


def registration_of_thread(thread_ident: int) -> int:
    """The registration number of the thread `thread_ident` now; 0 if not registered."""
    return _threads.get(thread_ident, 0)


def num_registered_threads() -> int:
    """How many threads are registered right now (0 when no overlap runs)."""
    return _num_registered


class registered:  # noqa: N801 - used like the function-style context managers
    """`with registered(context):` registers the calling thread as `context.ubatch_id`
    for the body's duration (the `with` value is the context).

    Raises RuntimeError if the thread is already registered: a thread runs one ubatch
    at a time. The registration is removed on exit, even when the body raises. A class,
    not a generator: it runs in every ubatch thread of every overlap call.
    """

    __slots__ = ("_context",)

    def __init__(self, context: UBatchContext) -> None:
        self._context = context

    def __enter__(self) -> UBatchContext:
        global _num_registered
        if _state.context is not None:
            raise RuntimeError(
                f"this thread already runs ubatch {_state.context.ubatch_id}; "
                "a thread can be registered for one ubatch at a time"
            )
        _state.context = self._context
        with _count_lock:
            _num_registered += 1
            number = next(_registration_numbers)
            _threads[threading.get_ident()] = number
        _state.registration = number
        return self._context

    def __exit__(self, *exc_info: object) -> None:
        global _num_registered
        _state.context = None
        _state.registration = 0
        with _count_lock:
            _num_registered -= 1
            _threads.pop(threading.get_ident(), None)
