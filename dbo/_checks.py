"""Argument checks shared by the runner, the splitter and the workspace, and lock timeouts."""

from __future__ import annotations

import threading
from typing import Any

MAX_NUM_UBATCHES = 1024
"""The most ubatches accepted: each has a thread, two streams and a workspace slot, and
overlap gains nothing past a handful."""


def check_num_ubatches(num_ubatches: Any) -> int:
    """Validate a ubatch count: an int in [1, MAX_NUM_UBATCHES] (TypeError / ValueError
    otherwise)."""
    if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, int):
        raise TypeError(f"num_ubatches must be an int >= 1, got {num_ubatches!r}")
    if not 1 <= num_ubatches <= MAX_NUM_UBATCHES:
        raise ValueError(
            f"num_ubatches must be in [1, {MAX_NUM_UBATCHES}], got {num_ubatches}"
        )
    return num_ubatches


def lock_timeout(timeout_s: float | None) -> float:
    """A timeout `_thread` locks accept: -1 (forever) for None, at most TIMEOUT_MAX."""
    return -1 if timeout_s is None else min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
