"""`close()`: bounded, refused from the runner's own ubatch, safe at any point of a run in
another thread; a runner dropped without it ends its threads; idle workers keep nothing
of the last run."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import dbo
from dbo.runtime import runner as runner_module
from dbo.runtime import worker
from dbo.runtime.runner import RunnerState


def _start_daemon(target, *args) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _start_run_in_daemon(runner: dbo.UBatchRunner, outcome: list[object]) -> threading.Thread:
    """Run a two-ubatch `x + 1` on `runner` in a daemon thread; its result or error goes
    to `outcome`."""

    def call() -> None:
        parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
        try:
            outcome.append(runner.run(lambda x: x + 1, parts))
        except BaseException as error:  # noqa: B036 - checked by the caller
            outcome.append(error)

    return _start_daemon(call)


@pytest.mark.timeout(20)
def test_close_timeout_bounds_the_wait_for_a_running_overlap() -> None:
    """close(timeout_s) returns within about `timeout_s` while a run is stuck in another
    thread (atexit's close_all must not hang the exit), and that run gets the abort."""
    runner = dbo.UBatchRunner(num_ubatches=2)
    gate = threading.Event()
    entered = threading.Event()

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            entered.set()
            gate.wait(timeout=15)
        return x

    parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            runner.run(fn, parts)
            outcome.append(None)
        except BaseException as error:  # noqa: B036 - checked below
            outcome.append(error)

    caller = _start_daemon(call)
    try:
        assert entered.wait(5)
        closer = _start_daemon(lambda: runner.close(timeout_s=0.5))
        closer.join(3.0)
        close_returned = not closer.is_alive()
    finally:
        gate.set()
        caller.join(10)
    assert close_returned, "close(timeout_s=0.5) was still blocked after 3 s"
    # The run that close() cut short reports the abort to its caller; nothing hangs.
    assert len(outcome) == 1 and isinstance(outcome[0], dbo.UBatchAbortedError)


@pytest.mark.timeout(20)
def test_close_from_inside_its_own_ubatch_is_refused() -> None:
    """close() from one of the runner's own ubatches is refused at once: it would wait
    for the run it is part of."""
    runner = dbo.UBatchRunner(num_ubatches=2)
    close_seconds: list[float] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            started = time.perf_counter()
            with pytest.raises(RuntimeError, match="would wait for itself"):
                runner.close()
            close_seconds.append(time.perf_counter() - started)
        return x

    parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
    try:
        runner.run(fn, parts, timeout_s=2.0)
    except dbo.OverlapTimeoutError as error:
        pytest.fail(f"close() inside a ubatch deadlocked until the watchdog: {error}")
    finally:
        runner.close()
    assert close_seconds and close_seconds[0] < 1.0


def _unwedge(runner: dbo.UBatchRunner) -> None:
    """Test cleanup: let a caller stuck in `wait_done` return (count every ubatch done)."""
    run = runner._run
    if run is not None:
        for ubatch_id in range(run.num_ubatches):
            if run.baton._live[ubatch_id]:
                run.baton.finish(ubatch_id)


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


@pytest.mark.timeout(20)
def test_close_while_a_run_is_setting_up_refuses_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close(timeout_s) that cannot take the run lock from a run still setting up (it
    has not handed out its jobs) stops the workers; the run then refuses to start."""
    runner = dbo.UBatchRunner(num_ubatches=2)
    reached, gate = threading.Event(), threading.Event()
    outcome: list[object] = []
    backend_for = runner_module.backend_for

    def blocking_backend_for(device: torch.device) -> Any:  # the first run's streams
        reached.set()
        gate.wait(timeout=10)
        return backend_for(device)

    monkeypatch.setattr(runner_module, "backend_for", blocking_backend_for)

    caller = _start_run_in_daemon(runner, outcome)
    hung = _close_mid_run(runner, caller, reached, gate, runner.threads, "its set-up")
    assert not hung, "run() waits forever for jobs handed to workers close() had stopped"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "closed" in str(outcome[0])
    assert not any(thread.is_alive() for thread in runner.threads)


@pytest.mark.timeout(20)
def test_close_while_jobs_are_being_submitted_aborts_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() during the hand-out of the jobs aborts the run: every ubatch unwinds,
    the one whose job came after the abort too, and the caller gets the abort."""
    original_submit = worker.Worker.submit
    reached, gate = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_second_submit(self: object, job: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            reached.set()
            gate.wait(timeout=10)
        original_submit(self, job)  # type: ignore[arg-type]

    monkeypatch.setattr(worker.Worker, "submit", slow_second_submit)
    runner = dbo.UBatchRunner(num_ubatches=2)
    outcome: list[object] = []

    caller = _start_run_in_daemon(runner, outcome)
    hung = _close_mid_run(runner, caller, reached, gate, [], "its second submit")
    assert not hung, "run() waits forever for a job submitted to a stopped worker"
    assert len(outcome) == 1 and isinstance(outcome[0], dbo.UBatchAbortedError), outcome
    assert runner.state is RunnerState.CLOSED
    for thread in runner.threads:  # the run stopped them as it ended
        thread.join(5.0)
    assert not any(thread.is_alive() for thread in runner.threads)


def test_a_runner_dropped_without_close_ends_its_threads() -> None:
    import gc
    import time

    runner = dbo.UBatchRunner(num_ubatches=2)
    runner.run(lambda: None, [((), {}), ((), {})])
    threads = runner.threads
    del runner
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(20)
def test_workers_do_not_keep_the_last_runs_outputs_alive() -> None:
    """A parked worker holds nothing of its last job: the outputs live only as long as
    the caller keeps them."""
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        refs.append(weakref.ref(y))
        return y

    with dbo.UBatchRunner(num_ubatches=2) as runner:
        outputs = runner.run(fn, [((torch.ones(1000),), {}), ((torch.ones(1000),), {})])
        merged = dbo.default_merge(outputs)
        del outputs
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        assert merged.shape == (2000,)
        assert alive == 0, f"{alive} ubatch outputs are still referenced by idle workers"
