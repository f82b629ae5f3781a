"""Wake-ups between threads that take turns holding the GIL.

A thread woken through a `_thread` lock first asks for the GIL, which the waker still
holds, and sleeps again until the waker blocks: extra context switches per handoff.
`EventfdWakeup.set()` writes an eventfd with the GIL released, so the woken thread finds
it free and runs at once. Linux gets eventfd wake-ups; other platforms get locks.

Contract (both kinds): `set()` from any thread; sets before a `wait()` coalesce into one;
`wait()` by one thread at a time blocks until a set and consumes it. No timeout: whoever
gives up on a waiter wakes it with `set()` (the baton's abort), never leaves it parked.
"""

from __future__ import annotations

import _thread
import functools
import os


class LockWakeup:
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


class EventfdWakeup:
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
        # Only once nothing refers to it: no thread can be blocked on the fd.
        try:  # noqa: SIM105 - no contextlib to rely on at interpreter exit
            os.close(self._fd)
        except (OSError, AttributeError, TypeError):  # AttributeError: at exit, os gone
            pass


Wakeup = LockWakeup | EventfdWakeup


@functools.cache
def kinds() -> tuple[type[LockWakeup] | type[EventfdWakeup], ...]:
    """Every kind that works here, the preferred last; probed once, on first use."""
    try:
        EventfdWakeup().set()
    except (AttributeError, OSError):  # not Linux (no os.eventfd), or no eventfd(2) allowed
        return (LockWakeup,)
    return (LockWakeup, EventfdWakeup)


def new_wakeup() -> Wakeup:
    """A wake-up of the preferred kind for this platform."""
    return kinds()[-1]()
