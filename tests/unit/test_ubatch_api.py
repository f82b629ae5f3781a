"""Calls made inside fn (no-ops outside an overlap), the stream protocol on the CPU
backend, and the runner object."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

import dbo
from dbo.device.backends import CpuBackend, CpuStream
from dbo.device.streams import distinct_streams
from dbo.runtime import runner as runner_module

# ----------------------------------------------------------------- outside an overlap


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


# ------------------------------------------------------------- streams (CPU protocol)


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


def test_the_outputs_are_handed_over_to_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs are handed over to the caller's stream (on CUDA: `record_stream`, as
    the caller's merge reads them there). A failed run hands nothing over."""

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


def test_ubatch_streams_are_distinct_queues_and_not_the_callers() -> None:
    # CUDA's pool hands out streams round-robin: a Stream object may be a queue already
    # in use. A backend whose pool has 5 queues, the caller on queue 0.

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
    streams = distinct_streams(backend, 4)
    assert sorted(s.name for s in streams) == ["queue1", "queue2", "queue3", "queue4"]
    with pytest.raises(RuntimeError, match="distinct streams"):
        distinct_streams(SmallPool(), 5)


@pytest.mark.gpu
def test_a_cpu_tensor_first_does_not_select_the_cpu_backend() -> None:
    """A CPU scalar before the CUDA batch does not select the CPU backend: the ubatches
    run on CUDA streams of their own."""
    streams: list[object] = []

    def fn(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        streams.append(dbo.current_stream())
        return x * scale.item()

    x = torch.ones(4, device="cuda")
    dbo.overlap(fn)(torch.tensor(2.0), x)
    assert all(isinstance(s, torch.cuda.Stream) for s in streams), streams


# ------------------------------------------------------------------ the runner object


def test_runner_runs_each_input_in_its_ubatch() -> None:
    with dbo.UBatchRunner(num_ubatches=3) as runner:
        inputs = [((torch.full((2,), float(i)),), {"scale": 10}) for i in range(3)]
        outputs = runner.run(lambda x, scale: x * scale + dbo.current_ubatch_id(), inputs)
        assert [o.tolist() for o in outputs] == [[0.0, 0.0], [11.0, 11.0], [22.0, 22.0]]
        assert len(runner.threads) == 3 and all(t.daemon for t in runner.threads)
    assert runner.state is dbo.RunnerState.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(lambda: None, [((), {})] * 3)
    runner.close()  # idempotent


def test_runner_rejects_bad_inputs_before_running() -> None:
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        with pytest.raises(ValueError, match="pair per ubatch: num_ubatches=2, got 1"):
            runner.run(lambda: None, [((), {})])
        with pytest.raises(TypeError, match=r"ubatch_inputs\[1\]"):
            runner.run(lambda: None, [((), {}), ([], {})])  # type: ignore[list-item]
        assert runner.run(lambda: 1, [((), {}), ((), {})]) == [1, 1]


def test_a_malformed_ubatch_input_is_described_by_what_is_inside_the_pair() -> None:
    """The error names the types inside a malformed pair (`([1], {})`: a list, not args)."""
    with dbo.UBatchRunner(2) as runner:
        with pytest.raises(TypeError, match=r"got a pair of \(list, dict\)"):
            runner.run(lambda x: x, [([1], {}), ([2], {})])
        with pytest.raises(TypeError, match="got a list"):
            runner.run(lambda x: x, [[(1,), {}], [(2,), {}]])


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


@pytest.mark.timeout(30)
def test_helper_thread_inside_fn_can_call_an_overlapped_function() -> None:
    """A helper thread started inside a ubatch is outside the overlap: its overlapped call
    leases a runner of its own instead of waiting for the run that waits for it."""
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


def test_one_ubatch_runs_without_handoffs() -> None:
    assert torch.equal(
        dbo.overlap(lambda x: (dbo.yield_(), x * 2)[1], num_ubatches=1)(torch.ones(3)),
        torch.full((3,), 2.0),
    )
