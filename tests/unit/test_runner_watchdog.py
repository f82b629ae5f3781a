"""`timeout_s`: a ubatch that holds the baton too long raises `OverlapTimeoutError` naming
it; the runner is broken until that ubatch returns, then usable again; `dbo.overlap`
replaces a broken runner; interpreter exit waits for the ubatch the watchdog gave up on."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import pytest
import torch

import dbo
from dbo.device.backends import CpuBackend, CpuEvent, CpuStream
from dbo.runtime import exit as interpreter_exit
from dbo.runtime import runner as runner_module
from dbo.runtime.runner import RunnerState, UBatchRunner


def _start_daemon(target, *args) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(20)
@pytest.mark.parametrize("timeout_s", [float("inf"), 1e10])
def test_huge_or_infinite_timeout_is_accepted(timeout_s: float) -> None:
    """Infinity means no watchdog; a timeout beyond what locks accept waits at most that."""
    out = dbo.overlap(lambda x: x + 1, timeout_s=timeout_s)(torch.zeros(4))
    assert torch.equal(out, torch.ones(4))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_the_watchdog_clock_restarts_at_every_yield_of_a_ubatch_left_alone(
    num_ubatches: int,
) -> None:
    """`timeout_s` bounds how long a ubatch runs between yield points, also for a ubatch
    left alone (the others returned, or a run of one) that passes the baton to nobody."""
    turns, turn_s, timeout_s = 6, 0.1, 0.4  # each turn well under, all of them well over

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == num_ubatches - 1:
            for _ in range(turns):
                time.sleep(turn_s)
                dbo.yield_()
        return x

    with UBatchRunner(num_ubatches) as runner:
        inputs = [((torch.zeros(2),), {})] * num_ubatches
        outputs = runner.run(fn, inputs, timeout_s=timeout_s)
    assert len(outputs) == num_ubatches


@pytest.mark.timeout(20)
def test_the_watchdog_names_the_stuck_ubatch_and_the_runner_recovers_once_it_returns() -> None:
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            release.wait(timeout=10)
        return x

    parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        with pytest.raises(dbo.OverlapTimeoutError, match="ubatch 1 of 2 held the baton") as info:
            runner.run(stuck, parts, timeout_s=0.3)
        assert info.value.ubatch_id == 1 and "release.wait" in str(info.value)  # its stack
        assert runner.state is RunnerState.BROKEN
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
        assert [o.item() for o in out] == [1.0, 1.0]
        assert runner.state is RunnerState.IDLE


def test_a_run_left_broken_still_orders_the_callers_stream_after_the_ubatch_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        assert runner.state is RunnerState.BROKEN
        joined = {source for target, source in waits if target == "default"}
        assert joined == {"compute0", "comm0", "compute1", "comm1"}
    finally:
        release.set()
        runner.close()


@pytest.mark.timeout(20)
def test_dbo_overlap_replaces_a_broken_runner_whose_threads_then_exit() -> None:
    gate = threading.Event()
    workers: set[threading.Thread] = set()

    def stuck_in_one(x: torch.Tensor) -> torch.Tensor:
        workers.add(threading.current_thread())
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            gate.wait(timeout=10)
        dbo.yield_()
        return x

    wrapped = dbo.overlap(stuck_in_one, num_ubatches=2, timeout_s=0.3)
    try:
        with pytest.raises(dbo.OverlapTimeoutError):
            wrapped(torch.zeros(4))
        assert len(workers) == 2
    finally:
        gate.set()
    assert torch.equal(wrapped(torch.ones(4)), torch.ones(4))  # replaces the runner
    dbo.close_default_runners()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(t.is_alive() for t in workers):
        time.sleep(0.05)
    alive = [t.name for t in workers if t.is_alive()]
    assert alive == [], f"threads of the replaced broken runner are parked forever: {alive}"


@pytest.mark.timeout(30)
def test_a_second_caller_during_a_timed_out_call_is_not_refused() -> None:
    """Each call of a wrapper leases its own runner: a caller that comes while another
    call's watchdog breaks its runner runs normally."""
    gate = threading.Event()
    entered = threading.Event()
    calls = [0]
    lock = threading.Lock()

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            with lock:
                calls[0] += 1
                first = calls[0] == 1
            if first:
                entered.set()
                gate.wait(timeout=15)
        dbo.yield_()
        return x

    wrapped = dbo.overlap(fn, num_ubatches=2, timeout_s=1.0)
    first_error: list[BaseException] = []
    second: list[object] = []

    def first_caller() -> None:
        try:
            wrapped(torch.zeros(4))
        except BaseException as error:  # noqa: B036
            first_error.append(error)

    def second_caller() -> None:
        try:
            second.append(wrapped(torch.ones(4)))
        except BaseException as error:  # noqa: B036
            second.append(error)

    t1 = _start_daemon(first_caller)
    try:
        assert entered.wait(5)
        t2 = _start_daemon(second_caller)
        t1.join(10)
        t2.join(10)
    finally:
        gate.set()
        t1.join(10)
    assert first_error and isinstance(first_error[0], dbo.OverlapTimeoutError)
    assert len(second) == 1
    assert isinstance(second[0], torch.Tensor), f"second caller failed: {second[0]!r}"


@pytest.mark.timeout(30)
def test_a_broken_runner_dropped_without_the_garbage_collector_stops_its_threads() -> None:
    """The aborted run a broken runner keeps refers to it weakly: reference counting
    alone ends the threads of a dropped runner."""
    gate = threading.Event()

    def stuck_in_one(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            gate.wait(timeout=10)
        return x

    gc.disable()
    try:
        runner = UBatchRunner(2)
        workers = list(runner.threads)
        try:
            runner.run(stuck_in_one, [((torch.zeros(2),), {})] * 2, timeout_s=0.3)
        except dbo.OverlapTimeoutError:
            pass
        else:
            pytest.fail("the watchdog did not fire")
        assert runner.state is RunnerState.BROKEN
        gate.set()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and runner.state is RunnerState.BROKEN:
            time.sleep(0.05)
        del runner
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(t.is_alive() for t in workers):
            time.sleep(0.05)
        alive = [t.name for t in workers if t.is_alive()]
        assert alive == [], f"a dropped broken runner kept its threads: {alive}"
    finally:
        gate.set()
        gc.enable()


_EXIT_AFTER_WATCHDOG = """
import sys, time
import torch
import dbo

torch.set_num_threads(1)
a = torch.randn(300, 300)

def slow(x):
    end = time.time() + 1.0
    while time.time() < end:  # torch ops release the GIL: the thread is inside one at exit
        torch.mm(a, a)
    return x

try:
    dbo.overlap(slow, timeout_s=0.3)(torch.zeros(4, 2))
except dbo.OverlapTimeoutError:
    print("watchdog fired", flush=True)
sys.exit(0)
"""


def test_exiting_after_the_watchdog_waits_for_the_ubatch_it_gave_up_on() -> None:
    """The abandoned ubatch runs on in a daemon thread; exit waits (bounded) for it to
    end, instead of killing it inside a torch op (SIGABRT)."""
    completed = subprocess.run(
        [sys.executable, "-c", _EXIT_AFTER_WATCHDOG],
        capture_output=True, text=True, timeout=90,
    )
    assert "watchdog fired" in completed.stdout, completed.stdout + completed.stderr
    assert completed.returncode == 0, completed.stderr


@pytest.mark.timeout(30)
def test_the_exit_wait_keeps_only_runs_whose_ubatches_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each run the watchdog gives up on is kept for the exit wait; once its ubatch has
    returned it is dropped (its wake-ups are file descriptors on Linux)."""
    monkeypatch.setattr(interpreter_exit, "_left_running", [])

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            time.sleep(0.8)  # past timeout_s and the abort's grace: the run is left behind
        return x

    step = dbo.overlap(fn, timeout_s=0.1)
    for _ in range(3):
        with pytest.raises(dbo.OverlapTimeoutError):
            step(torch.zeros(2))
        time.sleep(0.5)  # the stuck ubatch returns
    assert len(interpreter_exit._left_running) == 1
