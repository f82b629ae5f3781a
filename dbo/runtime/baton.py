"""The baton: exactly one ubatch thread of an overlap runs Python at a time.

A ubatch gives the baton away only at a yield point or when it finishes, and always to
the next live ubatch of the ring 0 -> 1 -> ... -> n-1 -> 0. That makes the order in
which ubatches launch kernels and collectives the same on every rank and every run,
which is what keeps collectives matched across ranks.

Each ubatch parks on its own wake-up (`dbo.runtime.wakeup`); handing the baton to ubatch j is
one set of j's wake-up. A small mutex guards the bookkeeping so that the caller's
watchdog can inspect and abort a run from outside.
"""

from __future__ import annotations

import _thread
import time
from collections.abc import Sequence

from dbo import tracing
from dbo._checks import lock_timeout
from dbo._torch_private import profiling
from dbo.errors import UBatchAbortedError
from dbo.runtime.wakeup import Wakeup, new_wakeup


class Baton:
    """The baton of one overlap run of `num_ubatches` ubatches.

    Protocol: every ubatch thread calls `wait_turn(i)` before running, `yield_(i)` at its
    yield points, and `finish(i)` exactly once at the end. The caller calls `start()` and
    then `wait_done()`.
    """

    def __init__(self, num_ubatches: int, wakeups: Sequence[Wakeup] | None = None) -> None:
        """`wakeups`: one per ubatch, which its thread parks on; by default new ones. A
        runner passes its workers' own, which they also park on between runs, so that
        getting the baton is what starts a worker's job."""
        self.num_ubatches = num_ubatches
        self._mutex = _thread.allocate_lock()
        self._wake = list(wakeups) if wakeups is not None else [
            new_wakeup() for _ in range(num_ubatches)
        ]
        if len(self._wake) != num_ubatches:
            raise ValueError(f"need {num_ubatches} wake-ups, got {len(self._wake)}")
        self._live = [True] * num_ubatches
        self._num_live = num_ubatches
        self._done = _thread.allocate_lock()  # held until every ubatch has finished
        self._done.acquire()
        self._finished = False  # set before `_done` is released
        self.aborted = False
        self.abort_reason = ""
        self._forced = False  # an abort that unwinds every ubatch at once, not in ring order
        self.holder: int | None = None
        """The ubatch holding the baton (None before start and after the last finish)."""
        self.holder_since = time.perf_counter()
        """When `holder` got the baton or last yielded alone: the watchdog's clock."""
        self.num_turns = 0
        """Turns started, lone yields included: the watchdog's sign of progress."""
        self._turn_start: list[float | None] = [None] * num_ubatches
        """When each ubatch's thread last woke holding the baton (None: never): where a
        traced turn starts, so that a wake-up's latency is a gap between turns."""
        self._ranges: list[object] = [None] * num_ubatches  # torch.profiler turn ranges

    # ------------------------------------------------------------------ caller side
    def start(self) -> None:
        """Give the baton to ubatch 0; call once every ubatch's thread can see its job.
        If the run was aborted already (`close()`), wake every live ubatch instead: that
        abort's wake-ups may have come before the jobs did."""
        with self._mutex:
            if self.aborted:
                self._forced = True
                woken = [i for i, live in enumerate(self._live) if live]
            else:
                self._make_holder(0)
                woken = [0]
        for ubatch_id in woken:
            self._wake[ubatch_id].set()

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until every ubatch has finished; False if `timeout_s` passed first."""
        if self._finished:  # also after an interrupt between the acquire and the release
            return True
        if self._done.acquire(timeout=lock_timeout(timeout_s)):
            self._done.release()  # stay "done" for any later query
            return True
        return self._finished

    def abort(self, reason: str, wake_all: bool = False) -> None:
        """Mark the run aborted: every ubatch raises `UBatchAbortedError` at its next yield.

        Without `wake_all` (a ubatch failed), the others unwind one at a time, each when
        the baton reaches it. With `wake_all` (the watchdog, an interrupted caller,
        `close()`), every live ubatch is woken at once, the holder too (it may be parked
        in its first wait), since the holder may never hand the baton on.
        """
        with self._mutex:
            if not self.aborted:
                self.aborted = True
                self.abort_reason = reason
            if wake_all:
                self._forced = True
            woken = [i for i, live in enumerate(self._live) if wake_all and live]
        for ubatch_id in woken:
            self._wake[ubatch_id].set()

    # ------------------------------------------------------------------ ubatch side
    def wait_turn(self, ubatch_id: int) -> None:
        """Park until `ubatch_id` holds the baton (or a forced abort); raise if aborted.

        A wake-up is only a hint, `holder` is the truth: a set left over from an earlier
        abort wakes a thread whose turn it is not, and it parks again. A plain abort
        does not end the wait: each ubatch unwinds in its turn, not alongside the holder.
        """
        wake = self._wake[ubatch_id]
        while self.holder != ubatch_id and not self._forced:
            wake.wait()
        self._turn_start[ubatch_id] = time.perf_counter()
        if self.aborted:
            raise UBatchAbortedError(f"ubatch {ubatch_id} aborted: {self.abort_reason}")
        if profiling():  # a torch.profiler profile shows the turn
            self._ranges[ubatch_id] = tracing.begin_range(ubatch_id, "turn")

    def yield_(self, ubatch_id: int) -> None:
        """Hand the baton to the next live ubatch and park until it comes back.

        Returns at once if `ubatch_id` is the only live ubatch (restarting the
        watchdog's clock: `holder_since`).
        """
        if self.aborted:
            raise UBatchAbortedError(f"ubatch {ubatch_id} aborted: {self.abort_reason}")
        # The hot path of every handoff: the common case (the next ubatch is live) inline.
        with self._mutex:
            assert self.holder == ubatch_id, (
                f"ubatch {ubatch_id} yielded without holding the baton (holder: "
                f"{self.holder}); only one ubatch may run at a time, or launch order "
                "differs between ranks"
            )
            successor = ubatch_id + 1 if ubatch_id + 1 < self.num_ubatches else 0
            if not self._live[successor]:
                successor = self._next_live(ubatch_id)
            if successor == ubatch_id:
                # Left alone: nobody to hand the baton to, but a yield point is still
                # progress, and the watchdog bounds the time between two of them.
                self._make_holder(ubatch_id)
                return
            now = time.perf_counter()
            self._end_turn(ubatch_id, now)
            self.holder = successor
            self.holder_since = now
            self.num_turns += 1
        # Wake the successor and park at once. Never wake under the mutex: on one core
        # the woken thread runs at once and would block on the mutex straight away.
        self._wake[successor].set()
        self.wait_turn(ubatch_id)

    def finish(self, ubatch_id: int) -> None:
        """`ubatch_id` is done: pass the baton on if it held it, and signal the caller if
        it was the last. Idempotent. A ubatch that did not hold the baton (a revoked job,
        one woken by a forced abort) passes nothing on."""
        successor = None
        with self._mutex:
            if not self._live[ubatch_id]:
                return  # counted already (a revoked job, counted again after an interrupt)
            held = self.holder == ubatch_id
            self._end_turn(ubatch_id, time.perf_counter() if held else None)
            self._live[ubatch_id] = False
            self._num_live -= 1
            last = self._num_live == 0
            if last:
                self.holder = None
                self._finished = True
            elif held:
                successor = self._next_live(ubatch_id)
                self._make_holder(successor)
        if last:
            self._done.release()
        elif successor is not None:
            self._wake[successor].set()

    # ------------------------------------------------------------------ internals
    def _end_turn(self, ubatch_id: int, now: float | None) -> None:
        """End `ubatch_id`'s turn at `now` (None: it held none) on the `dbo.trace()`
        timeline, if it ran one, and its profiler range (call with the mutex held)."""
        recording, started = tracing.recording, self._turn_start[ubatch_id]
        if recording is not None and now is not None and started is not None:
            recording.add("baton", ubatch_id, started, now)
        if self._ranges[ubatch_id] is not None:
            tracing.end_range(self._ranges[ubatch_id])
            self._ranges[ubatch_id] = None

    def _next_live(self, ubatch_id: int) -> int:
        for step in range(1, self.num_ubatches + 1):
            candidate = (ubatch_id + step) % self.num_ubatches
            if self._live[candidate]:
                return candidate
        raise AssertionError("no live ubatch left; finish() handles the last one")

    def _make_holder(self, ubatch_id: int) -> None:
        """Make `ubatch_id` the holder (call with the mutex held; wake it after)."""
        self.holder = ubatch_id
        self.holder_since = time.perf_counter()
        self.num_turns += 1
