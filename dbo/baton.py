"""The baton: exactly one ubatch thread of an overlap runs Python at a time.

A ubatch gives the baton away only at a yield point or when it finishes, and always to
the next live ubatch of the ring 0 -> 1 -> ... -> n-1 -> 0. That makes the order in
which ubatches launch kernels and collectives the same on every rank and every run,
which is what keeps collectives matched across ranks.

Each ubatch parks on its own `_thread` lock (held while the ubatch waits); handing the
baton to ubatch j is one release of j's lock. A small mutex guards the bookkeeping so
that the caller's watchdog can inspect and abort a run from outside.
"""

from __future__ import annotations

import _thread
import threading
import time

from dbo import tracing
from dbo.errors import UBatchAbortedError


def _release_quietly(lock: _thread.LockType) -> None:
    """Release `lock` unless it is already released (a forced wake-up may race a handoff)."""
    try:  # noqa: SIM105 - cheaper than contextlib.suppress on this per-handoff path
        lock.release()
    except RuntimeError:
        pass


class Baton:
    """The baton of one overlap run of `num_ubatches` ubatches.

    Protocol: every ubatch thread calls `wait_turn(i)` before running, `yield_(i)` at its
    yield points, and `finish(i)` exactly once at the end. The caller calls `start()` and
    then `wait_done()`.
    """

    def __init__(self, num_ubatches: int) -> None:
        self.num_ubatches = num_ubatches
        self._mutex = _thread.allocate_lock()
        self._wake = [_thread.allocate_lock() for _ in range(num_ubatches)]
        for lock in self._wake:
            lock.acquire()  # held = "not your turn"
        self._live = [True] * num_ubatches
        self._num_live = num_ubatches
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self.aborted = False
        self.abort_reason = ""
        self.holder: int | None = None
        """The ubatch holding the baton (None before start and after the last finish)."""
        self.holder_since = time.perf_counter()
        """When `holder` got the baton (perf_counter seconds): the watchdog's clock."""
        self.num_handoffs = 0

    # ------------------------------------------------------------------ caller side
    def start(self) -> None:
        """Give the baton to ubatch 0."""
        with self._mutex:
            self._give(0)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until every ubatch has finished; False if `timeout_s` passed first."""
        timeout = -1.0 if timeout_s is None else min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
        if self._done.acquire(timeout=timeout):
            self._done.release()  # stay "done" for any later query
            return True
        return False

    def abort(self, reason: str, wake_all: bool = False) -> None:
        """Mark the run aborted: every ubatch raises `UBatchAbortedError` at its next yield.

        With `wake_all` (the watchdog), also wake every parked ubatch at once, since the
        holder may never hand the baton on; they then unwind concurrently with it.
        """
        with self._mutex:
            if not self.aborted:
                self.aborted = True
                self.abort_reason = reason
            if wake_all:
                for ubatch_id in range(self.num_ubatches):
                    if self._live[ubatch_id] and ubatch_id != self.holder:
                        _release_quietly(self._wake[ubatch_id])

    # ------------------------------------------------------------------ ubatch side
    def wait_turn(self, ubatch_id: int) -> None:
        """Park until `ubatch_id` holds the baton; raise if the run was aborted meanwhile."""
        self._wake[ubatch_id].acquire()
        if self.aborted:
            raise UBatchAbortedError(f"ubatch {ubatch_id} aborted: {self.abort_reason}")

    def yield_(self, ubatch_id: int) -> None:
        """Hand the baton to the next live ubatch and park until it comes back.

        Returns at once if `ubatch_id` is the only live ubatch.
        """
        if self.aborted:
            raise UBatchAbortedError(f"ubatch {ubatch_id} aborted: {self.abort_reason}")
        mutex = self._mutex
        mutex.acquire()
        try:
            assert self.holder == ubatch_id, (
                f"ubatch {ubatch_id} yielded without holding the baton (holder: "
                f"{self.holder}); only one ubatch may run at a time, or launch order "
                "differs between ranks"
            )
            successor = self._next_live(ubatch_id)
            if successor == ubatch_id:
                return
            now = time.perf_counter()
            recording = tracing._active
            if recording is not None:
                recording.add("baton", ubatch_id, self.holder_since, now)
            self.holder = successor
            self.holder_since = now
            self.num_handoffs += 1
        finally:
            mutex.release()
        # Wake the successor and park at once, outside the mutex: the fewer bytecodes
        # between the two, the sooner this thread drops the GIL the successor needs.
        _release_quietly(self._wake[successor])
        self._wake[ubatch_id].acquire()
        if self.aborted:
            raise UBatchAbortedError(f"ubatch {ubatch_id} aborted: {self.abort_reason}")

    def finish(self, ubatch_id: int) -> None:
        """`ubatch_id` is done: pass the baton on, or signal the caller if it was the last."""
        with self._mutex:
            recording = tracing._active
            if recording is not None and self.holder == ubatch_id:
                recording.add("baton", ubatch_id, self.holder_since, time.perf_counter())
            self._live[ubatch_id] = False
            self._num_live -= 1
            if self._num_live == 0:
                self.holder = None
                self._done.release()
                return
            self._give(self._next_live(ubatch_id))

    # ------------------------------------------------------------------ internals
    def _next_live(self, ubatch_id: int) -> int:
        successor = ubatch_id + 1 if ubatch_id + 1 < self.num_ubatches else 0
        if self._live[successor]:
            return successor
        for step in range(1, self.num_ubatches + 1):
            candidate = (ubatch_id + step) % self.num_ubatches
            if self._live[candidate]:
                return candidate
        raise AssertionError("no live ubatch left; finish() handles the last one")

    def _give(self, ubatch_id: int) -> None:
        """Make `ubatch_id` the holder and wake it (call with the mutex held)."""
        self.holder = ubatch_id
        self.holder_since = time.perf_counter()
        self.num_handoffs += 1
        _release_quietly(self._wake[ubatch_id])
