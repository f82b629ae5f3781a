"""Runner lifecycle races: close() during a run's set-up or submission, and a runner
dropped after an interrupted submit (one test per finding of a second review).

Every wait is bounded: callers run in daemon threads joined with a timeout, blocking
hooks wait on events with a timeout, and each test that could hang has a pytest timeout.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import dbo
from dbo import runner as runner_module


def _start_daemon(target, *args) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _unwedge(runner: dbo.UBatchRunner) -> None:
    """Test cleanup: let a caller stuck in `wait_done` return (count every ubatch done)."""
    run = runner._current_run
    if run is not None:
        for ubatch_id in range(run.num_ubatches):
            if run.baton._live[ubatch_id]:
                run.baton.finish(ubatch_id)


class _BlockingKwargs(dict):
    """kwargs whose `keys()` blocks once in the caller's thread: `_first_tensor_device`
    flattens the inputs under the run lock, before the jobs are submitted."""

    def __init__(self, caller_name: str, reached: threading.Event, gate: threading.Event):
        super().__init__()
        self._caller_name = caller_name
        self._reached = reached
        self._gate = gate

    def keys(self):  # type: ignore[no-untyped-def, override]
        if threading.current_thread().name == self._caller_name and not self._reached.is_set():
            self._reached.set()
            self._gate.wait(timeout=10)
        return super().keys()


def _close_mid_run(
    runner: dbo.UBatchRunner,
    caller: threading.Thread,
    reached: threading.Event,
    gate: threading.Event,
    stopped: list[threading.Thread],
    where: str,
) -> bool:
    """Once the run in `caller` is held at `where`, close the runner (it holds the run
    lock, so close() gives up waiting), let the `stopped` workers end, release the run;
    True if the caller is still running 3 s later. Always releases and unwedges."""
    try:
        assert reached.wait(5), f"the run never reached {where}"
        runner.close(timeout_s=0.2)
        for thread in stopped:
            thread.join(2.0)
        gate.set()
        caller.join(3.0)
        return caller.is_alive()
    finally:
        gate.set()
        _unwedge(runner)
        caller.join(2.0)


# ------------------------------------------------- 1. close() racing a run's set-up
@pytest.mark.timeout(20)
def test_close_while_a_run_is_setting_up_does_not_hang_the_run() -> None:
    """close(timeout_s) that cannot take the run lock stops every worker at once. A run
    that holds the lock but has not submitted its jobs yet (here: inside
    `_first_tensor_device`; in practice, a caller that got the lock just as close()'s
    wait timed out) then hands its jobs to exited threads, and waits for them forever."""
    runner = dbo.UBatchRunner(num_ubatches=2)
    reached, gate = threading.Event(), threading.Event()
    outcome: list[object] = []
    caller_name = "review2-caller-setup"

    def call() -> None:
        kwargs = _BlockingKwargs(caller_name, reached, gate)
        parts = [((torch.zeros(1),), kwargs), ((torch.zeros(1),), kwargs)]
        try:
            outcome.append(runner.run(lambda x: x + 1, parts))
        except BaseException as error:  # noqa: B036 - checked below
            outcome.append(error)

    caller = threading.Thread(target=call, name=caller_name, daemon=True)
    caller.start()
    hung = _close_mid_run(runner, caller, reached, gate, runner.threads, "its set-up")
    assert not hung, "run() waits forever for jobs handed to workers close() had stopped"
    # Finishing the run or refusing it (closed / aborted) are both fine.
    assert len(outcome) == 1


@pytest.mark.timeout(20)
def test_close_while_jobs_are_being_submitted_does_not_hang_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same race once `_current_run` is set: close() aborts the run and stops all the
    workers, including those whose job is not submitted yet; that ubatch never finishes
    and the caller (no watchdog) waits forever."""
    original_submit = runner_module._Worker.submit
    reached, gate = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_second_submit(self: object, job: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            reached.set()
            gate.wait(timeout=10)
        original_submit(self, job)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module._Worker, "submit", slow_second_submit)
    runner = dbo.UBatchRunner(num_ubatches=2)
    outcome: list[object] = []

    def call() -> None:
        parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
        try:
            outcome.append(runner.run(lambda x: x + 1, parts))
        except BaseException as error:  # noqa: B036 - checked below
            outcome.append(error)

    caller = _start_daemon(call)
    # Worker 1 has no job yet: stop() ends it.
    hung = _close_mid_run(
        runner, caller, reached, gate, runner.threads[1:], "its second submit"
    )
    assert not hung, "run() waits forever for a job submitted to a stopped worker"
    assert len(outcome) == 1


# ------------------------------------------------- 2. a revoked job pins its runner
@pytest.mark.timeout(20)
def test_runner_dropped_after_an_interrupted_submit_stops_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job revoked after an interrupt inside `submit` stays in `_Worker._job` (its
    worker was never woken) and keeps `run -> owner -> runner`, `fn` and the inputs
    alive. The worker thread holds the `_Worker`, so the runner is never collected, the
    weakref finalizer never runs, and its threads stay parked forever."""
    original_submit = runner_module._Worker.submit
    calls: list[int] = []

    def interrupted_second_submit(self: object, job: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            self._job = job  # type: ignore[attr-defined]
            raise KeyboardInterrupt  # lands between storing the job and waking the worker
        original_submit(self, job)  # type: ignore[arg-type]

    runner = dbo.UBatchRunner(num_ubatches=2)
    threads = runner.threads
    big_input = torch.zeros(1)
    input_ref = weakref.ref(big_input)
    parts = [((big_input,), {}), ((big_input,), {})]
    monkeypatch.setattr(runner_module._Worker, "submit", interrupted_second_submit)
    with pytest.raises(KeyboardInterrupt):
        runner.run(lambda x: x, parts)
    monkeypatch.setattr(runner_module._Worker, "submit", original_submit)

    runner_ref = weakref.ref(runner)
    del runner, parts, big_input
    gc.collect()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        gc.collect()
        time.sleep(0.05)
    alive = [t.name for t in threads if t.is_alive()]
    pinned = runner_ref() is not None
    input_alive = input_ref() is not None
    if pinned:  # cleanup so the threads do not outlive the test
        runner_ref().close(timeout_s=1.0)  # type: ignore[union-attr]
    assert not pinned and alive == [], (
        f"runner collected: {not pinned}; threads still parked: {alive}; "
        f"the interrupted call's input still alive: {input_alive}"
    )


@pytest.mark.timeout(20)
def test_a_broken_runner_is_usable_again_once_the_stuck_ubatch_returns() -> None:
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            release.wait(timeout=10)
        return x

    parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        with pytest.raises(dbo.OverlapTimeoutError):
            runner.run(stuck, parts, timeout_s=0.3)
        assert runner.broken
        with pytest.raises(RuntimeError, match="until its aborted run ends"):
            runner.run(stuck, parts)
        release.set()
        deadline = time.monotonic() + 5
        while True:
            try:
                out = runner.run(lambda x: x + 1, parts, timeout_s=5)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "the runner never recovered"
                time.sleep(0.05)
        assert [o.item() for o in out] == [1.0, 1.0] and not runner.broken


def test_ubatch_streams_are_distinct_queues_and_not_the_callers() -> None:
    # CUDA's pool hands out streams round-robin: a Stream object may be a queue already
    # in use. A backend whose pool has 5 queues, the caller on queue 0.
    from dbo.device import CpuBackend, CpuStream
    from dbo.runner import _distinct_streams

    class SmallPool(CpuBackend):
        def __init__(self) -> None:
            super().__init__()
            self.drawn = 0
            self.caller = CpuStream("queue0")

        def current_stream(self) -> CpuStream:
            return self.caller

        def new_stream(self, name: str) -> CpuStream:
            self.drawn += 1
            return CpuStream(f"queue{self.drawn % 3 if self.drawn < 6 else self.drawn % 5}")

        def stream_key(self, stream: CpuStream) -> str:  # type: ignore[override]
            return stream.name

    backend = SmallPool()
    streams = _distinct_streams(backend, 4)
    assert sorted(s.name for s in streams) == ["queue1", "queue2", "queue3", "queue4"]
    with pytest.raises(RuntimeError, match="distinct streams"):
        _distinct_streams(SmallPool(), 5)


def test_a_run_left_broken_still_orders_the_callers_stream_after_the_ubatch_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbo import runner as runner_module
    from dbo.device import CpuBackend, CpuEvent, CpuStream

    waits: list[tuple[str, str]] = []

    class Recording(CpuBackend):
        def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
            waits.append((stream.name, event.stream.name))
            super().wait_event(stream, event)

    monkeypatch.setattr(runner_module, "backend_for", lambda device: Recording())
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            release.wait(timeout=10)
        return x

    parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
    runner = dbo.UBatchRunner(num_ubatches=2)
    try:
        with pytest.raises(dbo.OverlapTimeoutError):
            runner.run(stuck, parts, timeout_s=0.3)
        assert runner.broken
        joined = {source for target, source in waits if target == "default"}
        assert joined == {"compute0", "comm0", "compute1", "comm1"}
    finally:
        release.set()
        runner.close()


def test_an_interrupt_while_a_runner_starts_its_workers_leaves_none_behind() -> None:
    """A Ctrl-C that lands while the second worker thread starts (the first already
    parked on its wake-up): the constructor stops the workers it started."""
    import os
    import signal
    import sys

    starts = [0]
    target = threading.Thread.start.__code__

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is target:
            starts[0] += 1
            if starts[0] == 2:
                os.kill(os.getpid(), signal.SIGINT)  # raised at the next bytecode
        return None

    def dbo_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("dbo-ubatch")}

    before = dbo_threads()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            dbo.UBatchRunner(2)
    finally:
        sys.settrace(None)
    assert starts[0] >= 2
    deadline = time.monotonic() + 10
    while dbo_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not dbo_threads() - before, "a worker thread started by the failed constructor lives on"


def test_a_malformed_ubatch_input_is_described_by_what_is_inside_the_pair() -> None:
    """`([1], {})` is a tuple: "got tuple" pointed away from the list that is wrong."""
    with dbo.UBatchRunner(2) as runner:
        with pytest.raises(TypeError, match=r"got a pair of \(list, dict\)"):
            runner.run(lambda x: x, [([1], {}), ([2], {})])
        with pytest.raises(TypeError, match="got a list"):
            runner.run(lambda x: x, [[(1,), {}], [(2,), {}]])


def test_a_second_interrupt_right_after_a_revoke_still_lets_the_runner_recover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watchdog fires while ubatch 1 has not started; a second interrupt lands
    between revoking its job and counting it as finished. Once ubatch 0 returns, the
    runner must be usable again (it stayed "unusable until its aborted run ends")."""
    original_revoke = runner_module._UBatchJob.revoke

    def revoke_then_interrupted(job: Any) -> bool:
        if original_revoke(job):
            raise KeyboardInterrupt  # the second Ctrl-C, before the caller's finish()
        return False

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            time.sleep(1.0)  # past timeout_s and the abort's grace
        return x

    x = torch.ones(2)
    with dbo.UBatchRunner(2) as runner:
        with monkeypatch.context() as patch:
            patch.setattr(runner_module._UBatchJob, "revoke", revoke_then_interrupted)
            with pytest.raises(KeyboardInterrupt):
                runner.run(fn, [((x,), {}), ((x,), {})], timeout_s=0.2)
        deadline = time.monotonic() + 20
        while True:
            try:
                outputs = runner.run(lambda t: t + 1, [((x,), {}), ((x,), {})], timeout_s=30)
                break
            except RuntimeError as error:
                assert "unusable until its aborted run ends" in str(error)
                assert time.monotonic() < deadline, "the runner never recovered"
                time.sleep(0.05)
        assert all(torch.equal(output, x + 1) for output in outputs)
