"""`dbo.capture_graph` on CPU: its checks, and its control flow with the CUDA capture
faked (warmup on the ubatch threads, workspace lock, capture, cleanup after a failure);
the CUDA part itself is in tests/gpu/test_capture_graph.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import comm
import dbo
import dbo.graphs
import workspace
from dbo._torch_private import private
from dbo.runtime.context import num_registered_threads


class FakeCapture:
    """Stands in for `dbo.graphs._Capture`: records the calls in `log`."""

    log: list[str] = []

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = device
        self.graph = self  # replay() below plays the CUDA graph's part

    @contextmanager
    def current_stream(self) -> Iterator[None]:
        self.log.append("stream")
        try:
            yield
        finally:
            self.log.append("stream done")

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self.log.append("begin")
        try:
            yield
        except BaseException:
            self.log.append("abandon")
            raise
        self.log.append("end")

    def replay(self) -> None:
        self.log.append("replay")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """capture_graph with CPU tensors, its CUDA capture faked; the call log."""
    FakeCapture.log = []
    monkeypatch.setattr(dbo.graphs, "_Capture", FakeCapture)
    monkeypatch.setattr(dbo.graphs, "_cuda_device", lambda inputs: torch.device("cpu"))
    return FakeCapture.log


def logging_fn(log: list[str], fail_at_call: int | None = None) -> Any:
    """A function that logs each ubatch's call (and its phase), yields once, and raises
    at call `fail_at_call` of ubatch 1 (counting from 1)."""
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            calls[0] += 1
            if calls[0] == fail_at_call:
                raise ValueError("boom")
        log.append(f"fn {dbo.current_ubatch_id()}")
        dbo.yield_()
        return x * 2

    return fn


def test_the_api_is_exported_and_documented() -> None:
    assert {"capture_graph", "OverlapGraph"} <= set(dbo.__all__)
    doc = dbo.capture_graph.__doc__ or ""
    for phrase in ("warmup", "CUDA graphs need a CUDA device", "decision_group", "locked"):
        assert phrase in doc
    assert dbo.OverlapGraph.replay.__doc__ and dbo.OverlapGraph.__call__.__doc__


def test_cpu_inputs_raise_the_cuda_device_error_before_running_fn() -> None:
    ran: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return x

    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device.*cpu"):
        dbo.capture_graph(fn, torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device.*no tensor"):
        dbo.capture_graph(fn, 3)
    assert ran == []


@pytest.mark.parametrize("options", [{"decision_group": object()}, {}])
def test_an_overlap_wrapper_is_refused_naming_the_decision_group(options: dict[str, Any]) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("fn must not run")

    match = r"dbo.overlap wrapper; pass the function.*decision_group"
    with pytest.raises(RuntimeError, match=match):
        dbo.capture_graph(dbo.overlap(fn, **options), torch.zeros(4, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup": 0}, ValueError, "warmup must be an int >= 1"),
        ({"warmup": 1.0}, TypeError, "warmup must be an int >= 1"),
        ({"warmup": True}, TypeError, "warmup must be an int >= 1"),
        ({"num_ubatches": 0}, ValueError, "num_ubatches"),
        ({"num_ubatches": "2"}, TypeError, "num_ubatches"),
        ({"pool": "my pool"}, TypeError, "pool must be a torch.cuda.graph_pool_handle"),
        ({"pool": (1, 2, 3)}, TypeError, "pool must be"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        dbo.capture_graph(lambda x: x, torch.zeros(4, 2), **kwargs)
    with pytest.raises(TypeError, match="needs a callable"):
        dbo.capture_graph(3, torch.zeros(4, 2))  # type: ignore[arg-type]


def test_a_batch_smaller_than_num_ubatches_is_refused(fake_cuda: list[str]) -> None:
    with pytest.raises(ValueError, match="num_ubatches=3 parts, but they hold a batch of 2"):
        dbo.capture_graph(lambda x: x, torch.zeros(2, 2), num_ubatches=3)
    with pytest.raises(ValueError, match="no tensor with a dim 0"):
        dbo.capture_graph(lambda x: x, torch.tensor(1.0))
    assert fake_cuda == []


def test_inside_an_overlap_it_raises() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with pytest.raises(RuntimeError, match="inside an overlap"):
            dbo.capture_graph(lambda y: y, x)
        return x

    dbo.overlap(fn)(torch.zeros(4, 2))


@pytest.mark.parametrize("warmup", [1, 3])
def test_warmup_runs_on_the_ubatch_threads_then_one_captured_run(
    fake_cuda: list[str], warmup: int
) -> None:
    x = torch.arange(8.0).reshape(4, 2)
    graph = dbo.capture_graph(logging_fn(fake_cuda), x, warmup=warmup)
    run = ["fn 0", "fn 1"]
    assert fake_cuda == ["stream", *run * warmup, "begin", *run, "end", "stream done"]
    assert torch.equal(graph.outputs, x * 2)
    assert graph.static_inputs[0] is x


def test_calling_the_graph_copies_into_the_static_inputs_then_replays(
    fake_cuda: list[str],
) -> None:
    x = torch.zeros(4, 2)
    graph = dbo.capture_graph(lambda t: t + 1, x)
    fake_cuda.clear()
    new = torch.ones(4, 2)
    assert graph(new) is graph.outputs
    assert torch.equal(x, new) and fake_cuda == ["replay"]
    mismatches = [
        ((torch.ones(2, 4),), r"shape \(2, 4\).*shape \(4, 2\)"), ((x, 1), "structured like")
    ]
    for bad, match in mismatches:
        with pytest.raises(ValueError, match=match):
            graph(*bad)
    assert fake_cuda == ["replay"]  # no replay after a mismatch


def test_a_non_tensor_static_input_must_be_equal_at_replay(fake_cuda: list[str]) -> None:
    graph = dbo.capture_graph(lambda t, scale: t * scale, torch.zeros(4, 2), 3)
    graph(torch.ones(4, 2), 3)
    with pytest.raises(ValueError, match="input leaf 1 is 4, but the graph was captured with 3"):
        graph(torch.ones(4, 2), 4)


def test_capturing_is_false_outside_capture_graph() -> None:
    assert dbo.capturing() is False  # outside any overlap
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(dbo.capturing())  # in a plain overlap
        return x

    dbo.overlap(fn)(torch.zeros(4, 2))
    assert seen == [False, False]


def test_capturing_is_true_on_a_capturing_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert dbo.capturing() is True


@pytest.mark.parametrize("phase", ["warmup", "capture"])
def test_the_dynamic_moe_path_refuses_in_every_ubatch_of_a_capture_graph_run(
    fake_cuda: list[str], phase: str
) -> None:
    """Ubatch 1 refuses at its first call (warmup) or at its third (the capture, after
    two warmups): the error names the call and the fix, and a refusal in the warmup
    comes before the capture begins."""
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            calls[0] += 1
            if calls[0] == (1 if phase == "warmup" else 3):
                comm.moe.dispatch(x, torch.zeros(4, 1, dtype=torch.long), 1)
        return x

    with pytest.raises(RuntimeError, match="comm.moe.dispatch cannot be captured.*dispatch_fixed"):
        dbo.capture_graph(fn, torch.zeros(4, 2))
    expected = ["stream", "stream done"] if phase == "warmup" else [
        "stream", "begin", "abandon", "stream done"
    ]
    assert fake_cuda == expected


@pytest.mark.parametrize("fail_at_call", [1, 3])
def test_after_a_failure_nothing_runs_and_the_runner_is_usable(
    fake_cuda: list[str], fail_at_call: int
) -> None:
    """A failure in the warmup (call 1) or in the capture (call 3): the first failure
    with its ubatch id, the capture abandoned, no ubatch thread left registered, no new
    thread, and dbo.overlap and another capture work afterwards."""
    x = torch.arange(8.0).reshape(4, 2)
    dbo.capture_graph(logging_fn([]), x)  # the pooled runner's threads exist from here on
    threads = threading.active_count()
    fake_cuda.clear()
    with pytest.raises(ValueError, match="boom") as raised:
        dbo.capture_graph(logging_fn([], fail_at_call=fail_at_call), x)
    assert getattr(raised.value, "ubatch_id", None) == 1
    assert ("abandon" in fake_cuda) == (fail_at_call == 3) and "end" not in fake_cuda
    assert fake_cuda[-1] == "stream done"
    assert num_registered_threads() == 0 and threading.active_count() == threads
    assert torch.equal(dbo.overlap(lambda t: t * 2)(x), x * 2)
    assert torch.equal(dbo.capture_graph(logging_fn([]), x).outputs, x * 2)
    assert threading.active_count() == threads


@pytest.mark.usefixtures("fresh_workspace_global")
@pytest.mark.parametrize("fail", [False, True])
def test_the_workspace_is_locked_before_the_capture_and_unlocked_after_a_failure(
    fake_cuda: list[str], fail: bool
) -> None:
    manager = workspace.init_workspace_manager("cpu", num_ubatches=2)
    locked_at: list[bool] = []
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        (scratch,) = manager.get_simultaneous(((x.shape[0], 16), torch.float32))
        if calls[0] > 4:  # the captured run (two ubatches, two warmups before it)
            locked_at.append(manager.is_locked())
            if fail:
                raise ValueError("boom")
        scratch.copy_(x.sum(dim=1, keepdim=True).expand(-1, 16))
        dbo.yield_()
        return scratch[:, :1].clone()

    x = torch.arange(8.0).reshape(4, 2)
    if fail:
        with pytest.raises(ValueError, match="boom"):
            dbo.capture_graph(fn, x)
    else:
        graph = dbo.capture_graph(fn, x)
        assert torch.equal(graph.outputs, x.sum(dim=1, keepdim=True))
    assert locked_at[0] is True and manager.is_locked() is not fail
    stats = manager.stats()
    assert stats.realized_bytes_per_slot == (stats.capacity_bytes,) * 2


@pytest.mark.usefixtures("fresh_workspace_global")
def test_a_workspace_the_caller_locked_stays_locked_after_a_failure(
    fake_cuda: list[str],
) -> None:
    manager = workspace.init_workspace_manager("cpu", num_ubatches=2)
    manager.lock()
    with pytest.raises(ValueError, match="boom"):
        dbo.capture_graph(logging_fn([], fail_at_call=3), torch.zeros(4, 2))
    assert manager.is_locked()


@pytest.mark.usefixtures("fresh_workspace_global")
def test_a_larger_batch_after_a_capture_fails_in_the_warmup_saying_to_capture_it_first(
    fake_cuda: list[str],
) -> None:
    """The workspace stays locked after a capture (the graph writes into its buffers): a
    larger batch cannot grow it, and the error says not to unlock it."""
    manager = workspace.init_workspace_manager("cpu", num_ubatches=2)

    def fn(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = manager.get_simultaneous(((x.shape[0], 64), torch.float32))
        scratch.fill_(1.0)
        return scratch[:, :1] * x[:, :1]

    dbo.capture_graph(fn, torch.zeros(4, 2))
    with pytest.raises(workspace.WorkspaceLockedError) as raised:
        dbo.capture_graph(fn, torch.zeros(8, 2))
    message = str(raised.value)
    assert "dbo.capture_graph locked it" in message and "would free under" in message
    assert "capture the largest batch first" in message
    assert manager.is_locked() and fake_cuda.count("begin") == 1


class FakeGraph:
    """A torch.cuda.CUDAGraph whose capture_end fails (an invalidated capture)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "") -> None:
        self.calls.append("begin")

    def capture_end(self) -> None:
        self.calls.append("end")
        raise RuntimeError("operation not permitted when stream is capturing")

    def reset(self) -> None:
        self.calls.append("reset")


def test_a_failed_capture_keeps_its_graph_alive_and_its_pool_is_refused_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed capture_end leaves the host allocator routed through the graph object on
    recent torch: the object is kept for good, and a pool it used is not reused."""
    released: list[Any] = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    private.release_pool  # noqa: B018 - loaded first, so the fakes below are not overwritten
    monkeypatch.setattr(private, "end_allocate_to_pool", lambda index, pool: None)
    monkeypatch.setattr(private, "release_pool", lambda index, pool: released.append(pool))
    monkeypatch.setattr(dbo.graphs._Capture, "failed_graphs", [])
    monkeypatch.setattr(dbo.graphs._Capture, "failed_pools", set())
    pool = (7, 7)
    capture = dbo.graphs._Capture(torch.device("cuda", 0), pool)
    with pytest.raises(RuntimeError, match="not permitted"), capture.capturing():
        pass
    assert capture.graph.calls == ["begin", "end"]  # not reset: kept, with its state
    assert dbo.graphs._Capture.failed_graphs == [capture.graph] and released == [pool]
    with pytest.raises(RuntimeError, match=r"pool=\(7, 7\) was used by a capture that failed"):
        dbo.capture_graph(lambda x: x, torch.zeros(4, 2), pool=pool)


def test_capture_hooks_run_after_the_warmup_and_are_undone_in_reverse_on_failure(
    fake_cuda: list[str],
) -> None:
    log = fake_cuda

    def hook(name: str) -> Any:
        def run() -> Any:
            log.append(f"hook {name}")
            return lambda: log.append(f"undo {name}")

        return run

    removers = [dbo.add_capture_hook(hook("a")), dbo.add_capture_hook(hook("b"))]
    try:
        with pytest.raises(ValueError, match="boom"):
            dbo.capture_graph(logging_fn([], fail_at_call=3), torch.zeros(4, 2))  # captured run
        hooks = [entry for entry in log if entry.startswith(("hook", "undo", "begin"))]
        assert hooks == ["hook a", "hook b", "begin", "undo b", "undo a"]
        log.clear()
        removers[0]()
        removers[0]()  # removing twice is harmless
        dbo.capture_graph(logging_fn([]), torch.zeros(4, 2))
        assert [entry for entry in log if entry.startswith("hook")] == ["hook b"]
    finally:
        for remove in removers:
            remove()
    with pytest.raises(TypeError, match="needs a callable"):
        dbo.add_capture_hook("lock")  # type: ignore[arg-type]
