"""Collectives left in flight by an aborted ubatch (gloo only: NCCL's teardown handles its
own), kept until `settle()` sees them over: at exit (`dbo.wait_at_exit`) and in
`comm.destroy_distributed`. The error reaches the caller at once, but gloo still runs
them, and a process that ends meanwhile ends in SIGABRT. A forked child keeps none.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dbo

_lock = threading.Lock()
_works: list[Any] = []


def abandon(work: Any) -> None:
    """Keep `work` (a torch.distributed Work still in flight) until `settle()`."""
    if is_over(work):
        return
    with _lock:
        _works[:] = [kept for kept in _works if not is_over(kept)]
        _works.append(work)
    dbo.wait_at_exit(settle)


def settle(timeout_s: float = 30.0) -> int:
    """Wait until every abandoned collective is over, at most `timeout_s` seconds; return
    how many are still in flight (kept for a later call). Never raises: an abandoned
    collective's failure is the reason, or a consequence, of the abort."""
    # Filtered in place: a Ctrl-C here keeps what the exit wait still has to wait for.
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
