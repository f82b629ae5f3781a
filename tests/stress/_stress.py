"""The stress suite's size: bounded (the default, what `make test` runs) or long.

`DBO_STRESS=long` runs every stress test at full size. Import from a test module in
this folder: `from _stress import LONG, size`.
"""

from __future__ import annotations

import os

MODES = ("bounded", "long")
MODE = os.environ.get("DBO_STRESS", "").strip().lower() or "bounded"
if MODE not in MODES:  # a typo must not run the bounded suite silently
    raise ValueError(f"DBO_STRESS must be one of {', '.join(MODES)} (or unset), got {MODE!r}")
LONG = MODE == "long"
"""Whether the stress tests run at full size."""


def size(bounded: int, long: int) -> int:
    """`long` under `DBO_STRESS=long`, else `bounded`: a count, or a pytest-timeout in s."""
    return long if LONG else bounded
