"""`UBatchRunner`: persistent ubatch worker threads that run one overlap at a time."""

from __future__ import annotations

import _thread
import atexit
import enum
import math
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dbo import _affinity, _thread_settings, _wakeup
from dbo._checks import check_num_ubatches
from dbo._context import UBatchContext, current_context, registered
from dbo._run import OverlapRun, UBatchStreams
from dbo.baton import Baton
from dbo.device import DeviceBackend, backend_for
from dbo.errors import OverlapTimeoutError, UBatchAbortedError, attach_ubatch_id, describe

_Inputs = list[tuple[tuple[Any, ...], dict[str, Any]]]

_ABORT_GRACE_S = 0.5
"""After the watchdog fires or the caller is interrupted, how long the caller waits for
the ubatches to unwind before it leaves the runner broken."""

EXIT_WAIT_S = 30.0
"""At interpreter exit, how long to wait in all for the ubatches that aborted runs left
running: a daemon thread still inside a torch op when the interpreter finalizes is
killed inside C++, and the process ends in SIGABRT instead of with its own status."""

_left_running: list[Baton] = []
"""Batons of aborted runs whose ubatches had not all ended (waited for at exit)."""
_left_running_lock = threading.Lock()
_exit_wait_registered = False


def _remember_left_running(baton: Baton) -> None:
    global _exit_wait_registered
    with _left_running_lock:
        _left_running[:] = [kept for kept in _left_running if not kept.wait_done(0)]
        _left_running.append(baton)
        if not _exit_wait_registered:
            atexit.register(_wait_for_left_running)
            _exit_wait_registered = True


def _wait_for_left_running() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with _left_running_lock:
        batons = list(_left_running)
    for baton in batons:
        baton.wait_done(max(0.0, deadline - time.monotonic()))


def reset_after_fork() -> None:
    """In a forked child: the parent's ubatch threads are not there to wait for."""
    global _left_running_lock
    _left_running_lock = threading.Lock()
    _left_running.clear()


def is_ubatch_input(item: Any) -> bool:
    """Whether `item` is one ubatch's `(args_tuple, kwargs_dict)` pair."""
    return (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], tuple)
        and isinstance(item[1], dict)
    )


def describe_ubatch_input(item: Any) -> str:
    """What `item` is, for an error saying it is not an `(args_tuple, kwargs_dict)` pair:
    the types inside a pair ("a pair of (list, dict)"), else the item's type."""
    if isinstance(item, tuple) and len(item) == 2:
        return f"a pair of ({type(item[0]).__name__}, {type(item[1]).__name__})"
    return f"a {type(item).__name__}"


def check_timeout(timeout_s: Any) -> float | None:
    """Validate a watchdog timeout: None or seconds > 0 (infinity means None)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return None if math.isinf(timeout_s) else float(timeout_s)


class RunnerState(enum.Enum):
    """The lifecycle of a `UBatchRunner`."""

    IDLE = "idle"
    """The workers are parked, ready for a run."""
    RUNNING = "running"
    """A run is in progress."""
    BROKEN = "broken"
    """A ubatch of an aborted run (watchdog, interrupt) still runs; runs are refused
    until it returns, then the runner is idle again."""
    CLOSED = "closed"
    """The workers are stopped, or stop once their ubatch returns; runs are refused."""


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

    The workers start with the runner and live until `close()`, until the runner is
    garbage-collected, or until interpreter exit (they are daemon threads). One run at a
    time: concurrent `run` calls from several threads are serialized, so a thread that
    a ubatch starts and waits for must not call `run` on the same runner (it would wait
    for the run that waits for it; `dbo.overlap` leases another runner). Use as a context
    manager to close it. In a process forked after the runner was created, `run` raises
    RuntimeError and `close` does nothing; forking from inside a ubatch is unsupported.
    """

    def __init__(self, num_ubatches: int = 2, device: torch.device | str | int | None = None):
        self.num_ubatches = check_num_ubatches(num_ubatches)
        self.device = None if device is None else torch.device(device)
        self.cpus = _affinity.cpus_of_this_thread()
        """The CPUs of the creating thread, which the workers inherit and keep (Linux;
        None elsewhere)."""
        self._pid = os.getpid()
        self._run_lock = threading.Lock()
        """Held for the whole of a run: runs are serialized."""
        self._mutex = threading.Lock()
        """Guards `_state`, `_run` and `_jobs` (`close()` reads them during a run)."""
        self._state = RunnerState.IDLE
        self._run: OverlapRun | None = None
        """The run in progress (RUNNING), or the aborted run still running (BROKEN)."""
        self._jobs: list[_UBatchJob] = []
        self._streams: dict[torch.device, tuple[DeviceBackend, list[UBatchStreams]]] = {}
        self._workers = [
            _Worker(f"dbo-ubatch-{i}-of-{self.num_ubatches}", self.cpus)
            for i in range(self.num_ubatches)
        ]
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            # An interrupt while a thread starts: nothing will refer to this runner.
            _stop_workers(self._workers, self._pid)
            raise
        # A runner dropped without close() must not leave its threads parked forever.
        weakref.finalize(self, _stop_workers, self._workers, self._pid)

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
        for ubatch_id, job in enumerate(self._jobs):
            if job.revoked:  # counted again: an interrupt may have come between the two
                run.baton.finish(ubatch_id)
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
        acquired = self._run_lock.acquire(timeout=_bounded(timeout_s))
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
        _stop_workers(self._workers, self._pid)
        if previous is RunnerState.IDLE:
            for worker in self._workers:
                worker.thread.join(_bounded(timeout_s))

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
    ) -> list[Any]:
        """Run `fn(*args_i, **kwargs_i)` in ubatch thread i; return the outputs in order.

        `device` picks the ubatch streams for this run when the runner has none of its
        own; by default, the device of the first CUDA tensor in the inputs (else CPU).

        Threading: ubatch 0 starts; a ubatch gives the baton to the next live ubatch only
        at a yield point (`dbo.yield_()` and the `yield_and_switch_*` calls) or when `fn`
        returns or raises. Each ubatch thread runs with the caller's torch settings
        (`dbo._thread_settings`) on the CPUs of the thread that created the runner.

        Streams (CUDA): ubatch i starts on its compute stream, which waits for the
        caller's current stream; before `run` returns, the caller's current stream waits
        for every ubatch's compute and comm streams. No host synchronization.

        Errors: if a ubatch raises, the others raise `UBatchAbortedError` at their next
        yield point (so their `finally` blocks run), and `run` re-raises the first
        failure with a note and a `ubatch_id` attribute naming its ubatch. With
        `timeout_s`, a ubatch that holds the baton longer raises `OverlapTimeoutError`
        here, with that ubatch's stack; if it has not unwound 0.5 s later, the runner is
        BROKEN until it returns. RuntimeError if the runner is closed or broken.
        """
        timeout_s = check_timeout(timeout_s)
        inputs = self._checked_inputs(ubatch_inputs)
        self._refuse_own_ubatch_thread("run")
        if os.getpid() != self._pid:  # before the run lock, which the fork may have copied held
            raise RuntimeError(
                "this UBatchRunner was created before os.fork(): its worker threads exist "
                "only in the parent process. Create a new UBatchRunner in this process "
                "(dbo.overlap does so by itself)"
            )
        with self._run_lock:
            run = self._new_run(inputs, device)
            results: list[Any] = [None] * self.num_ubatches
            errors: list[BaseException | None] = [None] * self.num_ubatches
            settings = _thread_settings.capture()
            jobs = [
                _UBatchJob(run, ubatch_id, fn, args, kwargs, settings, results, errors)
                for ubatch_id, (args, kwargs) in enumerate(inputs)
            ]
            self._begin(run, jobs)
            try:
                self._start_and_wait(run, jobs, timeout_s)
            finally:
                self._end(run)
            return self._collect(run, results, errors)

    def _checked_inputs(self, ubatch_inputs: Sequence[Any]) -> _Inputs:
        inputs = list(ubatch_inputs)
        if len(inputs) != self.num_ubatches:
            raise ValueError(
                f"this runner has {self.num_ubatches} ubatches but got {len(inputs)} inputs"
            )
        for index, item in enumerate(inputs):
            if not is_ubatch_input(item):
                raise TypeError(
                    f"ubatch_inputs[{index}] must be an (args_tuple, kwargs_dict) pair, "
                    f"got {describe_ubatch_input(item)}"
                )
        return inputs

    def _new_run(self, inputs: _Inputs, device: torch.device | None) -> OverlapRun:
        backend, streams = self._backend_and_streams(inputs, device)
        context = current_context()
        run = OverlapRun(
            self.num_ubatches, backend, streams, owner=self,
            wakeups=[worker.wake for worker in self._workers],
            parent=context.run if context is not None else None,
        )
        run.caller_stream = backend.current_stream()
        run.fork_event = backend.record_event(run.caller_stream)
        return run

    def _backend_and_streams(
        self, inputs: _Inputs, device: torch.device | None
    ) -> tuple[DeviceBackend, list[UBatchStreams]]:
        if self.device is not None:
            device = self.device
        elif device is None:
            device = _first_tensor_device(inputs)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cached = self._streams.get(device)
        if cached is None:
            backend = backend_for(device)
            drawn = _distinct_streams(backend, 2 * self.num_ubatches)
            streams = [
                UBatchStreams(drawn[2 * i], drawn[2 * i + 1]) for i in range(self.num_ubatches)
            ]
            cached = self._streams[device] = (backend, streams)
        return cached

    def _begin(self, run: OverlapRun, jobs: list[_UBatchJob]) -> None:
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

    def _end(self, run: OverlapRun) -> None:
        """RUNNING -> IDLE, or BROKEN while a ubatch of the aborted run still runs; the
        workers of a runner closed during the run stop now."""
        with self._mutex:
            if self._state is RunnerState.RUNNING:
                ended = run.baton.wait_done(0)
                self._set_state(RunnerState.IDLE if ended else RunnerState.BROKEN)
            closed = self._state is RunnerState.CLOSED
        if closed:
            _stop_workers(self._workers, self._pid)

    def _start_and_wait(
        self, run: OverlapRun, jobs: list[_UBatchJob], timeout_s: float | None
    ) -> None:
        """Hand each worker its job, give ubatch 0 the baton, and wait for the run to end;
        on the watchdog or an interrupt, abort the run before re-raising."""
        try:
            for worker, job in zip(self._workers, jobs):
                worker.submit(job)
            run.baton.start()
            self._wait(run, timeout_s)
        except BaseException as error:
            self._abort(run, jobs, error)
            raise

    def _abort(self, run: OverlapRun, jobs: list[_UBatchJob], error: BaseException) -> None:
        """No ubatch may stay parked: abort the run, so that a job the baton reaches from
        here on unwinds; count the jobs that never started as finished; wake every
        ubatch; give them `_ABORT_GRACE_S` to unwind."""
        reason = (
            "the watchdog fired" if isinstance(error, OverlapTimeoutError)
            else f"the caller was interrupted ({type(error).__name__})"
        )
        run.baton.abort(reason)
        for ubatch_id, job in enumerate(jobs):
            if job.revoke():
                run.baton.finish(ubatch_id)
        run.baton.abort(reason, wake_all=True)
        if run.baton.wait_done(_ABORT_GRACE_S):
            run.drop_leftovers()
            self._join_streams(run)
            return
        _remember_left_running(run.baton)
        # Best effort: the caller's stream waits for what the ubatches enqueued so far,
        # so that it does not reuse the inputs under their kernels.
        for ubatch_streams in run.streams:
            for stream in (ubatch_streams.compute, ubatch_streams.comm):
                run.backend.wait_event(run.caller_stream, run.backend.record_event(stream))

    def _collect(
        self, run: OverlapRun, results: list[Any], errors: list[BaseException | None]
    ) -> list[Any]:
        """The outputs of a run that ended, or its first failure, re-raised."""
        self._join_streams(run)
        failure = run.first_failure or _first_failure(errors)
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

    @staticmethod
    def _join_streams(run: OverlapRun) -> None:
        """Order the caller's stream after every ubatch's compute and comm streams."""
        for events in run.join_events:
            for event in events:
                run.backend.wait_event(run.caller_stream, event)

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


class _Worker:
    """One persistent thread; runs the jobs handed to it, one at a time, on the CPUs it
    was started with (`dbo._affinity`).

    The worker parks on its `wake` between jobs, and the baton of each run parks the
    worker's ubatch on the same wake-up: a submitted job starts when the baton first
    reaches its ubatch (or the run is aborted), with one wake-up, not two.
    """

    def __init__(self, name: str, cpus: frozenset[int] | None) -> None:
        self._cpus = cpus
        self.wake = _wakeup.new_wakeup()
        self._job: _UBatchJob | None = None
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (not in `__init__`: the runner holds every worker before
        any thread runs, so that it can stop them all if a start is interrupted)."""
        self.thread.start()

    def submit(self, job: _UBatchJob) -> None:
        """Hand `job` to the worker, to run at its next wake-up (its baton turn); it
        replaces a job an interrupted run left here, which was revoked."""
        self._job = job

    def stop(self) -> None:
        """End the thread once its current job, if any, returns."""
        self._stopping = True
        self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.wait()  # a wake-up without a job (left over from an abort): park again
            job, self._job = self._job, None
            if job is not None:
                try:
                    job()
                except BaseException:  # noqa: B036 - the worker must outlive it
                    # The job hands every failure of `fn` to its caller; one escaping
                    # here is the runtime's own, and a dead worker would hang later runs.
                    print(f"dbo: unexpected error in worker {self.thread.name} "
                          "(it keeps running):", file=sys.stderr)
                    traceback.print_exc()
                job = None  # a parked worker must not keep the last run's tensors alive
                _affinity.restore(self._cpus)  # in case `fn` re-pinned this thread
            if self._stopping:
                return


class _UBatchJob:
    """What a worker thread does for ubatch `ubatch_id` of one run; runs at most once."""

    __slots__ = (
        "run", "ubatch_id", "fn", "args", "kwargs", "settings", "results", "errors", "_claim",
        "revoked",
    )

    def __init__(
        self,
        run: OverlapRun,
        ubatch_id: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        settings: _thread_settings.ThreadSettings,
        results: list[Any],
        errors: list[BaseException | None],
    ) -> None:
        self.run, self.ubatch_id, self.fn = run, ubatch_id, fn
        self.args, self.kwargs, self.settings = args, kwargs, settings
        self.results, self.errors = results, errors
        self._claim = _thread.allocate_lock()
        """Taken once: by the worker when the job starts, or by `revoke`."""
        self.revoked = False
        """Whether `revoke` stopped it: it never runs, so the caller counts it as finished."""

    def revoke(self) -> bool:
        """Stop the job from ever running; False if it has already started."""
        if not self._claim.acquire(blocking=False):
            return False
        self.revoked = True
        self._drop_references()  # it may sit in its worker until the next submit
        return True

    def _drop_references(self) -> None:
        """Forget the run, `fn`, the inputs and the outputs: they belong to the caller."""
        self.run = self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        self.results = self.errors = None  # type: ignore[assignment]

    def __call__(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # revoked by an aborted run, which counted this ubatch as finished
        run, ubatch_id = self.run, self.ubatch_id
        try:
            context = UBatchContext(ubatch_id, run.num_ubatches, run)
            with registered(context), _thread_settings.applied(self.settings):
                run.baton.wait_turn(ubatch_id)
                previous_stream = run.backend.current_stream()
                run.enter(ubatch_id)
                try:
                    self.results[ubatch_id] = self.fn(*self.args, **self.kwargs)
                    run.finish_normally(ubatch_id)
                finally:
                    run.exit(ubatch_id, previous_stream)
        except BaseException as error:  # noqa: B036 - every failure must reach the caller
            self.errors[ubatch_id] = error
            # An abort error is a consequence of another failure only in an aborted run;
            # raised by `fn` in a live one (from another runner's run), it is this
            # ubatch's own failure, and the others must unwind.
            if not (isinstance(error, UBatchAbortedError) and run.baton.aborted):
                # After a forced wake-up several ubatches may race here: any is fine.
                if run.first_failure is None:
                    run.first_failure = (ubatch_id, error)
                run.baton.abort(f"ubatch {ubatch_id} raised {describe(error)}")
        finally:
            # Drop references before waking the caller: this frame is on the traceback
            # of an error raised here, and the run holds that error (a cycle).
            baton = run.baton
            self._drop_references()
            run = context = None  # type: ignore[assignment]
            baton.finish(ubatch_id)


_MAX_STREAM_DRAWS = 128
"""New streams drawn, at most, looking for ones distinct from the others (CUDA's pool
holds 32 per priority)."""


def _distinct_streams(backend: DeviceBackend, count: int) -> list[Any]:
    """`count` streams that are distinct device queues, none of them the caller's
    current stream: two ubatch streams sharing one queue would serialize their work.

    Raises RuntimeError when the device cannot give that many (more ubatches than its
    stream pool holds)."""
    taken = {backend.stream_key(backend.current_stream())}
    streams: list[Any] = []
    for _ in range(_MAX_STREAM_DRAWS):
        if len(streams) == count:
            break
        role = "compute" if len(streams) % 2 == 0 else "comm"
        stream = backend.new_stream(f"{role}{len(streams) // 2}")
        key = backend.stream_key(stream)
        if key not in taken:
            taken.add(key)
            streams.append(stream)
    if len(streams) < count:
        raise RuntimeError(
            f"could not get {count} distinct streams on {backend.device} (got "
            f"{len(streams)} in {_MAX_STREAM_DRAWS} draws); use fewer ubatches"
        )
    return streams


def _stop_workers(workers: list[_Worker], pid: int) -> None:
    """Stop `workers`, unless this is a process forked since they started (they are
    the parent's, and their wake-ups are shared with it)."""
    if os.getpid() == pid:
        for worker in workers:
            worker.stop()


def _first_failure(errors: list[BaseException | None]) -> tuple[int, BaseException] | None:
    """The error that caused the failure: the first that is not an abort, else the first."""
    for ubatch_id, error in enumerate(errors):
        if error is not None and not isinstance(error, UBatchAbortedError):
            return ubatch_id, error
    for ubatch_id, error in enumerate(errors):
        if error is not None:
            return ubatch_id, error
    return None


def _first_tensor_device(inputs: _Inputs) -> torch.device:
    """The device of the first CUDA tensor in the inputs, else CPU (a CPU scalar placed
    before the CUDA batch must not select the CPU backend)."""
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    return torch.device("cpu")


def _bounded(timeout_s: float | None) -> float:
    """A timeout `_thread` locks accept: -1 (forever) for None, at most TIMEOUT_MAX."""
    if timeout_s is None:
        return -1
    return min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
