"""The ubatch worker threads of a `UBatchRunner`, and the job each runs for one run."""

from __future__ import annotations

import _thread
import contextvars
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from dbo.errors import UBatchAbortedError, describe
from dbo.runtime import affinity, thread_settings, wakeup
from dbo.runtime.context import UBatchContext, registered
from dbo.runtime.run import OverlapRun


class Worker:
    """One persistent thread that runs the jobs handed to it, one at a time, on the CPUs
    it was started with. It parks on `wake` between jobs, and the baton parks its ubatch
    on the same wake-up: a submitted job starts when the baton first reaches it."""

    def __init__(self, name: str, cpus: frozenset[int] | None) -> None:
        self._cpus = cpus
        self.wake = wakeup.new_wakeup()
        self._job: UBatchJob | None = None
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def submit(self, job: UBatchJob) -> None:
        """Hand `job` to the worker, to run at its next wake-up (its baton turn)."""
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
                except BaseException:  # noqa: B036 - a bug of the runtime: outlive it
                    print(f"dbo: unexpected error in worker {self.thread.name} "
                          "(it keeps running):", file=sys.stderr)
                    traceback.print_exc()
                job = None  # a parked worker must not keep the last run's tensors alive
                affinity.restore(self._cpus)  # in case `fn` re-pinned this thread
            if self._stopping:
                return


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class UBatchJob:
    """What a worker thread does for ubatch `ubatch_id` of one run; runs at most once."""

    run: OverlapRun
    ubatch_id: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    settings: thread_settings.ThreadSettings
    results: list[Any]
    errors: list[BaseException | None]
    _claim: Any = dataclasses.field(default_factory=_thread.allocate_lock, init=False)
    """Taken once: by the worker when the job starts, or by `revoke`."""
    revoked: bool = dataclasses.field(default=False, init=False)
    """Whether `revoke` stopped it: it never runs, so the caller counts it as finished."""
    caller_context: contextvars.Context | None = dataclasses.field(
        default_factory=contextvars.copy_context, init=False)
    """A copy of the caller's context variables (made where the job is made, in the
    caller's thread), which the job runs in: dynamo's configuration (a ContextVar from
    torch 2.12) and the user's own reach `fn`, and what `fn` sets goes with the job."""

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
        self.caller_context = None
        self.results = self.errors = None  # type: ignore[assignment]

    def __call__(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # revoked by an aborted run, which counted this ubatch as finished
        context = self.caller_context
        assert context is not None, "a job runs once"
        context.run(self._run)

    def _run(self) -> None:
        run, ubatch_id = self.run, self.ubatch_id
        try:
            context = UBatchContext(ubatch_id, run.num_ubatches, run)
            with registered(context), thread_settings.applied(self.settings):
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
            # An abort error raised by `fn` in a live run (from another runner's run) is
            # this ubatch's own failure. After a forced wake-up several ubatches may race
            # to be the first failure: any is fine.
            if not (isinstance(error, UBatchAbortedError) and run.baton.aborted):
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


def stop_workers(workers: list[Worker], pid: int) -> None:
    """Stop `workers`, unless this is a process forked since they started (they are
    the parent's)."""
    if os.getpid() == pid:
        for worker in workers:
            worker.stop()
