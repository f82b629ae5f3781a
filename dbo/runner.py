"""`UBatchRunner`: persistent ubatch worker threads that run one overlap at a time."""

from __future__ import annotations

import _thread
import atexit
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

from dbo import _affinity, _thread_settings
from dbo._checks import check_num_ubatches
from dbo._context import UBatchContext, current_context, registered
from dbo._run import OverlapRun, UBatchStreams
from dbo._wakeup import Wakeup
from dbo.baton import Baton
from dbo.device import DeviceBackend, backend_for
from dbo.errors import OverlapTimeoutError, UBatchAbortedError, attach_ubatch_id, describe

_ABORT_GRACE_S = 0.5
"""After the watchdog fires, how long the caller waits for the other ubatches to unwind."""

EXIT_WAIT_S = 30.0
"""At interpreter exit, how long to wait for ubatches that an aborted run left running
(the watchdog or an interrupt gave up on them; they end at their next yield point or
when `fn` returns). A daemon thread still inside a torch op when the interpreter
finalizes is killed inside C++, and the process ends in SIGABRT instead of with its own
status. The same bound as `comm`'s wait for abandoned collectives."""

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
    """At exit: wait, at most `EXIT_WAIT_S` in all, until every ubatch that an aborted
    run left running has ended."""
    deadline = time.monotonic() + EXIT_WAIT_S
    with _left_running_lock:
        batons = list(_left_running)
    for baton in batons:
        baton.wait_done(max(0.0, deadline - time.monotonic()))


_fork_generation = 0
"""Bumped in the child after `os.fork()`: the worker threads of the runners created
before the fork exist only in the parent."""


def _after_fork_in_child() -> None:
    global _fork_generation, _left_running_lock
    _fork_generation += 1
    # The parent's ubatch threads are not here: nothing to wait for at the child's exit.
    _left_running_lock = threading.Lock()
    _left_running.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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


class _Worker:
    """One persistent thread; runs the jobs handed to it, one at a time, on the CPUs it
    was started with (`dbo._affinity`).

    The worker parks on its `wake` between jobs, and the baton of each run parks the
    worker's ubatch on the same wake-up: a submitted job starts when the baton first
    reaches its ubatch (or the run is aborted), with one wake-up, not two.
    """

    def __init__(self, name: str, cpus: frozenset[int] | None) -> None:
        self._cpus = cpus
        self._fork_generation = _fork_generation
        self.wake = Wakeup()
        self._job: _UBatchJob | None = None
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (not in `__init__`: the runner holds every worker before
        any thread runs, so that it can stop them all if a start is interrupted)."""
        self.thread.start()

    def submit(self, job: _UBatchJob) -> None:
        """Hand `job` to the worker, to run at its next wake-up (its baton turn). A job
        left here by an interrupted run was revoked (it does nothing if it ever runs),
        so it may be replaced."""
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
                except BaseException:  # noqa: B036 - see below
                    # The job hands every failure of `fn` to its caller; one escaping
                    # here is the runtime's own. The worker must outlive it: a dead
                    # worker's ubatch would never start, and every later run would hang.
                    _report_worker_failure(threading.current_thread().name)
                if self._fork_generation != _fork_generation:
                    _end_forked_child(job.failed)
                job = None  # a parked worker must not keep the last run's tensors alive
                _affinity.restore(self._cpus)  # in case `fn` re-pinned this thread
            if self._stopping:
                return


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
    manager to close it.
    """

    def __init__(self, num_ubatches: int = 2, device: torch.device | str | int | None = None):
        self.num_ubatches = check_num_ubatches(num_ubatches)
        self.device = None if device is None else torch.device(device)
        self._run_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._current_run: OverlapRun | None = None
        self._aborted_run: OverlapRun | None = None
        self._aborted_jobs: list[_UBatchJob] = []
        """The aborted run's jobs: one revoked there but not yet counted as finished (a
        second interrupt between the two) is counted when the next run asks."""
        self._streams: dict[torch.device, tuple[DeviceBackend, list[UBatchStreams]]] = {}
        self.cpus = _affinity.cpus_of_this_thread()
        """The CPUs of the creating thread, which the workers inherit and keep (Linux;
        None elsewhere)."""
        self._workers = [
            _Worker(f"dbo-ubatch-{i}-of-{self.num_ubatches}", self.cpus)
            for i in range(self.num_ubatches)
        ]
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            # An interrupt (Ctrl-C) while a thread starts: nothing will refer to this
            # runner, so the threads already parked would stay parked for good.
            _stop_all(self._workers)
            raise
        self._fork_generation = _fork_generation
        # A runner dropped without close() must not leave its threads parked forever.
        weakref.finalize(self, _stop_all_here, self._workers, self._fork_generation)

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        """True while a ubatch of an aborted run (watchdog, interrupt) is still running;
        the runner refuses runs until it returns."""
        return self._broken is not None

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for diagnostics and tests)."""
        return [worker.thread for worker in self._workers]

    def close(self, timeout_s: float = 5.0) -> None:
        """End the worker threads; idempotent.

        Waits up to `timeout_s` for a run in progress (in another thread) to end; past
        that, the run is aborted (its ubatches raise `UBatchAbortedError` at their next
        yield point) and the workers end when their ubatches return. Then joins each
        worker for up to `timeout_s`. Raises RuntimeError when called from one of this
        runner's own ubatch threads (that run could never end).
        """
        self._refuse_own_ubatch_thread("close")
        if self._forked_away():
            # The workers are the parent's (their wake-ups are shared with it): leave them.
            self._closed = True
            return
        acquired = self._run_lock.acquire(timeout=_bounded(timeout_s))
        try:
            if self._closed:
                return
            self._closed = True
            if not acquired:
                # A run holds the lock: abort it, and let it stop the workers when it ends
                # (stopping them now could take a worker the run is about to hand a job).
                run = self._current_run
                if run is not None:
                    run.baton.abort("the runner was closed", wake_all=True)
                else:  # the run may have ended, and checked `_closed`, just before
                    self._stop_if_closed_and_idle()
                return
            _stop_all(self._workers)
        finally:
            if acquired:
                self._run_lock.release()
        if acquired and self._broken is None:
            for worker in self._workers:
                worker.thread.join(_bounded(timeout_s))

    def _stop_if_closed_and_idle(self) -> None:
        """Stop the workers if the runner is closed and no run holds the run lock. Both
        `close()` (when it could not get the lock) and the end of every run call this,
        so whichever of the two comes last stops them."""
        if self._closed and self._run_lock.acquire(blocking=False):
            try:
                _stop_all(self._workers)
            finally:
                self._run_lock.release()

    def _forked_away(self) -> bool:
        """True in a child process forked after this runner was created."""
        return self._fork_generation != _fork_generation

    def _refuse_own_ubatch_thread(self, what: str) -> None:
        context = current_context()
        run = context.scheduler if context is not None else None
        nested = False
        while run is not None:
            if getattr(run, "owner", None) is self:
                where = "a run nested in one of its own" if nested else "one of its own"
                raise RuntimeError(
                    f"UBatchRunner.{what} was called from a ubatch thread of {where} runs, "
                    f"which would wait for itself; a nested overlap runs inline "
                    f"(dbo.overlap does this)"
                )
            parent = getattr(run, "parent", None)
            run, nested = (parent() if parent is not None else None), True

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
        (intra-op threads, grad / inference mode, autocast, default device, saved-tensor
        hooks); CUDA work goes to the device of the ubatch streams. The workers run on
        the CPUs of the thread that created the runner (Linux affinity), whatever the
        caller's are now.

        Streams (CUDA): ubatch i starts on its compute stream, which waits for the
        caller's current stream; before `run` returns, the caller's current stream waits
        for every ubatch's compute and comm streams. No host synchronization.

        Errors: if a ubatch raises, the others raise `UBatchAbortedError` at their next
        yield point (so their `finally` blocks run), and `run` re-raises the original
        exception with a note naming the ubatch. With `timeout_s`, a ubatch that runs
        longer between two yield points raises `OverlapTimeoutError` here, with that
        ubatch's stack.
        """
        timeout_s = check_timeout(timeout_s)
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
        self._refuse_own_ubatch_thread("run")
        if self._forked_away():  # checked before the run lock, which the fork may have copied held
            raise RuntimeError(
                "this UBatchRunner was created before os.fork(): its worker threads exist "
                "only in the parent process. Create a new UBatchRunner in this process "
                "(dbo.overlap does so by itself)"
            )
        try:
            with self._run_lock:
                if self._closed:
                    raise RuntimeError("this UBatchRunner is closed; create a new one")
                if self._broken is not None:
                    aborted = self._aborted_run
                    if aborted is not None:
                        for ubatch_id, job in enumerate(self._aborted_jobs):
                            if job.revoked:  # finish() is idempotent
                                aborted.baton.finish(ubatch_id)
                    if aborted is None or not aborted.baton.wait_done(0):
                        raise RuntimeError(
                            f"this UBatchRunner is unusable until its aborted run ends: "
                            f"{self._broken}"
                        )
                    self._broken = None  # the stuck ubatch has returned: usable again
                    self._aborted_run, self._aborted_jobs = None, []
                return self._run_locked(fn, inputs, timeout_s, device)
        finally:
            # A close() that gave up on the run lock as this run ended may have found
            # no run to abort after this run had checked `_closed`: stop the workers.
            self._stop_if_closed_and_idle()

    def _backend_and_streams(
        self, inputs: list[tuple[tuple[Any, ...], dict[str, Any]]], device: torch.device | None
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

    def _run_locked(
        self,
        fn: Callable[..., Any],
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]],
        timeout_s: float | None,
        device: torch.device | None,
    ) -> list[Any]:
        backend, streams = self._backend_and_streams(inputs, device)
        context = current_context()
        run = OverlapRun(
            self.num_ubatches, backend, streams, owner=self,
            wakeups=[worker.wake for worker in self._workers],
            parent=context.scheduler if context is not None else None,
        )
        settings = _thread_settings.capture()
        caller_stream = backend.current_stream()
        run.fork_event = backend.record_event(caller_stream)
        results: list[Any] = [None] * self.num_ubatches
        errors: list[BaseException | None] = [None] * self.num_ubatches
        jobs = [
            _UBatchJob(run, ubatch_id, fn, args, kwargs, settings, results, errors)
            for ubatch_id, (args, kwargs) in enumerate(inputs)
        ]
        self._current_run = run
        waited = False
        if self._closed:  # close() gave up on the lock before it could see this run
            run.baton.abort("the runner was closed", wake_all=True)
        try:
            for worker, job in zip(self._workers, jobs):
                worker.submit(job)
            run.baton.start()
            self._wait(run, timeout_s)
            waited = True
        except BaseException as error:
            # The watchdog, or an interrupt (KeyboardInterrupt) anywhere above, even inside
            # a submit: no worker may stay parked. Abort first, so that a job the baton
            # reaches from here on unwinds instead of starting `fn`. A job that has not
            # started is revoked and counted as finished here; the others finish
            # themselves. Wake everyone and give them a moment to unwind; until they do,
            # the runner is unusable.
            # First, so that a second interrupt anywhere below still leaves the runner
            # able to tell when this run has ended (run() checks `_aborted_run`).
            self._aborted_run, self._aborted_jobs = run, jobs
            self._broken = "an aborted run's ubatch threads have not finished"
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
                self._broken = None
                self._aborted_run, self._aborted_jobs = None, []
                self._join_streams(run, caller_stream)
            else:
                self._broken = (
                    f"ubatch {run.baton.holder} was still running {_ABORT_GRACE_S} s after its "
                    "overlap was aborted"
                )
                _remember_left_running(run.baton)
                # Best effort: the caller's stream waits for what the ubatches enqueued so
                # far, so that it does not reuse the inputs under their kernels (what the
                # stuck ubatch enqueues later is not covered).
                for ubatch_streams in run.streams:
                    for stream in (ubatch_streams.compute, ubatch_streams.comm):
                        backend.wait_event(caller_stream, backend.record_event(stream))
            raise
        finally:
            self._current_run = None
            if self._broken is None and not waited:
                # Aborted, and every ubatch has ended (a stuck one could still add): what
                # they left is dropped. A run that ended on its own does so below.
                run.drop_leftovers()
            if self._closed:
                _stop_all(self._workers)
        self._join_streams(run, caller_stream)
        failure = run.first_failure or _first_failure(errors)
        if failure is None:
            backend.hand_over(results, caller_stream)
            return results
        run.drop_leftovers()  # what its aborted ubatches left (a success leaves nothing)
        # Nothing here may keep the error once it is raised: this frame is on its
        # traceback, so a reference from a local (or from the run, which a local holds)
        # would be a cycle, and the failed call's inputs and activations (the ubatch's
        # frames are on the traceback too) would live until the garbage collector runs.
        # A caller that retries after an out-of-memory error needs them freed at once.
        run.first_failure = None
        errors.clear()
        failed_id, failed_error = failure
        del failure
        attach_ubatch_id(failed_error, failed_id, self.num_ubatches)
        try:
            raise failed_error.with_traceback(failed_error.__traceback__)
        finally:
            del failed_error

    @staticmethod
    def _join_streams(run: OverlapRun, caller_stream: Any) -> None:
        """Order the caller's stream after every ubatch's compute and comm streams."""
        for events in run.join_events:
            for event in events:
                run.backend.wait_event(caller_stream, event)

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


class _UBatchJob:
    """What a worker thread does for ubatch `ubatch_id` of one run."""

    __slots__ = (
        "run", "ubatch_id", "fn", "args", "kwargs", "settings", "results", "errors", "_claim",
        "failed", "revoked",
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
        self.failed = False
        """Whether the ubatch raised (the exit status of a child forked inside it)."""
        self.revoked = False
        """Whether `revoke` stopped it: it never runs, so the caller counts it as finished."""

    def revoke(self) -> bool:
        """Stop the job from ever running; False if it has already started."""
        if not self._claim.acquire(blocking=False):
            return False
        self.revoked = True
        # It may sit in its worker until the next submit: it must not keep the run (and
        # through it the runner, the inputs and fn) alive meanwhile.
        self.run = self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        self.results = self.errors = None  # type: ignore[assignment]
        return True

    def __call__(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # revoked by an aborted run, which counted this ubatch as finished
        run, ubatch_id = self.run, self.ubatch_id
        generation = _fork_generation
        try:
            context = UBatchContext(ubatch_id, run.num_ubatches, run)
            with registered(context), _thread_settings.applied(self.settings):
                run.baton.wait_turn(ubatch_id)
                previous_stream = run.backend.current_stream()
                run.enter(ubatch_id)
                try:
                    self.results[ubatch_id] = self.fn(*self.args, **self.kwargs)
                    # A child forked inside `fn` ends here (the worker ends the process):
                    # the run's hooks and exit callbacks are the parent's to run.
                    if generation == _fork_generation:
                        run.finish_normally(ubatch_id)
                finally:
                    run.exit(ubatch_id, previous_stream)
        except BaseException as error:  # noqa: B036 - every failure must reach the caller
            self.failed = True
            self.errors[ubatch_id] = error
            # An abort error is the consequence of another failure only if the run was
            # aborted; raised by `fn` in a live run (re-raised from another runner's
            # run, say) it is this ubatch's own failure, and the others must unwind.
            if not (isinstance(error, UBatchAbortedError) and run.baton.aborted):
                # Normally this thread holds the baton; after a forced wake-up (watchdog)
                # several may race here, and any of their failures is a fine report.
                if run.first_failure is None:
                    run.first_failure = (ubatch_id, error)
                run.baton.abort(f"ubatch {ubatch_id} raised {describe(error)}")
        finally:
            # Drop references before waking the caller: the inputs and fn belong to it,
            # and this frame is on the traceback of an error raised here, so its locals
            # (the run, which holds the error) would make a cycle.
            self.args = self.kwargs = self.fn = None  # type: ignore[assignment]
            self.results = self.errors = None  # type: ignore[assignment]
            baton = run.baton
            self.run = run = context = None  # type: ignore[assignment]
            if generation == _fork_generation:  # a child's wake-ups are the parent's
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


def _report_worker_failure(thread_name: str) -> None:
    """Print the exception being handled, the way Python reports a thread that died
    (the worker goes on)."""
    print(f"dbo: unexpected error in worker {thread_name} (it keeps running):", file=sys.stderr)
    traceback.print_exc()


def _end_forked_child(failed: bool) -> None:
    """End a process forked from inside a ubatch, once that ubatch's function is done.

    Its only thread is this worker. Parking it would steal the wake-ups it shares with
    the parent, and CPython cannot return from the function of a thread that forked:
    the child aborts ("thread state already initialized") or hangs. So the process
    ends here, as `multiprocessing`'s forked children do: exit status 1 if the
    function raised, else 0.
    """
    os._exit(1 if failed else 0)


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()


def _stop_all_here(workers: list[_Worker], fork_generation: int) -> None:
    """`_stop_all`, unless this is a child forked since the workers started (they are
    the parent's: nothing to stop here, and their wake-ups are shared with it)."""
    if fork_generation == _fork_generation:
        _stop_all(workers)


def _first_failure(errors: list[BaseException | None]) -> tuple[int, BaseException] | None:
    """The error that caused the failure: the first that is not an abort, else the first."""
    for ubatch_id, error in enumerate(errors):
        if error is not None and not isinstance(error, UBatchAbortedError):
            return ubatch_id, error
    for ubatch_id, error in enumerate(errors):
        if error is not None:
            return ubatch_id, error
    return None


def _first_tensor_device(inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> torch.device:
    """The device of the first CUDA tensor in the inputs, else CPU.

    A CPU scalar or index tensor placed before the CUDA batch must not select the CPU
    backend: the ubatches would then share the thread's default stream.
    """
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device
    return torch.device("cpu")


def _bounded(timeout_s: float | None) -> float:
    """A timeout `_thread` locks accept: -1 (forever) for None, at most TIMEOUT_MAX."""
    if timeout_s is None:
        return -1
    return min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
