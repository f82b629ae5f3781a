"""`comm.CollectiveWork`, the handle of an `async_op=True` collective, behaves as torch's
`Work` (return value, timeout, failure, future), yields only at its first wait, and
hands collectives an aborted ubatch leaves in flight to `comm._abandoned`; plus the
all-gather / reduce-scatter layout checks. A world of one (gloo).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm
import comm._checks
import comm.collectives
import comm.distributed
import dbo
from comm import _abandoned
from comm.collectives import CollectiveWork


class _FakeWork:
    """A stand-in for torch's `Work`: `outcomes` says what each wait() does in turn (an
    exception to raise, or a value to return); `completed` what is_completed() says."""

    def __init__(self, *outcomes: Any, completed: bool = True) -> None:
        self.outcomes = list(outcomes)
        self.completed = completed
        self.wait_args: list[tuple[Any, ...]] = []

    def wait(self, *args: Any) -> Any:
        self.wait_args.append(args)
        outcome = self.outcomes.pop(0) if self.outcomes else True
        if isinstance(outcome, BaseException):
            try:
                raise outcome
            finally:  # no cycle through this frame (torch's wait raises from C++)
                del outcome
        return outcome

    def is_completed(self) -> bool:
        return self.completed


# --- CollectiveWork.wait ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_wait_returns_true_like_torchs_work(world_of_one: None) -> None:
    tensor = torch.ones(3)
    assert dist.all_reduce(tensor, async_op=True).wait() is True  # torch's behaviour
    handle = comm.all_reduce(tensor, async_op=True)
    assert handle is not None
    assert handle.wait() is True
    assert handle.wait() is True  # a second wait after success: at once, True again


@pytest.mark.timeout(60)
def test_a_failed_wait_raises_the_original_and_later_waits_chain_it() -> None:
    """A failed handle never returns as if the data had arrived: the first wait raises
    the original error, every later one a RuntimeError naming the collective, chained
    to the original."""
    failure = ConnectionError("peer 1 closed the connection")
    work = _FakeWork(failure, True)  # a second underlying wait would "succeed"
    output = torch.zeros(2)
    handle = CollectiveWork(work, (output,), yields=False, name="all_reduce")
    with pytest.raises(ConnectionError) as first:
        handle.wait()
    assert first.value is failure
    for _ in range(2):
        with pytest.raises(RuntimeError) as again:
            handle.wait()
        assert type(again.value) is RuntimeError
        assert str(again.value) == (
            "the collective all_reduce failed: ConnectionError: peer 1 closed the connection"
        )
        assert again.value.__cause__ is failure
    assert len(work.wait_args) == 1  # the failure is remembered, not retried
    assert handle._tensors == ()  # released once failed
    assert "failed: ConnectionError" in repr(handle)


@pytest.mark.timeout(60)
def test_wait_passes_torchs_timeout_through(world_of_one: None) -> None:
    work = _FakeWork(True)
    handle = CollectiveWork(work, (), yields=False)
    assert handle.wait(timedelta(seconds=2)) is True
    assert work.wait_args == [(timedelta(seconds=2),)]
    plain = _FakeWork(True)
    assert CollectiveWork(plain, (), yields=False).wait() is True
    assert plain.wait_args == [()]  # no timeout: torch's own default

    real = comm.all_reduce(torch.ones(2), async_op=True)
    assert real is not None
    assert real.wait(timedelta(seconds=30)) is True
    with pytest.raises(TypeError, match="timedelta"):
        CollectiveWork(_FakeWork(True), (), yields=False).wait(5)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_wait_whose_own_timeout_passed_leaves_the_handle_in_flight() -> None:
    """As torch's Work: `wait(timeout)` passing its timeout while the collective is still
    in flight raises, and a later wait waits again; the tensors stay referenced."""
    timed_out = RuntimeError("Operation timed out!")
    work = _FakeWork(timed_out, True, completed=False)
    output = torch.zeros(2)
    handle = CollectiveWork(work, (output,), yields=False)
    with pytest.raises(RuntimeError, match="timed out"):
        handle.wait(timedelta(milliseconds=10))
    assert handle._tensors == (output,)
    assert "in flight" in repr(handle)
    work.completed = True
    assert handle.wait() is True
    assert len(work.wait_args) == 2


@pytest.mark.timeout(60)
def test_get_future_and_result_are_the_underlying_works(world_of_one: None) -> None:
    tensor = torch.ones(3)
    handle = comm.all_reduce(tensor, async_op=True)
    assert handle is not None
    future = handle.get_future()
    assert isinstance(future, torch._C.Future)  # what torch's Work.get_future returns
    value = future.wait()
    assert torch.equal(value[0], torch.ones(3))
    assert handle.wait() is True
    second = comm.all_reduce(tensor, async_op=True)
    assert second is not None
    second.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Work::result API is being deprecated"
        result = second.result()
    assert len(result) == 1 and torch.equal(result[0], tensor)


# --- all-gather / reduce-scatter layouts -----------------------------------------------


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (instead of running) every all-gather / reduce-scatter launch."""
    seen: list[str] = []

    def record(name: str) -> Any:
        def launch(*args: Any) -> None:
            seen.append(name)

        return launch

    monkeypatch.setattr(comm.collectives, "_all_gather", record("all_gather"))
    monkeypatch.setattr(comm.collectives, "_reduce_scatter", record("reduce_scatter"))
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("output_shape", "input_shape"),
    [((1, 4), (4,)), ((1, 2, 3), (2, 3)), ((6,), (2, 3)), ((1,), ())],
)
def test_all_gather_layouts_gloo_rejects_raise_before_launching(
    world_of_one: None, launches: list[str], output_shape: tuple[int, ...],
    input_shape: tuple[int, ...],
) -> None:
    """gloo takes only `output` [world_size * n, *rest]; other layouts raise ValueError
    naming the shapes before any launch."""
    with pytest.raises(ValueError) as error:
        comm.all_gather_into_tensor(torch.zeros(output_shape), torch.ones(input_shape))
    message = str(error.value)
    assert str(output_shape) in message and str(input_shape) in message
    assert "concatenation" in message and "world_size * input.shape[0]" in message
    assert launches == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("output_shape", "input_shape"),
    [((4,), (1, 4)), ((2, 3), (1, 2, 3)), ((2, 3), (6,)), ((), (1,))],
)
def test_reduce_scatter_layouts_gloo_rejects_raise_before_launching(
    world_of_one: None, launches: list[str], output_shape: tuple[int, ...],
    input_shape: tuple[int, ...],
) -> None:
    """gloo takes only `input` [world_size * n, *rest] (a 0-dim `output` crashes it);
    other layouts raise ValueError before any launch."""
    with pytest.raises(ValueError) as error:
        comm.reduce_scatter_tensor(torch.zeros(output_shape), torch.ones(input_shape))
    message = str(error.value)
    assert str(output_shape) in message and str(input_shape) in message
    assert "world_size * output.shape[0]" in message
    assert launches == []


@pytest.mark.timeout(60)
def test_the_concatenation_layout_still_runs_on_gloo(world_of_one: None) -> None:
    output = torch.zeros(2, 3)
    comm.all_gather_into_tensor(output, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(output, torch.arange(6.0).reshape(2, 3))
    scattered = torch.zeros(4)
    comm.reduce_scatter_tensor(scattered, torch.arange(4.0))
    assert torch.equal(scattered, torch.arange(4.0))
    with pytest.raises(ValueError, match="elements"):  # the element count is checked too
        comm.all_gather_into_tensor(torch.zeros(5), torch.ones(4))


@pytest.mark.timeout(60)
def test_nccl_layouts_pass_the_check_where_nccl_runs_the_tensors(
    world_of_one: None, launches: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL checks only element counts, so the stack layout reaches the launch there."""
    monkeypatch.setattr(comm._checks, "runs_on_nccl", lambda group, tensor: True)
    comm.all_gather_into_tensor(torch.zeros(1, 4), torch.ones(4))
    comm.reduce_scatter_tensor(torch.zeros(4), torch.ones(1, 4))
    comm.reduce_scatter_tensor(torch.zeros(()), torch.ones(1))
    assert launches == ["all_gather", "reduce_scatter", "reduce_scatter"]


@pytest.mark.timeout(60)
def test_only_the_first_wait_may_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    """Yield points must not depend on timing: a wait whose own timeout passed (timing)
    must not make the next wait yield again, nor a first wait(yield_first=False)."""
    yields: list[int] = []
    inside = SimpleNamespace(enabled=lambda: True, yield_=lambda: yields.append(1),
                             blocking_wait=dbo.blocking_wait)
    monkeypatch.setattr(comm.collectives, "dbo", inside)
    timed_out = CollectiveWork(
        _FakeWork(RuntimeError("Operation timed out!"), True, completed=False), (), yields=True
    )
    with pytest.raises(RuntimeError):
        timed_out.wait(timedelta(milliseconds=10))
    assert timed_out.wait() is True
    assert yields == [1]
    unyielded = CollectiveWork(
        _FakeWork(RuntimeError("Operation timed out!"), True, completed=False), (), yields=True
    )
    with pytest.raises(RuntimeError):
        unyielded.wait(timedelta(milliseconds=10), yield_first=False)
    assert unyielded.wait() is True
    assert yields == [1]


def test_a_failed_handle_releases_its_tensors() -> None:
    import weakref

    activation = torch.zeros(1000)
    alive = weakref.ref(activation)
    handle = CollectiveWork(_FakeWork(RuntimeError("peer lost")), (activation,), yields=False)
    del activation
    with contextlib.suppress(RuntimeError):
        handle.wait()
    assert alive() is None  # a failed handle holds none of the call's tensors


class _StrRaises(RuntimeError):
    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")


def test_a_failure_whose_str_fails_is_still_raised_and_chained() -> None:
    failure = _StrRaises()
    handle = CollectiveWork(_FakeWork(failure), (), yields=False, name="all_gather")
    with pytest.raises(_StrRaises) as first:
        handle.wait()
    assert first.value is failure
    with pytest.raises(RuntimeError, match="all_gather failed: _StrRaises") as again:
        handle.wait()
    assert again.value.__cause__ is failure


# --- collectives an aborted ubatch leaves in flight ------------------------------------


@pytest.fixture(autouse=True)
def _own_abandoned_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test keeps its abandoned Works apart: a fake that never completes must not
    reach the process-wide list, which is settled (up to 30 s) when pytest exits."""
    monkeypatch.setattr(_abandoned, "_works", [])


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_an_unwaited_handle_on_cuda_tensors_is_left_to_settle_unless_nccl_runs_it(
    backend: str,
) -> None:
    """gloo runs a collective on host threads, on CUDA tensors too: a handle dropped
    unwaited goes to `comm._abandoned`. NCCL's teardown handles its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, device="cuda:0")
    group = SimpleNamespace(name=lambda: backend)
    work = _FakeWork(completed=False)
    handle = comm.collectives._run("all_reduce", lambda *args: work, (x,), (x,), group, True)
    del handle
    gc.collect()
    assert _abandoned.in_flight() == (1 if backend == "gloo" else 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("later", ["an explicit yield", "the next collective"])
def test_an_async_handle_dropped_by_an_abort_at_a_later_yield_is_settled(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, later: str
) -> None:
    """Aborted at a yield after its launch (exit callbacks do not run then), a handle
    never waited hands its in-flight Work to `comm._abandoned` when it is dropped."""
    launched: list[_FakeWork] = []

    def launch(*args: Any) -> _FakeWork:
        launched.append(_FakeWork(completed=False))
        return launched[-1]

    monkeypatch.setattr(dist, "all_reduce", launch)

    def body(x: torch.Tensor) -> torch.Tensor:
        import dbo

        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        handle = comm.all_reduce(x, async_op=True)  # no yield yet
        if later == "an explicit yield":
            dbo.yield_()
        else:
            comm.all_reduce(torch.ones(4))  # its yield is where the abort lands
        handle.wait()
        return x

    import gc

    import dbo

    gc.disable()  # freed by reference counting: the process may end before a collection
    try:
        try:
            dbo.overlap(body)(torch.zeros(4))
        except ValueError as error:
            # Kept, with its traceback (the runner's frames), as an uncaught error is
            # until interpreter exit, after the exit handlers that settle the list.
            failure = error
        assert "ubatch 1 fails" in str(failure)
        assert _abandoned.in_flight() == len(launched)  # the handle's (and the next one's)
        del failure
    finally:
        gc.enable()
        for work in launched:
            work.completed = True
    assert _abandoned.settle(5.0) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_op", [False, True])
def test_a_collective_left_in_flight_by_an_aborted_ubatch_is_settled(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, async_op: bool
) -> None:
    """A ubatch aborted at the yield after its launch leaves its Work in flight; it is
    kept, never waited, until `settle()` (at exit, in destroy_distributed) sees it over,
    so the process does not exit while gloo still runs it."""
    in_flight = _FakeWork(completed=False)
    monkeypatch.setattr(dist, "all_reduce", lambda *args: in_flight)

    def body(x: torch.Tensor) -> torch.Tensor:
        import dbo

        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        handle = comm.all_reduce(x, async_op=async_op)  # ubatch 0: launch, yield
        if handle is not None:
            handle.wait()
        return x

    import dbo

    assert _abandoned.settle(0.0) == 0
    try:
        with pytest.raises(ValueError, match="ubatch 1 fails"):
            dbo.overlap(body)(torch.zeros(4))
        assert _abandoned.in_flight() == 1
        assert _abandoned.settle(0.05) == 1  # still running: kept, after a bounded wait
        assert _abandoned.in_flight() == 1
    finally:
        in_flight.completed = True
    assert _abandoned.settle(5.0) == 0
    assert _abandoned.in_flight() == 0
    assert in_flight.wait_args == []  # never waited: the error was not delayed


def test_destroy_distributed_settles_abandoned_collectives(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []
    monkeypatch.setattr(comm.distributed, "settle", lambda timeout_s=1.0: calls.append(timeout_s))
    comm.destroy_distributed()
    assert len(calls) == 1


def test_an_interrupted_settle_keeps_the_collectives_still_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while `settle()` waits (in `destroy_distributed()`): the exit-time settle
    must still know the collective is running."""
    class StillRunning:
        def is_completed(self) -> bool:
            return False

    _abandoned.abandon(StillRunning())  # kept in this test's own list (the fixture's)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(_abandoned.time, "sleep", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _abandoned.settle(timeout_s=5.0)
    assert _abandoned.in_flight() == 1


def test_an_abort_at_the_wait_keeps_no_cycle_holding_the_ubatchs_tensors(
    world_of_one: None,
) -> None:
    """A ubatch aborted inside its handle's wait (another ubatch failed) frees its
    activations by reference counting: a caller retrying after an out-of-memory error
    needs that memory back at once, not at the next garbage collection."""
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            dbo.yield_()
            raise ValueError("ubatch 0 fails")
        activations = torch.randn(100, 10)
        refs.append(weakref.ref(activations))
        handle = comm.all_reduce(x.clone(), async_op=True)
        handle.wait()  # aborted at its yield
        return x + activations.sum()

    gc.disable()
    try:
        with pytest.raises(ValueError, match="ubatch 0 fails"):
            dbo.overlap(fn, timeout_s=30)(torch.zeros(4, 2))
        assert len(refs) == 1 and refs[0]() is None
    finally:
        gc.enable()


def test_a_handle_abandoned_by_an_abort_raises_a_plain_error_on_a_later_wait(
    world_of_one: None,
) -> None:
    handles: list[CollectiveWork] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            dbo.yield_()
            raise ValueError("ubatch 0 fails")
        handles.append(comm.all_reduce(x.clone(), async_op=True))
        handles[0].wait()
        return x

    with pytest.raises(ValueError):
        dbo.overlap(fn, timeout_s=30)(torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="was abandoned: UBatchAbortedError") as raised:
        handles[0].wait()
    assert raised.value.__cause__ is None
    assert "abandoned" in repr(handles[0])
