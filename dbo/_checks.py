"""Argument checks shared by the entries (the runner, `dbo.overlap`, the splitter, the
workspace), and lock timeouts."""

from __future__ import annotations

import math
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


def check_timeout(timeout_s: Any) -> float | None:
    """Validate a watchdog timeout: None or seconds > 0 (infinity means None)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return None if math.isinf(timeout_s) else float(timeout_s)


def lock_timeout(timeout_s: float | None) -> float:
    """A timeout `_thread` locks accept: -1 (forever) for None, at most TIMEOUT_MAX."""
    return -1 if timeout_s is None else min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
