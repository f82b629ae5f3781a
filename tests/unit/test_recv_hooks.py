"""Recv hooks: a ubatch registers a receive that the next ubatch runs; pending hooks run
before the overlap returns, those for a ubatch that has returned for a bounded number of
rounds; a failing hook fails the overlap and names its owner; a hook runs after its send
and the owner's streams wait for what it enqueued."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _recording_backend import Recording

import dbo
from dbo.device.backends import CpuStream
from dbo.runtime.context import current_context
from dbo.runtime.run import _MAX_RECV_HOOK_ROUNDS, OverlapRun, UBatchStreams

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


@pytest.mark.parametrize("num_ubatches", [1, 2, 3])
def test_a_hook_that_keeps_registering_itself_for_a_returned_ubatch_fails_after_the_bound(
    num_ubatches: int,
) -> None:
    """A hook that keeps registering itself for a ubatch that has returned (a poll that
    never ends) runs `_MAX_RECV_HOOK_ROUNDS` times at the end of the ubatch that
    registered it, then fails the run with the fix, instead of hanging it; one ubatch
    is its own target."""
    runs: list[int] = []

    def poll() -> None:
        runs.append(dbo.current_ubatch_id())
        dbo.register_recv_hook(poll)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == num_ubatches - 1:
            dbo.register_recv_hook(poll)  # for ubatch 0, which has already returned
        return x

    with pytest.raises(RuntimeError, match="ubatch 0, which has returned, kept registering"
                       ) as raised:
        _overlap(fn, num_ubatches=num_ubatches)(torch.zeros(num_ubatches))
    assert "wait for it" in str(raised.value)
    assert runs == [num_ubatches - 1] * _MAX_RECV_HOOK_ROUNDS
    assert _overlap(lambda t: t + 1)(torch.zeros(2)).tolist() == [1.0, 1.0]  # usable


def test_a_receive_in_as_many_stages_as_the_bound_allows_completes() -> None:
    """A hook that registers its next stage until its receive lands finishes when it
    lands within `_MAX_RECV_HOOK_ROUNDS` rounds, all of them in the registering ubatch."""
    stages: list[int] = []

    def stage() -> None:
        stages.append(dbo.current_ubatch_id())
        if len(stages) < _MAX_RECV_HOOK_ROUNDS:  # the receive lands at the last stage
            dbo.register_recv_hook(stage)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            dbo.register_recv_hook(stage)  # for ubatch 0, which has already returned
        return x * 2

    assert _overlap(fn)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert stages == [1] * _MAX_RECV_HOOK_ROUNDS


def test_a_returned_ubatch_runs_every_hook_the_previous_one_registers_as_it_goes() -> None:
    """A returned ubatch runs the hooks the previous ubatch keeps registering for it,
    one per step of that ubatch: that is the program's progress, and more of them than
    `_MAX_RECV_HOOK_ROUNDS` run."""
    steps = _MAX_RECV_HOOK_ROUNDS + 5
    ran: list[tuple[int, int]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            for step in range(steps):
                dbo.register_recv_hook(
                    lambda step=step: (ran.append((step, dbo.current_ubatch_id())), dbo.yield_())
                )
                dbo.yield_()
        return x

    _overlap(fn)(torch.zeros(2))
    assert ran == [(step, 1) for step in range(steps)]


# ----------------------------------------------------------------------- stream order


def _run_of(num_ubatches: int) -> tuple[OverlapRun, Recording, list[UBatchStreams]]:
    backend = Recording()
    streams = [
        UBatchStreams(CpuStream(f"compute{i}"), CpuStream(f"comm{i}")) for i in range(num_ubatches)
    ]
    return OverlapRun(num_ubatches, backend, streams, owner=None), backend, streams


def _register_on(run: OverlapRun, stream: CpuStream, ubatch_id: int, hook: Any) -> None:
    """`ubatch_id` registers `hook` while `stream` is its thread's current stream."""
    run.backend.set_current_stream(stream)
    try:
        run.register_recv_hook(ubatch_id, hook)
    finally:
        run.backend.set_current_stream(run.backend._default)  # type: ignore[attr-defined]


def _run_on(run: OverlapRun, stream: CpuStream, ubatch_id: int, **options: Any) -> bool:
    """`ubatch_id`'s thread, on `stream`, runs the hooks pending for it."""
    run.backend.set_current_stream(stream)
    try:
        return run.maybe_run_recv_hook(ubatch_id, **options)
    finally:
        run.backend.set_current_stream(run.backend._default)  # type: ignore[attr-defined]


def test_a_recv_hook_runs_on_its_owners_comm_stream() -> None:
    """The hook of ubatch 1 runs in ubatch 0's thread, on ubatch 1's comm stream, after
    the event recorded on ubatch 1's stream when it registered the hook (not after
    ubatch 0's work); ubatch 1's compute stream then waits for what the hook enqueued."""
    run, backend, streams = _run_of(2)
    received: list[str] = []
    _register_on(run, streams[1].compute, 1, lambda: received.append(
        backend.current_stream().name
    ))
    assert _run_on(run, streams[0].comm, 0)
    assert received == ["comm1"]
    assert backend.ordering() == [
        ("record", "compute1"),  # at registration: the send
        ("wait", "comm1", "compute1"),  # before the hook
        ("record", "comm1"), ("wait", "compute1", "comm1"),  # after it
    ]  # fmt: skip


def test_a_hook_run_by_its_own_ubatch_stays_on_its_stream_after_its_send() -> None:
    """A hook its own ubatch runs (its target has returned) goes to the thread's current
    stream, ordered after the stream it was registered on; nothing of the returned
    ubatch's streams is used."""
    run, backend, streams = _run_of(2)
    received: list[str] = []
    _register_on(run, streams[0].comm, 0, lambda: received.append(
        backend.current_stream().name
    ))  # for ubatch 1, which has returned
    assert _run_on(run, streams[0].compute, 1, running=0)
    assert received == ["compute0"]
    assert backend.ordering() == [("record", "comm0"), ("wait", "compute0", "comm0")]


def test_a_two_stage_hook_runs_both_stages_on_its_first_owners_comm_stream() -> None:
    """A stage a hook registers belongs to that hook's owner: with 3 ubatches, both
    stages, each run in another thread, go to the owner's comm stream, the second after
    the first, the owner's compute stream waits for each, and no stream of ubatch 1 or 2
    waits for anything."""
    run, backend, streams = _run_of(3)
    ran_on: list[str] = []

    def stage_two() -> None:  # runs in ubatch 2's thread
        ran_on.append(backend.current_stream().name)

    def stage_one() -> None:  # runs in ubatch 1's thread
        ran_on.append(backend.current_stream().name)
        run.register_recv_hook(1, stage_two)  # as dbo.register_recv_hook in ubatch 1

    _register_on(run, streams[0].compute, 0, stage_one)
    assert _run_on(run, streams[1].compute, 1)
    assert _run_on(run, streams[2].compute, 2)  # the second stage, in the next thread
    assert ran_on == ["comm0", "comm0"]
    assert backend.waits() == [
        ("comm0", "compute0"), ("compute0", "comm0"),  # around stage one
        ("comm0", "comm0"), ("compute0", "comm0"),  # stage two: after stage one
    ]  # fmt: skip


def test_the_hooks_that_ran_before_a_failing_one_still_order_their_owners_streams() -> None:
    def fail() -> None:
        raise ValueError("receive failed")

    run, backend, streams = _run_of(2)
    _register_on(run, streams[0].compute, 0, lambda: None)  # a receive that completes
    _register_on(run, streams[0].compute, 0, fail)
    with pytest.raises(ValueError, match="receive failed") as raised:
        _run_on(run, streams[1].compute, 1)
    assert raised.value.__notes__ == ["in a recv hook registered by ubatch 0"]
    assert backend.waits() == [("comm0", "compute0"), ("compute0", "comm0")] * 2  # both hooks


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
