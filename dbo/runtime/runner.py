"""`UBatchRunner`: persistent ubatch worker threads that run one overlap at a time."""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dbo._checks import check_num_ubatches, check_timeout, lock_timeout
from dbo.device.backends import DeviceBackend, backend_for
from dbo.device.streams import StreamLease, held_streams
from dbo.errors import OverlapTimeoutError, attach_ubatch_id
from dbo.runtime import affinity, thread_settings
from dbo.runtime.context import current_context
from dbo.runtime.exit import wait_at_exit
from dbo.runtime.run import OverlapRun, UBatchStreams
from dbo.runtime.stream_device import streams_device
from dbo.runtime.worker import UBatchJob, Worker, stop_workers
from dbo.split.batch import UBatchInputs, checked_ubatch_inputs

_ABORT_GRACE_S = 0.5
"""How long an aborted run's ubatches get to unwind before the runner is left broken."""


class RunnerState(enum.Enum):
    """The lifecycle of a `UBatchRunner`. BROKEN: a ubatch of an aborted run (watchdog,
    interrupt) still runs, and runs are refused until it returns. CLOSED: the workers
    are stopped (or stop once their ubatch returns), and runs are refused."""

    IDLE = "idle"
    RUNNING = "running"
    BROKEN = "broken"
    CLOSED = "closed"


_TRANSITIONS: dict[RunnerState, frozenset[RunnerState]] = {
    RunnerState.IDLE: frozenset({RunnerState.RUNNING, RunnerState.CLOSED}),
    RunnerState.RUNNING: frozenset({RunnerState.IDLE, RunnerState.BROKEN, RunnerState.CLOSED}),
    RunnerState.BROKEN: frozenset({RunnerState.IDLE, RunnerState.CLOSED}),
    RunnerState.CLOSED: frozenset(),
}


class UBatchRunner:
    """Runs a callable once per ubatch, in persistent worker threads, passing the baton.

    Args:
        num_ubatches: how many ubatches (and worker threads), in [1, 1024].
        device: where the ubatches' streams live. None: the device of the first CUDA
            tensor in each run's inputs (CPU when there is none).

    The workers (daemon threads) live until `close()`, garbage collection of the runner,
    or interpreter exit. Runs are serialized: a thread that a ubatch starts and waits for
    must not call `run` on the same runner (`dbo.overlap` leases another). A context
    manager closes it. In a process forked after the runner was created, `run` raises
    RuntimeError and `close` does nothing; forking from inside a ubatch is unsupported.
    """

    def __init__(self, num_ubatches: int = 2, device: torch.device | str | int | None = None):
        self.num_ubatches = check_num_ubatches(num_ubatches)
        self.device = None if device is None else torch.device(device)
        self.cpus = affinity.cpus_of_this_thread()
        """The CPUs of the creating thread, which the workers keep (None: not Linux)."""
        self._pid = os.getpid()
        self._run_lock = threading.Lock()  # held for the whole of a run
        self._mutex = threading.Lock()
        """Guards `_state`, `_run` and `_jobs` (`close()` reads them during a run)."""
        self._state = RunnerState.IDLE
        self._run: OverlapRun | None = None
        """The run in progress (RUNNING), or the aborted run still running (BROKEN)."""
        self._jobs: list[UBatchJob] = []
        self._streams: dict[
            torch.device, tuple[DeviceBackend, list[UBatchStreams], StreamLease]
        ] = {}
        self._workers = [
            Worker(f"dbo-ubatch-{i}-of-{self.num_ubatches}", self.cpus)
            for i in range(self.num_ubatches)
        ]
        try:
            for worker in self._workers:
                worker.thread.start()
        except BaseException:
            # An interrupt while a thread starts: nothing will refer to this runner.
            stop_workers(self._workers, self._pid)
            raise
        # A runner dropped without close() must not leave its threads parked forever.
        weakref.finalize(self, stop_workers, self._workers, self._pid)

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> RunnerState:
        """The runner's state (a broken runner whose stuck ubatch returned reads IDLE)."""
        with self._mutex:
            self._recover_if_ended()
            return self._state

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for diagnostics and tests)."""
        return [worker.thread for worker in self._workers]

    def _set_state(self, new: RunnerState) -> None:
        """The one place the state changes; call with `_mutex` held."""
        assert new in _TRANSITIONS[self._state], (
            f"UBatchRunner cannot go from {self._state.name} to {new.name}"
        )
        self._state = new
        if new is not RunnerState.RUNNING and new is not RunnerState.BROKEN:
            self._run, self._jobs = None, []

    def _recover_if_ended(self) -> None:
        """BROKEN -> IDLE once every ubatch of the aborted run has ended (`_mutex` held)."""
        run = self._run
        if self._state is not RunnerState.BROKEN or run is None:
            return
        _finish_revoked(run, self._jobs)
        if run.baton.wait_done(0):
            self._set_state(RunnerState.IDLE)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the worker threads; idempotent.

        Waits up to `timeout_s` for a run in progress (in another thread) to end; past
        that, the run is aborted (its ubatches raise `UBatchAbortedError` at their next
        yield point) and the workers end when their ubatches return. Then joins each
        worker for up to `timeout_s`. Raises RuntimeError when called from one of this
        runner's own ubatch threads (that run could never end).
        """
        self._refuse_own_ubatch_thread("close")
        if os.getpid() != self._pid:
            return  # the workers are the parent's
        acquired = self._run_lock.acquire(timeout=lock_timeout(timeout_s))
        try:
            with self._mutex:
                previous, run = self._state, self._run
                if previous is not RunnerState.CLOSED:
                    self._set_state(RunnerState.CLOSED)
        finally:
            if acquired:
                self._run_lock.release()
        if previous is RunnerState.CLOSED:
            return
        if previous is RunnerState.RUNNING:
            assert run is not None, "a RUNNING runner has a run"
            run.baton.abort("the runner was closed", wake_all=True)
            return  # the run stops the workers when it ends (`_end`)
        stop_workers(self._workers, self._pid)
        if previous is RunnerState.IDLE:
            self._release_streams()
            for worker in self._workers:
                worker.thread.join(lock_timeout(timeout_s))

    def _release_streams(self) -> None:
        """Give the streams back: no run of this closed runner runs on them any more."""
        for _, _, lease in self._streams.values():
            lease.release()

    def _refuse_own_ubatch_thread(self, what: str) -> None:
        context = current_context()
        run = context.run if context is not None else None
        nested = False
        while run is not None:
            if run.owner is self:
                where = "a run nested in one of its own" if nested else "one of its own"
                raise RuntimeError(
                    f"UBatchRunner.{what} was called from a ubatch thread of {where} runs, "
                    f"which would wait for itself; a nested overlap runs inline "
                    f"(dbo.overlap does this)"
                )
            run, nested = run.parent, True

    def __enter__(self) -> UBatchRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ running
    def run(
        self,
        fn: Callable[..., Any],
        ubatch_inputs: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        *,
        timeout_s: float | None = None,
        device: torch.device | None = None,
        backward_per_ubatch: bool = False,
    ) -> list[Any]:
        """Run `fn(*args_i, **kwargs_i)` in ubatch thread i; return the outputs in order.

        `backward_per_ubatch`: the caller runs each ubatch's autograd backward as its own
        sequence (`dbo.overlap`'s node does), so `dbo.backward_state()` is per ubatch.

        `device` picks the ubatch streams for this run when the runner has none of its
        own; by default, the device of the first CUDA tensor in the inputs (else CPU). A
        bare "cuda" is the calling thread's current device; a CUDA input on another
        device than the streams raises ValueError. The streams are the runner's, none of
        them another live runner's (RuntimeError when the device cannot give that many).

        Threading: ubatch 0 starts; a ubatch passes the baton to the next live ubatch only
        at a yield point or when `fn` returns or raises. Each ubatch thread runs with the
        caller's torch settings (`dbo.runtime.thread_settings`).

        Streams (CUDA): ubatch i starts on its compute stream, which waits for the
        caller's current stream; before `run` returns, the caller's current stream waits
        for every ubatch's compute and comm streams. No host synchronization.

        Errors: if a ubatch raises, the others raise `UBatchAbortedError` at their next
        yield point, and `run` re-raises the first failure with a note and a `ubatch_id`
        attribute naming its ubatch. With `timeout_s`, a ubatch holding the baton longer
        raises `OverlapTimeoutError` here, with its stack; one still running 0.5 s later
        leaves the runner BROKEN until it returns. RuntimeError if closed or broken.
        """
        timeout_s = check_timeout(timeout_s)
        inputs = checked_ubatch_inputs(ubatch_inputs, self.num_ubatches, "ubatch_inputs")
        self._refuse_own_ubatch_thread("run")
        if os.getpid() != self._pid:  # before the run lock, which the fork may have copied held
            raise RuntimeError(
                "this UBatchRunner was created before os.fork(): its worker threads exist "
                "only in the parent process. Create a new UBatchRunner in this process "
                "(dbo.overlap does so by itself)"
            )
        with self._run_lock:
            run = self._new_run(inputs, device)
            if backward_per_ubatch:
                run.backward_states = [{} for _ in range(self.num_ubatches)]
            results: list[Any] = [None] * self.num_ubatches
            errors: list[BaseException | None] = [None] * self.num_ubatches
            settings = thread_settings.capture()
            jobs = [
                UBatchJob(run, ubatch_id, fn, args, kwargs, settings, results, errors)
                for ubatch_id, (args, kwargs) in enumerate(inputs)
            ]
            try:
                self._begin(run, jobs)
                try:
                    for worker, job in zip(self._workers, jobs):
                        worker.submit(job)
                    run.baton.start()
                    self._wait(run, timeout_s)
                except BaseException as error:  # the watchdog, an interrupt
                    self._abort(run, jobs, error)
                    raise
            finally:
                self._end(run, jobs)
            return self._collect(run, results, errors)

    def _new_run(self, inputs: UBatchInputs, device: torch.device | None) -> OverlapRun:
        """A run on this runner's streams for the device (see `run`), forked from the
        caller's current stream."""
        device = streams_device(inputs, self.device or device)  # the runner's own first
        if device not in self._streams:
            backend = backend_for(device)
            lease = held_streams.lease(backend, 2 * self.num_ubatches)
            drawn = lease.streams  # (compute, comm) of ubatch 0, then of ubatch 1, ...
            streams = [UBatchStreams(*pair) for pair in zip(drawn[::2], drawn[1::2])]
            self._streams[device] = (backend, streams, lease)
        backend, streams, lease = self._streams[device]
        context = current_context()
        run = OverlapRun(
            self.num_ubatches, backend, streams, owner=self,
            wakeups=[worker.wake for worker in self._workers],
            parent=context.run if context is not None else None,
        )
        run.stream_lease = lease
        run.caller_stream = backend.current_stream()
        run.fork_event = backend.record_event(run.caller_stream)
        return run

    def _begin(self, run: OverlapRun, jobs: list[UBatchJob]) -> None:
        """IDLE -> RUNNING with `run`; RuntimeError if the runner is closed or broken."""
        with self._mutex:
            self._recover_if_ended()
            if self._state is RunnerState.CLOSED:
                raise RuntimeError("this UBatchRunner is closed; create a new one")
            if self._state is RunnerState.BROKEN:
                holder = self._run.baton.holder if self._run is not None else None
                raise RuntimeError(
                    f"this UBatchRunner is unusable until its aborted run ends: ubatch "
                    f"{holder} was still running {_ABORT_GRACE_S} s after the abort"
                )
            self._set_state(RunnerState.RUNNING)
            self._run, self._jobs = run, jobs

    def _end(self, run: OverlapRun, jobs: list[UBatchJob]) -> None:
        """RUNNING -> IDLE, or BROKEN while a ubatch of the aborted run still runs; the
        workers of a runner closed during the run stop now."""
        with self._mutex:
            if self._state is RunnerState.RUNNING and self._run is run:
                # An interrupt before the baton started leaves jobs that must never run.
                _finish_revoked(run, jobs)
                ended = run.baton.wait_done(0)
                self._set_state(RunnerState.IDLE if ended else RunnerState.BROKEN)
            closed = self._state is RunnerState.CLOSED
        if closed:
            stop_workers(self._workers, self._pid)
            if run.baton.wait_done(0):
                self._release_streams()

    def _abort(self, run: OverlapRun, jobs: list[UBatchJob], error: BaseException) -> None:
        """No ubatch may stay parked: abort (a job the baton reaches from here on unwinds),
        count the jobs that never started as finished, wake every ubatch, and give them
        `_ABORT_GRACE_S` to unwind."""
        reason = (
            "the watchdog fired" if isinstance(error, OverlapTimeoutError)
            else f"the caller was interrupted ({type(error).__name__})"
        )
        run.baton.abort(reason)
        _finish_revoked(run, jobs)
        run.baton.abort(reason, wake_all=True)
        if run.baton.wait_done(_ABORT_GRACE_S):
            run.drop_leftovers()
            run.join_caller_stream(best_effort=True)
            return
        baton = run.baton  # not the run: it holds the streams until it is freed
        wait_at_exit(lambda s: not baton.wait_done(s))
        # Best effort: the caller's stream waits for what the ubatches enqueued so far,
        # so that it does not reuse the inputs under their kernels.
        run.order_after_every_ubatch(run.caller_stream)

    def _collect(
        self, run: OverlapRun, results: list[Any], errors: list[BaseException | None]
    ) -> list[Any]:
        """The outputs of a run that ended, or its first failure, re-raised."""
        # Else no ubatch failed on its own: they raised the abort of a close() (if any).
        failure = run.first_failure or next(
            ((ubatch_id, e) for ubatch_id, e in enumerate(errors) if e is not None), None
        )
        run.join_caller_stream(best_effort=failure is not None)
        if failure is None:
            run.backend.hand_over(results, run.caller_stream)
            return results
        run.drop_leftovers()
        # Nothing may keep the error once it is raised: the frames on its traceback hold
        # the call's inputs and activations, and a cycle would keep them until a gc pass
        # (a caller that retries after an out-of-memory error needs them freed at once).
        run.first_failure = None
        errors.clear()
        ubatch_id, error = failure
        del failure
        attach_ubatch_id(error, ubatch_id, self.num_ubatches)
        try:
            raise error
        finally:
            del error

    def _wait(self, run: OverlapRun, timeout_s: float | None) -> None:
        """Wait for the run to end; with `timeout_s`, watch how long the holder holds."""
        baton = run.baton
        if timeout_s is None:
            baton.wait_done()
            return
        while True:
            turns, holder, since = baton.num_turns, baton.holder, baton.holder_since
            remaining = since + timeout_s - time.perf_counter()
            if remaining > 0:
                if baton.wait_done(remaining):
                    return
                continue
            if baton.num_turns != turns or baton.wait_done(0):
                continue  # the baton moved (or the run ended) while we looked
            raise OverlapTimeoutError(
                f"ubatch {holder} of {self.num_ubatches} held the baton for "
                f"{time.perf_counter() - since:.2f} s, longer than timeout_s={timeout_s}; "
                f"the other ubatches were aborted. Its stack:\n{self._stack_of(holder)}",
                ubatch_id=holder,
            )

    def _stack_of(self, ubatch_id: int | None) -> str:
        if ubatch_id is None:
            return "  (no ubatch held the baton)"
        ident = self._workers[ubatch_id].thread.ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return "  (the thread has no Python frame)"
        return "".join(traceback.format_stack(frame))


def _finish_revoked(run: OverlapRun, jobs: list[UBatchJob]) -> None:
    """Revoke the jobs that have not started (they never will) and count every revoked
    one as finished; again for one revoked before (an interrupt may have come between
    its revoke and its count: `finish` is idempotent)."""
    for ubatch_id, job in enumerate(jobs):
        if job.revoke() or job.revoked:
            run.baton.finish(ubatch_id)
