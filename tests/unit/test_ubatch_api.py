"""Calls made inside fn: stream switches (CPU protocol), recv hooks, the runner object."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import dbo
from dbo.device import CpuStream


# ---------------------------------------------------------------- outside an overlap
def test_every_call_is_a_no_op_outside_an_overlap() -> None:
    assert dbo.current_ubatch_id() == 0
    assert dbo.enabled() is False
    assert dbo.num_ubatches() == 1
    dbo.yield_()
    dbo.switch_to_comm()
    dbo.switch_to_compute()
    dbo.switch_to_compute()  # no stream state outside: unmatched switches are fine
    dbo.yield_and_switch_to_comm()
    dbo.yield_and_switch_to_compute()
    assert dbo.current_stream() is None
    assert dbo.on_comm_stream() is False
    assert dbo.maybe_run_recv_hook() is False


def test_recv_hook_outside_an_overlap_runs_at_once() -> None:
    ran: list[str] = []
    dbo.register_recv_hook(lambda: ran.append("recv"))
    assert ran == ["recv"]
    with pytest.raises(TypeError):
        dbo.register_recv_hook("not callable")  # type: ignore[arg-type]


# ---------------------------------------------------------------- streams (CPU protocol)
def test_stream_switches_follow_the_protocol() -> None:
    seen: dict[int, list[tuple[str, bool]]] = {0: [], 1: []}

    def note(me: int) -> None:
        stream = dbo.current_stream()
        assert isinstance(stream, CpuStream)
        seen[me].append((stream.name, dbo.on_comm_stream()))

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        note(me)
        dbo.switch_to_comm()
        note(me)
        dbo.yield_and_switch_to_compute()
        note(me)
        dbo.yield_and_switch_to_comm()
        note(me)
        dbo.switch_to_compute()
        note(me)
        return x

    dbo.overlap(fn)(torch.zeros(2))
    for me in (0, 1):
        compute, comm = (f"compute{me}", False), (f"comm{me}", True)
        assert seen[me] == [compute, comm, compute, comm, compute]


def test_unmatched_switch_inside_an_overlap_is_an_error() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        dbo.switch_to_compute()  # already on compute
        return x

    with pytest.raises(RuntimeError, match="already on its compute stream"):
        dbo.overlap(fn)(torch.zeros(2))

    def twice(x: torch.Tensor) -> torch.Tensor:
        dbo.switch_to_comm()
        dbo.yield_and_switch_to_comm()
        return x

    with pytest.raises(RuntimeError, match="already on its comm stream"):
        dbo.overlap(twice)(torch.zeros(2))


def test_yield_and_switch_hands_the_baton_over() -> None:
    order: list[tuple[int, str]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        order.append((me, "compute"))
        dbo.yield_and_switch_to_comm()
        order.append((me, "comm"))
        dbo.yield_and_switch_to_compute()
        order.append((me, "back"))
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert order == [
        (0, "compute"), (1, "compute"), (0, "comm"), (1, "comm"), (0, "back"), (1, "back"),
    ]  # fmt: skip


# ---------------------------------------------------------------- recv hooks
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


# ---------------------------------------------------------------- the runner object
def test_runner_runs_each_input_in_its_ubatch() -> None:
    with dbo.UBatchRunner(num_ubatches=3) as runner:
        inputs = [((torch.full((2,), float(i)),), {"scale": 10}) for i in range(3)]
        outputs = runner.run(lambda x, scale: x * scale + dbo.current_ubatch_id(), inputs)
        assert [o.tolist() for o in outputs] == [[0.0, 0.0], [11.0, 11.0], [22.0, 22.0]]
        assert len(runner.threads) == 3 and all(t.daemon for t in runner.threads)
    assert runner.closed
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(lambda: None, [((), {})] * 3)
    runner.close()  # idempotent


def test_runner_rejects_bad_inputs_before_running() -> None:
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        with pytest.raises(ValueError, match="2 ubatches but got 1"):
            runner.run(lambda: None, [((), {})])
        with pytest.raises(TypeError, match=r"ubatch_inputs\[1\]"):
            runner.run(lambda: None, [((), {}), ([], {})])  # type: ignore[list-item]
        assert runner.run(lambda: 1, [((), {}), ((), {})]) == [1, 1]


def test_runner_refuses_to_run_inside_its_own_ubatch() -> None:
    with dbo.UBatchRunner(num_ubatches=2) as runner:

        def fn() -> None:
            runner.run(lambda: None, [((), {}), ((), {})])

        with pytest.raises(RuntimeError, match="ubatch thread of one of its own runs"):
            runner.run(fn, [((), {}), ((), {})])


def test_runner_refuses_to_run_inside_a_run_nested_in_its_own() -> None:
    """Runner A's ubatch runs runner B, whose ubatch asks A for a run: A's run lock is
    held by the run that waits for B, so the call would wait for itself."""
    parts = [((), {}), ((), {})]
    with dbo.UBatchRunner(num_ubatches=2) as outer, dbo.UBatchRunner(num_ubatches=2) as inner:

        def innermost() -> None:
            outer.run(lambda: None, parts)

        def middle() -> None:
            if dbo.current_ubatch_id() == 0:
                inner.run(innermost, parts)

        with pytest.raises(RuntimeError, match="a run nested in one of its own runs"):
            outer.run(middle, parts, timeout_s=30.0)
        assert outer.run(lambda: 1, parts) == [1, 1]  # both still usable
        assert inner.run(lambda: 2, parts) == [2, 2]


def test_concurrent_callers_are_serialized() -> None:
    failures: list[BaseException] = []
    with dbo.UBatchRunner(num_ubatches=2) as runner:

        def caller(value: float) -> None:
            try:
                for _ in range(50):
                    out = runner.run(
                        lambda x: (dbo.yield_(), x + 1)[1],
                        [((torch.tensor(value),), {}), ((torch.tensor(value),), {})],
                    )
                    assert [o.item() for o in out] == [value + 1, value + 1]
            except BaseException as error:  # noqa: B036 - reported below
                failures.append(error)

        threads = [threading.Thread(target=caller, args=(float(v),)) for v in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
    assert failures == []


def test_one_ubatch_runs_without_handoffs() -> None:
    assert torch.equal(
        dbo.overlap(lambda x: (dbo.yield_(), x * 2)[1], num_ubatches=1)(torch.ones(3)),
        torch.full((3,), 2.0),
    )


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


def test_a_recv_hook_orders_its_owners_streams_after_the_receive() -> None:
    # The hook of ubatch 1 runs in ubatch 0's thread, so its kernels (a receive) go to
    # ubatch 0's current stream; ubatch 1 reads the received data on its own streams,
    # which must wait for an event recorded after the hook.
    from dbo._run import OverlapRun, UBatchStreams
    from dbo.device import CpuBackend, CpuEvent, CpuStream

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
    assert received == ["comm0"]
    assert log == [
        ("record", "comm0", ""), ("wait", "compute1", "comm0"), ("wait", "comm1", "comm0"),
    ]  # fmt: skip


def test_a_hook_run_by_its_own_ubatch_needs_no_event() -> None:
    from dbo._run import OverlapRun, UBatchStreams
    from dbo.device import CpuBackend, CpuStream

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


# ---------------------------------------------- recv hooks: found in the tenth session
@pytest.mark.timeout(30)
def test_a_hook_registered_while_its_target_runs_its_last_hooks_still_runs() -> None:
    """The target ran its pending hooks and only then counted itself finished: a hook
    that yielded let the previous ubatch register another and return, seeing a target
    not yet finished, and nobody ever ran that one (the overlap returned normally)."""
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
    """All pending hooks were taken off the queue before they ran: when one raised (and
    `fn` caught it), the ones after it were lost without a trace."""
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


def test_a_two_stage_hook_orders_its_first_owners_streams_after_both_stages() -> None:
    """A hook that registers its second stage registered it as the running ubatch's own:
    with 3 ubatches the second stage's owner was the ubatch that ran the first stage, so
    the ubatch that reads the data never waited for the second stage's kernels."""
    from dbo._run import OverlapRun, UBatchStreams
    from dbo.device import CpuBackend, CpuEvent, CpuStream

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
        ("compute0", "compute1"), ("comm0", "compute1"),  # after stage one
        ("compute0", "compute2"), ("comm0", "compute2"),  # after stage two
    ]  # fmt: skip


def test_the_outputs_are_handed_over_to_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the outputs' memory belongs to the ubatch streams' pools; the caller's
    merge reads it on its own stream, so the runner tells the allocator (record_stream)
    that the caller's stream uses them from now on. A failed run hands nothing over."""
    from dbo import runner as runner_module
    from dbo.device import CpuBackend

    handed: list[tuple[Any, str]] = []

    class RecordingBackend(CpuBackend):
        def hand_over(self, outputs: Any, stream: CpuStream) -> None:
            handed.append((outputs, stream.name))

    monkeypatch.setattr(runner_module, "backend_for", lambda device: RecordingBackend())
    with dbo.UBatchRunner(2) as runner:
        outputs = runner.run(lambda x: x * 2, [((torch.ones(2),), {}), ((torch.zeros(2),), {})])
        assert len(handed) == 1 and handed[0][0] is outputs
        assert handed[0][1] == RecordingBackend().current_stream().name  # the caller's

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise ValueError("no outputs")

        with pytest.raises(ValueError):
            runner.run(fail, [((torch.ones(2),), {})] * 2)
    assert len(handed) == 1


def test_a_returned_ubatchs_own_hooks_are_not_under_the_polling_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ubatch that has returned runs the hooks the other one keeps registering for it,
    one per step of the other: that is the other's progress, not a hook polling, and
    must not count against the limit meant for hooks that re-register themselves."""
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


def test_the_hooks_that_ran_before_a_failing_one_still_order_their_owners_streams() -> None:
    from dbo._run import OverlapRun, UBatchStreams
    from dbo.device import CpuBackend, CpuEvent, CpuStream

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
    assert waits == [("compute0", "compute1"), ("comm0", "compute1")]
