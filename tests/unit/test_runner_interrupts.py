"""An interrupt (KeyboardInterrupt, a signal) anywhere in a run, even a second one during
the clean-up, leaves no ubatch thread parked, starts no `fn` the baton had not reached,
and leaves the runner usable once its ubatches have returned."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import dbo
from dbo.runtime import runner as runner_module
from dbo.runtime import worker
from dbo.runtime.baton import Baton
from dbo.runtime.runner import RunnerState, UBatchRunner


def _interrupted_wait(self: UBatchRunner, run: object, timeout_s: float | None) -> None:
    time.sleep(0.02)  # ubatch 0 is running fn by now
    raise KeyboardInterrupt  # stands for a Ctrl-C while the caller waits


@pytest.mark.timeout(30)
def test_an_interrupt_just_before_start_runs_no_fn_and_leaves_the_runner_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted_start(self: Baton) -> None:
        raise KeyboardInterrupt  # a Ctrl-C landing just before the baton starts

    started: list[int] = []
    parts = [((torch.zeros(1),), {})] * 2
    with UBatchRunner(num_ubatches=2) as runner:
        for _ in range(10):
            with monkeypatch.context() as patch:
                patch.setattr(Baton, "start", interrupted_start)
                with pytest.raises(KeyboardInterrupt):
                    runner.run(lambda x: started.append(dbo.current_ubatch_id()) or x, parts)
            assert runner.state is RunnerState.IDLE
            outputs = runner.run(lambda x: x + 1, parts, timeout_s=10.0)
            assert [float(out) for out in outputs] == [1.0, 1.0]
    assert started == [], "an interrupted call still ran fn"


@pytest.mark.timeout(20)
def test_an_interrupt_inside_submit_leaves_the_runner_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt between handing a job to a worker and waking it: the job is revoked
    (it never runs), counted as finished, and the next run works."""
    original = worker.Worker.submit
    calls: list[int] = []

    def interrupted_second_submit(self: object, job: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            self._job = job  # type: ignore[attr-defined]
            raise KeyboardInterrupt
        original(self, job)  # type: ignore[arg-type]

    ran: list[int] = []
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        parts = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
        monkeypatch.setattr(worker.Worker, "submit", interrupted_second_submit)
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: ran.append(dbo.current_ubatch_id()), parts)
        monkeypatch.setattr(worker.Worker, "submit", original)
        assert runner.state is RunnerState.IDLE
        assert 1 not in ran, "the revoked job must never run"
        out = runner.run(lambda x: x + dbo.current_ubatch_id(), parts, timeout_s=5)
        assert [o.item() for o in out] == [0.0, 1.0]


@pytest.mark.timeout(20)
def test_runner_dropped_after_an_interrupted_submit_stops_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A revoked job left in its worker keeps nothing of the run: the runner is collected
    and its threads end, and the interrupted call's inputs are freed."""
    original_submit = worker.Worker.submit
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
    monkeypatch.setattr(worker.Worker, "submit", interrupted_second_submit)
    with pytest.raises(KeyboardInterrupt):
        runner.run(lambda x: x, parts)
    monkeypatch.setattr(worker.Worker, "submit", original_submit)

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


@pytest.mark.timeout(30)
def test_an_interrupted_run_never_starts_a_ubatch_the_baton_had_not_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller is interrupted while ubatch 0 of 3 runs: the revoked jobs 1 and 2 never
    run `fn`, and in particular not alongside ubatch 0."""
    monkeypatch.setattr(UBatchRunner, "_wait", _interrupted_wait)
    started: list[int] = []
    overlapping: list[int] = []
    inside: set[int] = set()

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        started.append(me)
        if inside:
            overlapping.append(me)
        inside.add(me)
        try:
            deadline = time.perf_counter() + 0.1  # Python without a yield
            while time.perf_counter() < deadline:
                if len(inside) > 1:
                    overlapping.append(me)
                    break
        finally:
            inside.discard(me)
        return x

    for _ in range(8):
        started.clear()
        runner = UBatchRunner(num_ubatches=3)
        with pytest.raises(KeyboardInterrupt):
            runner.run(fn, [((torch.zeros(1),), {})] * 3)
        time.sleep(0.15)  # let ubatch 0 finish and every worker unwind
        runner.close(timeout_s=1.0)
        assert overlapping == [], "two ubatches ran fn at once"
        assert started == [0], "a ubatch the baton never reached started fn"


@pytest.mark.timeout(20)
def test_a_forced_abort_wakes_a_holder_parked_in_its_first_wait() -> None:
    """An interrupt between making ubatch 0 the holder and waking it: the abort that
    cleans up wakes the holder too."""
    baton = Baton(2)
    raised: list[int] = []

    def ubatch(ubatch_id: int) -> None:
        try:
            baton.wait_turn(ubatch_id)
        except dbo.UBatchAbortedError:
            raised.append(ubatch_id)

    threads = [threading.Thread(target=ubatch, args=(i,), daemon=True) for i in (0, 1)]
    for thread in threads:
        thread.start()
    with baton._mutex:
        baton._make_holder(0)  # ... and the interrupt lands before the wake-up
    baton.abort("interrupted", wake_all=True)
    for thread in threads:
        thread.join(5.0)
    assert sorted(raised) == [0, 1]


@pytest.mark.timeout(30)
def test_a_second_interrupt_during_the_cleanup_does_not_break_the_runner_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original_wait_done = Baton.wait_done

    def interrupted_grace_wait(self: Baton, timeout_s: float | None = None) -> bool:
        if timeout_s == runner_module._ABORT_GRACE_S:
            raise KeyboardInterrupt  # a second Ctrl-C while the cleanup waits
        return original_wait_done(self, timeout_s)

    runner = UBatchRunner(num_ubatches=2)
    with monkeypatch.context() as patch:
        patch.setattr(UBatchRunner, "_wait", _interrupted_wait)
        patch.setattr(Baton, "wait_done", interrupted_grace_wait)
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: x, [((torch.zeros(1),), {})] * 2)
    deadline = time.monotonic() + 5.0
    while True:  # once the aborted run's ubatches are done, the runner works again
        try:
            out = runner.run(lambda x: x + 1, [((torch.zeros(1),), {})] * 2)
            break
        except RuntimeError:
            assert time.monotonic() < deadline, "the runner stayed unusable"
            time.sleep(0.05)
    assert [float(o) for o in out] == [1.0, 1.0]
    runner.close(timeout_s=1.0)


def test_a_finished_baton_reads_done_even_if_an_interrupted_wait_kept_its_lock() -> None:
    """A Ctrl-C between `wait_done`'s acquire and its release leaves the done lock held:
    the run still reads as done."""
    baton = Baton(1)
    baton.start()
    baton.wait_turn(0)
    baton.finish(0)
    assert baton._done.acquire(timeout=1.0)  # the interrupted waiter took it, never gave back
    assert baton.wait_done(0)
    assert baton.wait_done(0.01)


def test_a_second_interrupt_right_after_a_revoke_still_lets_the_runner_recover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watchdog fires while ubatch 1 has not started; a second interrupt lands
    between revoking its job and counting it as finished. Once ubatch 0 returns, the
    runner is usable again."""
    original_revoke = worker.UBatchJob.revoke

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
            patch.setattr(worker.UBatchJob, "revoke", revoke_then_interrupted)
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


def test_an_interrupt_while_a_runner_starts_its_workers_leaves_none_behind() -> None:
    """A Ctrl-C that lands while the second worker thread starts (the first already
    parked on its wake-up): the constructor stops the workers it started."""
    starts = [0]
    target = threading.Thread.start.__code__

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is target:
            starts[0] += 1
            if starts[0] == 2:  # what a Ctrl-C raises here, with no signal's delivery to time
                raise KeyboardInterrupt
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


@pytest.mark.timeout(30)
def test_an_interrupt_before_the_jobs_are_handed_out_leaves_the_runner_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = UBatchRunner._begin
    calls: list[int] = []

    def begin_then_interrupted(self: UBatchRunner, *args: Any) -> None:
        original(self, *args)
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # a Ctrl-C right after the run began

    monkeypatch.setattr(UBatchRunner, "_begin", begin_then_interrupted)
    parts = [((torch.zeros(1),), {})] * 2
    with UBatchRunner(num_ubatches=2) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: x + 1, parts)
        assert runner.state is RunnerState.IDLE
        assert [out.item() for out in runner.run(lambda x: x + 1, parts)] == [1.0, 1.0]
