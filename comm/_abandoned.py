"""Collectives left in flight by an aborted ubatch, settled before the process ends.

A ubatch aborted (another one raised) at a yield while its collective is in flight never
waits it: the error must reach the caller at once, and a wait could last the group's
timeout. The backend still runs the collective (gloo in its worker threads), and a
process that exited while one was still running there ended in SIGABRT ("terminate
called without an active exception") in about 1 of 6 runs of a 2-rank failure test
instead of exiting with its error. So such a collective is kept here, and `settle()`
(at exit, and in `comm.destroy_distributed`) waits until it is over, for a bounded time:
a peer that died ends it at once (connection closed), a live one that diverged by the
group's timeout. Kept: the blocking call's Work when the yield after its launch raises,
and the Work of any async handle dropped before it was waited (`CollectiveWork`).

Host-side (gloo) collectives only: an NCCL collective runs on the GPU, its Work reports
completion only once the watchdog has ended it at the group's timeout, and keeping it
would keep its GPU tensors too; NCCL's own teardown handles what is in flight.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

EXIT_WAIT_S = 30.0
"""The longest `settle()` waits at exit for abandoned collectives (seconds)."""

_lock = threading.Lock()
_works: list[Any] = []
_settle_at_exit_registered = False


def abandon(work: Any) -> None:
    """Keep `work` (a torch.distributed Work still in flight) until `settle()`."""
    global _settle_at_exit_registered
    if _over(work):
        return
    with _lock:
        _works[:] = [kept for kept in _works if not _over(kept)]  # bounded by what runs
        _works.append(work)
        if not _settle_at_exit_registered:
            atexit.register(settle)
            _settle_at_exit_registered = True


def settle(timeout_s: float = EXIT_WAIT_S) -> int:
    """Wait until every abandoned collective is over, at most `timeout_s` seconds.

    Returns how many are still in flight (kept for a later call). Never raises: an
    abandoned collective's failure was the reason, or a consequence, of the abort.
    """
    # The list stays in place while it is polled: an interrupt (Ctrl-C during
    # `destroy_distributed()`) must not lose what the exit-time settle still waits for.
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            _works[:] = [work for work in _works if not _over(work)]
            remaining = len(_works)
        if not remaining or time.monotonic() >= deadline:
            return remaining
        time.sleep(0.001)


def in_flight() -> int:
    """How many abandoned collectives are kept (for tests and diagnostics)."""
    with _lock:
        return len(_works)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's collectives in flight (their Works never
    complete there), and a lock another thread held at the fork would never be
    released."""
    global _lock
    _lock = threading.Lock()
    _works.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _over(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a Work that cannot say is treated as over
        return True
