"""Robustness: hangs, races and edge cases found in review, one test per finding.

Every wait is bounded: blocking fns wait on a gate with a timeout, helper threads are
daemons joined with a timeout, and each test that could hang has a pytest timeout.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import dbo
from dbo import runner as runner_module
from dbo.baton import Baton
from dbo.runner import UBatchRunner

_overlap_module = sys.modules["dbo.overlap"]  # `dbo.overlap` is the function


def _start_daemon(target, *args) -> threading.Thread:  # type: ignore[no-untyped-def]
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------- 1. close() and hangs
@pytest.mark.timeout(20)
def test_close_timeout_bounds_the_wait_for_a_running_overlap() -> None:
    """close(timeout_s) blocks on the run lock with no bound: atexit's close_all hangs the
    interpreter's exit while a daemon caller thread is inside a stuck overlap."""
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
def test_close_from_inside_a_ubatch_does_not_deadlock() -> None:
    """run() refuses a nested run of its own runner, but close() from a ubatch waits on
    the run lock its own caller holds: a deadlock (here cut short by the watchdog)."""
    runner = dbo.UBatchRunner(num_ubatches=2)
    close_seconds: list[float] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            started = time.perf_counter()
            with contextlib.suppress(RuntimeError):  # refusing is fine; blocking is not
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


@pytest.mark.timeout(20)
def test_threads_of_a_replaced_broken_runner_exit() -> None:
    """A runner left broken by the watchdog must not keep its worker threads parked
    forever once the stuck ubatch returns."""
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
def test_caller_queued_behind_a_timed_out_run_is_not_refused() -> None:
    """A second caller of the same wrapper, already waiting on the runner's run lock when
    the first caller's watchdog breaks the runner, gets 'this UBatchRunner is unusable'
    instead of a replaced runner (the docs say the wrapper stays usable)."""
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
def test_helper_thread_inside_fn_can_call_an_overlapped_function() -> None:
    """A helper thread started inside a ubatch is 'outside an overlap' (docs), so its call
    of an overlapped fn goes to the shared runner, whose run lock the outer caller holds
    while the ubatch waits for the helper: a deadlock (forever without timeout_s)."""
    inner = dbo.overlap(lambda x: x * 2, num_ubatches=2)

    def outer_fn(x: torch.Tensor) -> torch.Tensor:
        box: list[torch.Tensor] = []

        def call_inner() -> None:
            with contextlib.suppress(RuntimeError):  # reported by the assertion below
                box.append(inner(x))

        helper = threading.Thread(target=call_inner, daemon=True)
        helper.start()
        helper.join(timeout=5)
        return box[0] if box else x * 0 - 1

    outer = dbo.overlap(outer_fn, num_ubatches=2, timeout_s=3.0)
    try:
        out = outer(torch.ones(4))
    except dbo.OverlapTimeoutError as error:
        pytest.fail(f"helper thread's overlap deadlocked on the shared runner: {error}")
    assert torch.equal(out, torch.full((4,), 2.0))


# ---------------------------------------------------------------- 2. watchdog / abort
@pytest.mark.timeout(20)
@pytest.mark.parametrize("timeout_s", [float("inf"), 1e10])
def test_huge_or_infinite_timeout_is_accepted(timeout_s: float) -> None:
    """check_timeout accepts inf, but lock.acquire(timeout=inf) raises OverflowError inside
    `_wait`, which then aborts the run (and breaks the runner if a ubatch is slow)."""
    out = dbo.overlap(lambda x: x + 1, timeout_s=timeout_s)(torch.zeros(4))
    assert torch.equal(out, torch.ones(4))


@pytest.mark.timeout(30)
def test_async_exception_before_the_baton_starts_does_not_wedge_the_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs are submitted outside the try in `_run_locked`: a KeyboardInterrupt (signal)
    between `submit` and `baton.start()` leaves every worker parked in `wait_turn` of a
    baton nobody starts, and the runner is not marked broken, so the next run hangs."""
    started_batons: list[Baton] = []
    original_start = Baton.start

    def interrupted_start(self: Baton) -> None:
        started_batons.append(self)
        if len(started_batons) == 1:
            raise KeyboardInterrupt  # stands for a Ctrl-C landing just before start()
        original_start(self)

    monkeypatch.setattr(Baton, "start", interrupted_start)
    runner = dbo.UBatchRunner(num_ubatches=2)
    parts = [((torch.ones(1),), {}), ((torch.ones(1),), {})]
    outcome = "ok"
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: x, parts)
        time.sleep(0.3)  # the user re-runs later; the workers have picked up their jobs
        try:
            runner.run(lambda x: x, parts, timeout_s=2.0)
        except dbo.OverlapTimeoutError:
            outcome = "hung"
        except RuntimeError as error:
            # A clear refusal is acceptable; `release unlocked lock` from submit() is not.
            outcome = "refused" if "unusable" in str(error) else f"crashed: {error!r}"
    finally:
        for baton in started_batons:  # unpark the wedged workers
            baton.abort("test cleanup", wake_all=True)
        time.sleep(0.3)
        with contextlib.suppress(RuntimeError):
            runner.close(timeout_s=1.0)
    assert outcome in ("ok", "refused"), f"the run after the interrupted one: {outcome}"


# ---------------------------------------------------------------- 3. memory retention
@pytest.mark.timeout(20)
def test_workers_do_not_keep_the_last_runs_outputs_alive() -> None:
    """`_Worker._loop` keeps its last `job` bound while parked; the job holds the run's
    `results` and `errors` lists, so each ubatch's output (and a failure's traceback
    frames) stays alive until the runner's next call: on CUDA, a batch of activations."""
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


# ---------------------------------------------------------------- 4. split / pytree
def test_mutations_of_a_list_argument_reach_the_caller() -> None:
    """Containers are rebuilt per ubatch even when they hold nothing to split: a list the
    caller passes for fn to fill stays empty. (tests/unit/test_overlap.py::
    test_order_is_deterministic_across_runs passes vacuously because of this.)"""
    log: list[int] = []

    def fn(x: torch.Tensor, log: list[int]) -> torch.Tensor:
        log.append(dbo.current_ubatch_id())
        return x

    dbo.overlap(fn)(torch.zeros(4), log)
    assert sorted(log) == [0, 1]


def test_defaultdict_argument_is_rebuilt() -> None:
    """`unflatten` rebuilds dict subclasses as `node_type(zip(keys, values))`:
    defaultdict(zip) raises TypeError (and loses default_factory)."""
    table = collections.defaultdict(list, {"a": torch.zeros(4)})
    out = dbo.overlap(lambda x, t: x + t["a"])(torch.ones(4), table)
    assert torch.equal(out, torch.ones(4))


def test_counter_argument_is_not_silently_corrupted() -> None:
    """Counter(zip(keys, values)) counts the (key, value) pairs: silently wrong."""
    seen: list[object] = []

    def fn(x: torch.Tensor, counts: collections.Counter[str]) -> torch.Tensor:
        seen.append(dict(counts))
        return x

    dbo.overlap(fn)(torch.ones(4), collections.Counter(a=3))
    assert seen == [{"a": 3}, {"a": 3}]


@dataclass(frozen=True)
class _Batch:
    x: torch.Tensor
    num_rows: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_rows", int(self.x.shape[0]))


def test_dataclass_fields_derived_in_post_init_match_the_ubatch() -> None:
    """Dataclasses are rebuilt through their constructor, so a field derived in
    __post_init__ (init=False) matches the ubatch's part, not the whole batch."""
    seen: list[tuple[int, int]] = []

    def fn(batch: _Batch) -> torch.Tensor:
        seen.append((int(batch.x.shape[0]), batch.num_rows))
        return batch.x

    dbo.overlap(fn)(_Batch(torch.zeros(4, 2)))
    assert seen == [(2, 2), (2, 2)]


# ---------------------------------------------------------------- 5. thread settings
def test_default_device_context_is_replayed_in_workers() -> None:
    """`with torch.device(...)` (and torch.set_default_device) is a thread-local
    TorchFunctionMode; workers do not replay it, so factory calls inside fn land on a
    different device than the same fn run inline."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0])  # no explicit device: follows the default device

    x = torch.zeros(4)
    with torch.device("meta"):
        inline = fn(x)
        overlapped = dbo.overlap(fn)(x)
    assert inline.device.type == "meta"
    assert overlapped.device.type == inline.device.type


# ---------------------------------------------------------------- 6. CUDA (by reading)
@pytest.mark.gpu
def test_a_cpu_tensor_first_does_not_select_the_cpu_backend() -> None:
    """`_first_tensor_device` takes the first tensor leaf of any kind: a CPU scalar or
    index tensor before the CUDA batch selects the CPU backend, so the ubatches launch on
    their thread's default stream with no fork/join against the caller's stream."""
    streams: list[object] = []

    def fn(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        streams.append(dbo.current_stream())
        return x * scale.item()

    x = torch.ones(4, device="cuda")
    dbo.overlap(fn)(torch.tensor(2.0), x)
    assert all(isinstance(s, torch.cuda.Stream) for s in streams), streams


@pytest.mark.timeout(20)
def test_an_interrupt_inside_submit_leaves_the_runner_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt between handing a job to a worker and waking it: the job is revoked
    (it never runs), the run's count of finished ubatches stays right, and the next run
    works."""


    original = runner_module._Worker.submit
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
        monkeypatch.setattr(runner_module._Worker, "submit", interrupted_second_submit)
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: ran.append(dbo.current_ubatch_id()), parts)
        monkeypatch.setattr(runner_module._Worker, "submit", original)
        assert not runner.broken
        assert 1 not in ran, "the revoked job must never run"
        out = runner.run(lambda x: x + dbo.current_ubatch_id(), parts, timeout_s=5)
        assert [o.item() for o in out] == [0.0, 1.0]


# ------------------------------------------------ 5. cleaning up never hands the baton on
@pytest.mark.timeout(30)
def test_an_interrupted_run_never_starts_a_ubatch_the_baton_had_not_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller is interrupted while ubatch 0 of 3 runs: revoking job 1 must not make
    ubatch 2 the holder (it would run `fn` alongside ubatch 0)."""
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


def _interrupted_wait(self: UBatchRunner, run: object, timeout_s: float | None) -> None:
    time.sleep(0.02)  # ubatch 0 is running fn by now
    raise KeyboardInterrupt  # stands for a Ctrl-C while the caller waits


@pytest.mark.timeout(30)
def test_an_interrupt_just_before_start_runs_no_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted_start(self: Baton) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Baton, "start", interrupted_start)
    started: list[int] = []
    for _ in range(20):
        runner = UBatchRunner(num_ubatches=2)
        with pytest.raises(KeyboardInterrupt):
            runner.run(lambda x: started.append(dbo.current_ubatch_id()) or x,
                       [((torch.zeros(1),), {})] * 2)
        time.sleep(0.02)
        runner.close(timeout_s=1.0)
    assert started == [], "an interrupted call still ran fn"


def test_a_finished_baton_reads_done_even_if_an_interrupted_wait_kept_its_lock() -> None:
    """A Ctrl-C between `wait_done`'s acquire and its release leaves the done lock held:
    the run must still read as done (else its runner is refused for good)."""
    baton = Baton(1)
    baton.start()
    baton.wait_turn(0)
    baton.finish(0)
    assert baton._done.acquire(timeout=1.0)  # the interrupted waiter took it, never gave back
    assert baton.wait_done(0)
    assert baton.wait_done(0.01)


# ------------------------------------------- 6. unwinding order, forced aborts, races
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_after_a_failure_the_others_unwind_one_at_a_time_in_ring_order(
    num_ubatches: int,
) -> None:
    """A ubatch that handed the baton on but had not parked yet when the next one failed
    must still unwind in its turn (its `finally` blocks may launch collectives, whose
    order must match across ranks), not alongside the holder."""
    order: list[int] = []

    def make_fn(failing: int) -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            me = dbo.current_ubatch_id()
            try:
                for turn in range(5):
                    if me == failing and turn == 2:
                        raise ValueError("boom")
                    dbo.yield_()
                return x
            except dbo.UBatchAbortedError:
                order.append(me)
                raise

        return fn

    with UBatchRunner(num_ubatches=num_ubatches) as runner:
        for failing in range(num_ubatches):
            for _ in range(15):
                order.clear()
                with pytest.raises(ValueError, match="boom"):
                    runner.run(make_fn(failing), [((torch.zeros(1),), {})] * num_ubatches,
                               timeout_s=10.0)
                expected = [(failing + k) % num_ubatches for k in range(1, num_ubatches)]
                assert order == expected


@pytest.mark.timeout(20)
def test_a_forced_abort_wakes_a_holder_parked_in_its_first_wait() -> None:
    """An interrupt between making ubatch 0 the holder and waking it leaves it parked as
    the holder: the abort that cleans up must wake it too."""
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


@pytest.mark.parametrize("failing_ubatch", [0, 1])
def test_a_failed_call_frees_its_inputs_when_the_caller_drops_the_error(
    failing_ubatch: int,
) -> None:
    # A serving loop that catches an out-of-memory error and retries smaller needs the
    # failed call's memory back at once, without waiting for the garbage collector:
    # nothing may hold the error in a reference cycle (the frames on its traceback).
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        dbo.yield_()
        if dbo.current_ubatch_id() == failing_ubatch:
            raise ValueError("boom")
        return y

    overlapped = dbo.overlap(fn)
    gc.disable()
    try:
        x = torch.randn(64, 32)
        alive = weakref.ref(x)
        with pytest.raises(ValueError, match="boom"):
            overlapped(x)
        del x
        deadline = time.monotonic() + 5.0  # the workers may still be leaving their frames
        while alive() is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert alive() is None
    finally:
        gc.enable()


# ------------------------------------------- 9. an exception whose str() fails (review 6)
class _StrRaises(Exception):
    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")  # e.g. unpickled without its fields


class _StrNotAString(Exception):
    def __str__(self) -> str:
        return None  # type: ignore[return-value]  # str() then raises TypeError


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", [_StrRaises, _StrNotAString])
def test_an_exception_whose_str_fails_aborts_the_others_and_leaves_the_runner_usable(
    kind: type[Exception],
) -> None:
    """Formatting the abort reason called str() on the error: when that raised, the
    others were not aborted and the worker thread died, so the next call on the pooled
    runner hung (or, with timeout_s, timed out forever after)."""
    reached_after_yield: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            raise kind()
        dbo.yield_()
        reached_after_yield.append(dbo.current_ubatch_id())
        return x * 2

    step = dbo.overlap(fn, timeout_s=10.0)
    x = torch.ones(4, 3)
    with pytest.raises(kind) as raised:
        step(x)
    assert raised.value.ubatch_id == 0  # type: ignore[attr-defined]
    assert reached_after_yield == []  # ubatch 1 was aborted at its yield
    workers = [t for t in threading.enumerate() if t.name.startswith("dbo-ubatch")]
    assert all(t.is_alive() for t in workers)
    for _ in range(3):  # the same pooled runner, and its workers, again
        assert torch.equal(dbo.overlap(lambda t: t * 2, timeout_s=10.0)(x), x * 2)


def test_the_abort_reason_survives_an_exception_whose_str_fails() -> None:
    from dbo.errors import describe

    assert describe(ValueError("bad split")) == "ValueError: bad split"
    assert describe(_StrRaises()).startswith("_StrRaises")
    assert describe(_StrNotAString()).startswith("_StrNotAString")


@pytest.mark.timeout(30)
def test_a_worker_outlives_an_error_escaping_its_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever escapes a job is the runtime's own bug; the worker must report it and
    keep serving, or its ubatch never starts again and every later run hangs."""
    original_finish = Baton.finish
    failures = [RuntimeError("bookkeeping bug")]

    def finish_then_fail(self: Baton, ubatch_id: int) -> None:
        original_finish(self, ubatch_id)
        if failures and ubatch_id == 1:
            raise failures.pop()

    monkeypatch.setattr(Baton, "finish", finish_then_fail)
    with UBatchRunner(2) as runner:
        x = torch.ones(4, 3)
        parts = [((x[:2],), {}), ((x[2:],), {})]
        for _ in range(3):
            outputs = runner.run(lambda t: t + 1, parts, timeout_s=10.0)
            assert [torch.equal(out, part[0][0] + 1) for out, part in zip(outputs, parts)] == [
                True, True,
            ]
    assert failures == []
    assert "unexpected error in worker" in capsys.readouterr().err


@pytest.mark.parametrize("notes", [("tagged upstream",), "not even a sequence of notes"])
def test_an_error_whose_notes_are_not_a_list_still_reaches_the_caller(notes: object) -> None:
    """Some code sets `__notes__` to a tuple (or worse); `add_note` then raises TypeError,
    which must not replace the ubatch's own error."""

    class Tagged(ValueError):
        pass

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            error = Tagged("the real failure")
            error.__notes__ = notes  # type: ignore[attr-defined]
            raise error
        return x

    with pytest.raises(Tagged, match="the real failure") as caught:
        dbo.overlap(fn, timeout_s=30)(torch.ones(4))
    assert caught.value.ubatch_id == 1  # type: ignore[attr-defined]
    assert any("raised in ubatch 1 of 2" in note for note in caught.value.__notes__)


_EXIT_AFTER_WATCHDOG = """
import sys, time
import torch
import dbo

torch.set_num_threads(1)
a = torch.randn(300, 300)

def slow(x):
    end = time.time() + 2.0
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
    """The abandoned ubatch runs on in a daemon thread; interpreter exit while it is in a
    torch op killed it inside C++ ("terminate called without an active exception",
    SIGABRT). Exit now waits (bounded) for it to end."""
    import subprocess

    completed = subprocess.run(
        [sys.executable, "-c", _EXIT_AFTER_WATCHDOG],
        capture_output=True, text=True, timeout=90,
    )
    assert "watchdog fired" in completed.stdout, completed.stdout + completed.stderr
    assert completed.returncode == 0, completed.stderr


# ------------------------------------------------- 5. runtime edge cases (tenth session)
@pytest.mark.timeout(30)
def test_a_ubatch_raising_an_abort_error_of_its_own_aborts_the_others() -> None:
    """`UBatchAbortedError` raised by `fn` while the run was not aborted (re-raised from
    a run of another runner, say) is this ubatch's failure: the others must unwind at
    their next yield point, not run on as if nothing happened."""
    reached_after_yield: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            raise dbo.UBatchAbortedError("an inner run was aborted")
        dbo.yield_()
        reached_after_yield.append(dbo.current_ubatch_id())
        return x

    with UBatchRunner(2) as runner:
        with pytest.raises(dbo.UBatchAbortedError, match="an inner run was aborted") as caught:
            runner.run(fn, [((torch.zeros(2),), {}), ((torch.zeros(2),), {})], timeout_s=10)
        assert caught.value.ubatch_id == 0  # type: ignore[attr-defined]
        assert reached_after_yield == []
        assert runner.run(lambda x: x + 1, [((torch.zeros(1),), {})] * 2, timeout_s=10)[0] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_the_watchdog_clock_restarts_at_every_yield_of_a_ubatch_left_alone(
    num_ubatches: int,
) -> None:
    """`timeout_s` bounds how long a ubatch runs between yield points. A ubatch left
    alone (the others returned, or a run of one) passes the baton to nobody at its
    yields, and its whole tail counted as one turn: a long but live loop timed out."""
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


@pytest.mark.timeout(30)
def test_a_broken_runner_dropped_without_the_garbage_collector_stops_its_threads() -> None:
    """The run a watchdog gave up on referred back to its runner (`owner`), a cycle:
    a broken runner dropped by its last user kept its threads and wake-ups until the
    garbage collector happened to run."""
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
        assert runner.broken
        gate.set()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and workers[1].is_alive() and runner.broken:
            if runner._aborted_run is not None and runner._aborted_run.baton.wait_done(0.05):
                break
        del runner
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(t.is_alive() for t in workers):
            time.sleep(0.05)
        alive = [t.name for t in workers if t.is_alive()]
        assert alive == [], f"a dropped broken runner kept its threads: {alive}"
    finally:
        gate.set()
        gc.enable()
