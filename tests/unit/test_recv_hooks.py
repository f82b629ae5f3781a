"""Recv hooks: a ubatch registers a receive that the next ubatch runs; pending hooks run
before the overlap returns; a failing hook fails the overlap and names its owner; the
owner's streams wait for what its hooks enqueued."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dbo
from dbo._context import current_context
from dbo._run import OverlapRun, UBatchStreams
from dbo.device import CpuBackend, CpuEvent, CpuStream

TIMEOUT_S = 30.0


def _overlap(fn, **options):  # type: ignore[no-untyped-def]
    return dbo.overlap(fn, timeout_s=TIMEOUT_S, **options)


def test_recv_hook_outside_an_overlap_runs_at_once() -> None:
    ran: list[str] = []
    dbo.register_recv_hook(lambda: ran.append("recv"))
    assert ran == ["recv"]
    with pytest.raises(TypeError):
        dbo.register_recv_hook("not callable")  # type: ignore[arg-type]


def test_recv_hook_runs_in_the_next_ubatch_once() -> None:
    runs: list[tuple[str, int]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        dbo.register_recv_hook(lambda: runs.append((f"recv of {me}", dbo.current_ubatch_id())))
        dbo.yield_()
        ran = dbo.maybe_run_recv_hook()
        ran_again = dbo.maybe_run_recv_hook()
        runs.append((f"ubatch {me} ran={ran} again={ran_again}", me))
        dbo.yield_()
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert runs == [
        ("recv of 1", 0),  # ubatch 1's hook goes to ubatch 0 (the next in the ring) ...
        ("ubatch 0 ran=True again=False", 0),
        ("recv of 0", 1),  # ... and ubatch 0's to ubatch 1
        ("ubatch 1 ran=True again=False", 1),
    ]


def test_pending_recv_hooks_run_before_the_overlap_returns() -> None:
    runs: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        dbo.register_recv_hook(lambda: runs.append(me))  # nobody calls maybe_run_recv_hook
        return x

    dbo.overlap(fn, num_ubatches=3)(torch.zeros(3))
    assert sorted(runs) == [0, 1, 2]


def test_an_exception_in_a_recv_hook_fails_the_overlap() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:

            def hook() -> None:
                raise ZeroDivisionError("in hook")

            dbo.register_recv_hook(hook)
        dbo.yield_()
        dbo.maybe_run_recv_hook()
        dbo.yield_()
        return x

    with pytest.raises(ZeroDivisionError) as info:
        dbo.overlap(fn)(torch.zeros(2))
    assert "ubatch 1 of 2" in "\n".join(info.value.__notes__)


def test_a_failing_recv_hook_names_the_ubatch_that_registered_it() -> None:
    # The error surfaces in the ubatch that ran the hook (the next one in the ring);
    # without a note its author would look in the wrong ubatch's code.
    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            def hook() -> None:
                raise RuntimeError("receive failed")

            dbo.register_recv_hook(hook)
        dbo.yield_()
        dbo.maybe_run_recv_hook()
        return x

    with pytest.raises(RuntimeError, match="receive failed") as raised:
        dbo.overlap(fn, timeout_s=30)(torch.ones(4, 2))
    notes = raised.value.__notes__
    assert "in a recv hook registered by ubatch 0" in notes
    assert "raised in ubatch 1 of 2 (dbo overlap)" in notes


@pytest.mark.timeout(30)
def test_a_hook_registered_while_its_target_runs_its_last_hooks_still_runs() -> None:
    """A hook registered for a ubatch that is running its last hooks (one of them
    yielded) still runs before that ubatch counts as finished."""
    ran: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:

            def first() -> None:
                ran.append("first")
                dbo.yield_()  # as a collective handle's wait() does

            dbo.register_recv_hook(first)
            dbo.yield_()
            dbo.register_recv_hook(lambda: ran.append("second"))
        return x

    dbo.overlap(fn, timeout_s=10)(torch.zeros(2))
    assert ran == ["first", "second"]


@pytest.mark.timeout(30)
def test_a_failing_hook_leaves_the_hooks_after_it_pending() -> None:
    """The hooks after a failing one stay queued: `fn` may catch the error and run them."""
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("receive failed")

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            dbo.register_recv_hook(fail)
            dbo.register_recv_hook(lambda: ran.append("after"))
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            with pytest.raises(ValueError, match="receive failed"):
                dbo.maybe_run_recv_hook()
            assert dbo.maybe_run_recv_hook()  # the second hook is still there
        return x

    dbo.overlap(fn, timeout_s=10)(torch.zeros(2))
    assert ran == ["after"]


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_a_hook_registered_by_a_hook_run_for_a_finished_ubatch_still_runs(
    num_ubatches: int,
) -> None:
    ran: list[str] = []

    def second() -> None:
        ran.append("second")

    def first() -> None:
        ran.append("first")
        dbo.register_recv_hook(second)  # a two-stage receive

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == num_ubatches - 1:
            dbo.register_recv_hook(first)  # for ubatch 0, which has already returned
        return x

    _overlap(fn, num_ubatches=num_ubatches)(torch.zeros(num_ubatches))
    assert ran == ["first", "second"]


def test_a_hook_that_keeps_registering_itself_for_a_finished_ubatch_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook that keeps registering itself for a ubatch that has returned (a poller that
    never stops) fails the run after a bounded time."""
    from dbo import _run

    monkeypatch.setattr(_run, "_HOOK_POLL_LIMIT_S", 0.2)
    runs: list[int] = []

    def poll() -> None:
        runs.append(1)
        dbo.register_recv_hook(poll)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            dbo.register_recv_hook(poll)  # for ubatch 0, which has already returned
        return x

    with pytest.raises(RuntimeError, match="kept registering new hooks"):
        _overlap(fn)(torch.zeros(2))
    assert len(runs) > 1
    assert _overlap(lambda t: t + 1)(torch.zeros(2)).tolist() == [1.0, 1.0]  # usable


def test_a_hook_that_polls_until_its_receive_completes_finishes() -> None:
    done = threading.Event()
    threading.Timer(0.02, done.set).start()  # the receive completes a little later
    polls: list[int] = []

    def poll() -> None:
        polls.append(1)
        if not done.is_set():
            dbo.register_recv_hook(poll)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            dbo.register_recv_hook(poll)
        return x

    _overlap(fn)(torch.zeros(2))
    assert done.is_set() and len(polls) > 1


def test_a_returned_ubatchs_own_hooks_are_not_under_the_polling_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A returned ubatch runs the hooks the other one keeps registering for it, one per
    step of the other: that is progress, not polling, and has no time limit."""
    from dbo import _run

    monkeypatch.setattr(_run, "_HOOK_POLL_LIMIT_S", 0.2)
    ran: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            for step in range(4):
                dbo.register_recv_hook(lambda step=step: (ran.append(step), dbo.yield_()))
                dbo.yield_()
                time.sleep(0.1)  # 4 steps: twice the limit in all
        return x

    dbo.overlap(fn, timeout_s=30)(torch.zeros(2))
    assert ran == [0, 1, 2, 3]


# ----------------------------------------------------------------------- stream order


def test_a_recv_hook_runs_on_its_owners_comm_stream() -> None:
    # The hook of ubatch 1 runs in ubatch 0's thread, on ubatch 1's comm stream, ordered
    # after ubatch 1's compute stream (where ubatch 1 is parked), not after ubatch 0's
    # work; ubatch 1's compute stream then waits for what the hook enqueued.

    log: list[tuple[str, str, str]] = []

    class RecordingBackend(CpuBackend):
        def record_event(self, stream: CpuStream) -> CpuEvent:
            log.append(("record", stream.name, ""))
            return super().record_event(stream)

        def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
            log.append(("wait", stream.name, event.stream.name))
            super().wait_event(stream, event)

    backend = RecordingBackend()
    streams = [UBatchStreams(CpuStream(f"compute{i}"), CpuStream(f"comm{i}")) for i in (0, 1)]
    run = OverlapRun(2, backend, streams, owner=None)
    received: list[str] = []
    run.register_recv_hook(1, lambda: received.append(backend.current_stream().name))
    backend.set_current_stream(streams[0].comm)  # ubatch 0's thread, on its comm stream
    try:
        assert run.maybe_run_recv_hook(0)
    finally:
        backend.set_current_stream(backend._default)
    assert received == ["comm1"]
    assert log == [
        ("record", "compute1", ""), ("wait", "comm1", "compute1"),  # before the hook
        ("record", "comm1", ""), ("wait", "compute1", "comm1"),  # after it
    ]  # fmt: skip


def test_a_hook_run_by_its_own_ubatch_needs_no_event() -> None:
    events: list[object] = []

    class CountingBackend(CpuBackend):
        def record_event(self, stream: CpuStream) -> object:
            events.append(stream)
            return super().record_event(stream)

    streams = [UBatchStreams(CpuStream(f"compute{i}"), CpuStream(f"comm{i}")) for i in (0, 1)]
    run = OverlapRun(2, CountingBackend(), streams, owner=None)
    run.register_recv_hook(0, lambda: None)  # for ubatch 1, which has already finished
    assert run.maybe_run_recv_hook(1, running=0)
    assert events == []


def test_a_two_stage_hook_runs_both_stages_on_its_first_owners_comm_stream() -> None:
    """A stage a hook registers belongs to that hook's owner: with 3 ubatches, both
    stages, each run in another thread, go to the owner's comm stream, and the owner's
    compute stream waits for each."""

    waits: list[tuple[str, str]] = []

    class RecordingBackend(CpuBackend):
        def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
            waits.append((stream.name, event.stream.name))
            super().wait_event(stream, event)

    backend = RecordingBackend()
    streams = [UBatchStreams(CpuStream(f"compute{i}"), CpuStream(f"comm{i}")) for i in range(3)]
    run = OverlapRun(3, backend, streams, owner=None)

    def stage_one() -> None:  # runs in ubatch 1's thread
        run.register_recv_hook(1, lambda: None)  # its second stage, as dbo.register_recv_hook

    run.register_recv_hook(0, stage_one)
    try:
        backend.set_current_stream(streams[1].compute)
        assert run.maybe_run_recv_hook(1)
        backend.set_current_stream(streams[2].compute)
        assert run.maybe_run_recv_hook(2)  # the second stage, in the next thread
    finally:
        backend.set_current_stream(backend._default)
    assert waits == [
        ("comm0", "compute0"), ("compute0", "comm0"),  # around stage one
        ("comm0", "compute0"), ("compute0", "comm0"),  # around stage two
    ]  # fmt: skip


def test_the_hooks_that_ran_before_a_failing_one_still_order_their_owners_streams() -> None:
    waits: list[tuple[str, str]] = []

    class RecordingBackend(CpuBackend):
        def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
            waits.append((stream.name, event.stream.name))
            super().wait_event(stream, event)

    def fail() -> None:
        raise ValueError("receive failed")

    backend = RecordingBackend()
    streams = [UBatchStreams(CpuStream(f"compute{i}"), CpuStream(f"comm{i}")) for i in (0, 1)]
    run = OverlapRun(2, backend, streams, owner=None)
    run.register_recv_hook(0, lambda: None)  # a receive that completes
    run.register_recv_hook(0, fail)
    try:
        backend.set_current_stream(streams[1].compute)
        with pytest.raises(ValueError):
            run.maybe_run_recv_hook(1)
    finally:
        backend.set_current_stream(backend._default)
    assert waits == [("comm0", "compute0"), ("compute0", "comm0")] * 2  # both hooks


def test_a_hook_after_another_ubatchs_hook_runs_on_its_own_ubatchs_stream() -> None:
    """Ubatch 1 runs ubatch 0's hook (on comm0), then the second stage of its own
    receive: that stage goes back to ubatch 1's stream, not comm0."""
    seen: dict[str, str] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        context = current_context()
        assert context is not None and context.run is not None
        backend = context.run.backend

        def note(key: str) -> None:
            seen[key] = backend.current_stream().name

        if dbo.current_ubatch_id() == 0:
            dbo.yield_()
            dbo.register_recv_hook(lambda: note("hook of 0"))
            dbo.maybe_run_recv_hook()  # ubatch 1's first stage, which queues its second
            dbo.yield_()
        else:
            dbo.register_recv_hook(lambda: (note("stage 1"), dbo.register_recv_hook(
                lambda: note("stage 2")
            )))
            dbo.yield_()
            dbo.maybe_run_recv_hook()  # ubatch 0's hook, then stage 2 of its own
            note("ubatch 1 after")
        return x

    _overlap(fn)(torch.zeros(2))
    assert seen == {
        "stage 1": "comm1", "hook of 0": "comm0", "stage 2": "compute1",
        "ubatch 1 after": "compute1",
    }  # fmt: skip
