"""Errors raised by the ubatch runtime."""

from __future__ import annotations

import contextlib


class UBatchAbortedError(RuntimeError):
    """Raised at a yield point of a ubatch whose overlap is being aborted.

    Another ubatch failed (or the watchdog fired); this ubatch is woken with this error so
    that its `finally` blocks run and its thread is not left parked. The caller of the
    overlap sees the original failure, not this error.
    """


class OverlapTimeoutError(RuntimeError):
    """A ubatch held the baton longer than the overlap's `timeout_s`.

    The message names the ubatch and shows its stack at the moment the watchdog fired.
    """

    def __init__(self, message: str, ubatch_id: int | None = None) -> None:
        super().__init__(message)
        self.ubatch_id = ubatch_id


def describe(error: BaseException) -> str:
    """`"Type: message"` for an abort reason or a log line; never raises.

    An exception's `__str__` may fail (one unpickled without the attributes it formats,
    one that returns a non-string): a runtime that formats it while unwinding a failed
    ubatch must not fail in turn, or the other ubatches are never aborted.
    """
    name = type(error).__name__
    try:
        return f"{name}: {error}"
    except Exception:  # noqa: BLE001 - any failure of a user's __str__
        return f"{name} (its str() failed)"


def add_note(error: BaseException, note: str) -> None:
    """Add `note` to `error` (shown under its traceback) unless it already has it: the
    same exception object raised again by a later call keeps one copy.

    Never raises: `error` is what the caller must get. `__notes__` that code set to
    something other than a list (a tuple), which `add_note` refuses, become a list of
    the notes they held (when they are a tuple or list of strings) plus this one."""
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        if note in notes:
            return
        if hasattr(error, "add_note"):
            with contextlib.suppress(Exception):
                error.add_note(note)
                return
    # No notes yet, notes that `add_note` refuses, or Python 3.10 (no `add_note`): set
    # the list, keeping the notes that were strings.
    kept = []
    if isinstance(notes, (tuple, list)):
        kept = [item for item in notes if isinstance(item, str)]
    if note in kept:
        return
    with contextlib.suppress(AttributeError, TypeError):
        error.__notes__ = [*kept, note]  # type: ignore[attr-defined]


def attach_ubatch_id(error: BaseException, ubatch_id: int, num_ubatches: int) -> None:
    """Record on `error` which ubatch raised it: a note, and a `ubatch_id` attribute."""
    add_note(error, f"raised in ubatch {ubatch_id} of {num_ubatches} (dbo overlap)")
    # Exception types without a __dict__ keep only the note.
    with contextlib.suppress(AttributeError, TypeError):
        error.ubatch_id = ubatch_id  # type: ignore[attr-defined]
