"""Collectives left in flight by an aborted ubatch, settled before the process ends.

An aborted ubatch never waits its in-flight collective (the error reaches the caller at
once), but gloo still runs it, and a process that exits meanwhile ends in SIGABRT. Such
a collective is kept here until `settle()` (at exit, in `comm.destroy_distributed`) sees
it over, waiting a bounded time. gloo only: NCCL's teardown handles its own collectives
(keeping them would keep their GPU tensors). A forked child starts with an empty list.
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
    if is_over(work):
        return
    with _lock:
        _works[:] = [kept for kept in _works if not is_over(kept)]
        _works.append(work)
        if not _settle_at_exit_registered:
            atexit.register(settle)
            _settle_at_exit_registered = True


def settle(timeout_s: float = EXIT_WAIT_S) -> int:
    """Wait until every abandoned collective is over, at most `timeout_s` seconds.

    Returns how many are still in flight (kept for a later call). Never raises: an
    abandoned collective's failure is the reason, or a consequence, of the abort.
    """
    # The list is filtered in place while polled: a Ctrl-C here must not lose what the
    # exit-time settle still waits for.
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            _works[:] = [work for work in _works if not is_over(work)]
            remaining = len(_works)
        if not remaining or time.monotonic() >= deadline:
            return remaining
        time.sleep(0.001)


def in_flight() -> int:
    """How many abandoned collectives are kept (for tests and diagnostics)."""
    with _lock:
        return len(_works)


def is_over(work: Any) -> bool:
    """Whether `work` has completed (a Work that cannot say counts as over)."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - any failure to answer
        return True


def _reset_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _works.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
