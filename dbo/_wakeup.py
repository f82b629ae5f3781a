"""Wake-ups between threads that take turns holding the GIL.

A thread parked on a `_thread` lock wakes the moment another thread releases the lock,
and its first act is to ask for the GIL, which the releasing thread still holds: it
sleeps again until the releaser blocks in its turn. On one core that is three context
switches for one handoff (to the woken thread, back, and to it again), each several
microseconds of the core that the overlapped ubatch and gloo's transfers share.

`Wakeup.set()` on Linux writes an eventfd, and Python drops the GIL around that write:
the woken thread finds the GIL free and runs at once (one switch). The setter then
waits for the GIL until the woken thread blocks or yields, which the baton's setters do
right away anyway: they park next. Elsewhere a `_thread` lock does the same job, with
the extra switches.

Contract (both kinds): `set()` from any thread; sets before a `wait()` coalesce into
one; `wait()` by one thread at a time, which blocks until a set and consumes it. No
timeout: a waiter that must give up is woken by a `set()` from whoever gives up on it
(the baton's abort), never left parked.
"""

from __future__ import annotations

import _thread
import os


class _LockWakeup:
    """A held lock is "not set"; `set()` releases it, `wait()` takes it back."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        try:  # noqa: SIM105 - cheaper than contextlib.suppress on the per-handoff path
            self._lock.release()
        except RuntimeError:  # already set: sets coalesce
            pass

    def wait(self) -> None:
        self._lock.acquire()


class _EventfdWakeup:
    """An eventfd counter: `set()` adds 1 with the GIL released; `wait()` blocks until
    it is non-zero and resets it to 0 (so several sets wake one wait)."""

    __slots__ = ("_fd",)

    def __init__(self) -> None:
        self._fd = os.eventfd(0)  # close-on-exec by default

    def set(self) -> None:
        os.eventfd_write(self._fd, 1)

    def wait(self) -> None:
        os.eventfd_read(self._fd)

    def __del__(self) -> None:
        # Only when nothing refers to it any more: no thread can be blocked on the fd
        # (a waiter's frame holds the object), so no other thread can see it reused.
        try:  # noqa: SIM105 - no contextlib import to rely on at interpreter exit
            os.close(self._fd)
        except (OSError, AttributeError, TypeError):  # AttributeError: at exit, os gone
            pass


def _eventfd_works() -> bool:
    if not hasattr(os, "eventfd"):
        return False
    try:
        _EventfdWakeup().set()
    except OSError:  # a sandbox without eventfd(2)
        return False
    return True


Wakeup: type[_LockWakeup] | type[_EventfdWakeup] = (
    _EventfdWakeup if _eventfd_works() else _LockWakeup
)
"""The kind this platform gets: eventfd on Linux, a lock elsewhere."""

KINDS = (_LockWakeup, _EventfdWakeup) if Wakeup is _EventfdWakeup else (_LockWakeup,)
"""Every kind that works here (the tests run the baton on each)."""
