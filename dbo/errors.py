"""Errors raised by the ubatch runtime."""

from __future__ import annotations

import contextlib


class UBatchAbortedError(RuntimeError):
    """Raised at a yield point of a ubatch whose overlap is being aborted.

    Another ubatch failed, the watchdog fired, the caller was interrupted or the runner
    was closed: this ubatch unwinds (its `finally` blocks run) instead of staying
    parked. The caller of the overlap sees the original failure, not this error.
    """


class OverlapTimeoutError(RuntimeError):
    """A ubatch held the baton longer than the overlap's `timeout_s`.

    The message names the ubatch and shows its stack at the moment the watchdog fired.
    """

    def __init__(self, message: str, ubatch_id: int | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id


def describe(error: BaseException) -> str:
    """`"Type: message"` for an abort reason or a log line; never raises (a failing
    `__str__` must not keep the other ubatches from being aborted)."""
    name = type(error).__name__
    try:
        return f"{name}: {error}"
    except Exception:  # noqa: BLE001 - any failure of a user's __str__
        return f"{name} (its str() failed)"


def add_note(error: BaseException, note: str) -> None:
    """Add `note` to `error` (shown under its traceback) unless it already has it.

    Never raises: `error` is what the caller must get. `__notes__` that are not a list
    (code may set a tuple) become a list of the strings they held, plus this note."""
    notes = getattr(error, "__notes__", [])
    if not isinstance(notes, list | tuple):
        notes = []
    kept = [item for item in notes if isinstance(item, str)]
    if note not in kept:
        with contextlib.suppress(AttributeError, TypeError):
            error.__notes__ = [*kept, note]  # type: ignore[attr-defined]


def attach_ubatch_id(error: BaseException, ubatch_id: int, num_ubatches: int) -> None:
    """Record on `error` which ubatch raised it: a note, and a `ubatch_id` attribute."""
    add_note(error, f"raised in ubatch {ubatch_id} of {num_ubatches} (dbo overlap)")
    # Exception types without a __dict__ keep only the note.
    with contextlib.suppress(AttributeError, TypeError):
        error.ubatch_id = ubatch_id  # type: ignore[attr-defined]
