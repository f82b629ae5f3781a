"""Stream ordering on the CPU backend, with fake backends that record what the runtime asks:
side streams, recv hooks on their owner's comm stream, streams distinct across live
runners, the inputs' device, subgroups without duplicates, and collectives an aborted
ubatch left in flight."""

from __future__ import annotations

import gc
import itertools
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _recording_backend import Recording
from torch._subclasses.fake_tensor import FakeTensorMode

import comm
import dbo
from comm import collectives
from dbo.device import cuda as device_module
from dbo.device.backends import CpuBackend, CpuEvent, CpuStream
from dbo.runtime import runner as runner_module
from dbo.runtime import stream_device
from dbo.runtime.context import current_context
from dbo.runtime.runner import RunnerState


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, ...]]]:
    """What the backend of each runner made from now on (`dbo.overlap`'s pooled runners
    too: they are closed before and after) was asked."""
    entries: list[tuple[str, ...]] = []
    monkeypatch.setattr(runner_module, "backend_for", lambda device: Recording(entries))
    dbo.close_default_runners()
    yield entries
    dbo.close_default_runners()


def _backend() -> Any:
    context = current_context()
    assert context is not None and context.run is not None, "called inside a ubatch"
    return context.run.backend


# ------------------------------------------------------------------------- side streams


@pytest.mark.parametrize("yielding", [False, True])
def test_a_switch_from_a_side_stream_is_ordered_after_it_and_returns_to_it(
    log: list[tuple[str, ...]], yielding: bool
) -> None:
    """Inside `with torch.cuda.stream(side):` the work so far ran on `side`: the comm
    stream waits for `side`, and the switch back returns to `side`, so the rest of the
    block stays on it."""
    seen: dict[int, list[str]] = {0: [], 1: []}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me, backend = dbo.current_ubatch_id(), _backend()
        backend.set_current_stream(CpuStream(f"side{me}"))  # as torch.cuda.stream(side)
        (dbo.yield_and_switch_to_comm if yielding else dbo.switch_to_comm)()
        seen[me].append(backend.current_stream().name)
        (dbo.yield_and_switch_to_compute if yielding else dbo.switch_to_compute)()
        seen[me].append(backend.current_stream().name)
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert seen == {0: ["comm0", "side0"], 1: ["comm1", "side1"]}
    for me in (0, 1):
        assert ("wait", f"comm{me}", f"side{me}") in log
        assert ("wait", f"side{me}", f"comm{me}") in log
        assert ("wait", f"comm{me}", f"compute{me}") not in log


# --------------------------------------------------------------------------- recv hooks


def test_a_recv_hook_runs_on_its_owners_comm_stream_and_orders_no_other_ubatch(
    log: list[tuple[str, ...]],
) -> None:
    """Ubatch 0's receive runs in ubatch 1's thread on ubatch 0's comm stream: no stream
    of one ubatch ever waits for the other's (that would serialize the two)."""
    seen: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        backend = _backend()
        if dbo.current_ubatch_id() == 0:
            dbo.register_recv_hook(lambda: seen.append(backend.current_stream().name))
        dbo.yield_()
        dbo.maybe_run_recv_hook()
        seen.append(f"after:{backend.current_stream().name}")
        dbo.yield_()
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert seen == ["after:compute0", "comm0", "after:compute1"]
    waits = [entry[1:] for entry in log if entry[0] == "wait"]
    assert ("comm0", "compute0") in waits and ("compute0", "comm0") in waits
    crossing = [(a, b) for a, b in waits if "default" not in (a, b) and a[-1] != b[-1]]
    assert crossing == []


def test_a_recv_hook_whose_owner_has_ended_runs_on_the_running_ubatchs_stream_after_it(
    log: list[tuple[str, ...]],
) -> None:
    """Ubatch 0 has returned (the caller's stream joins its streams already): its hook,
    run by ubatch 1, goes to ubatch 1's stream, which the caller joins later, after
    that stream waits for the event recorded when ubatch 0 registered the hook."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        backend = _backend()
        if dbo.current_ubatch_id() == 0:
            dbo.register_recv_hook(lambda: log.append(("hook", backend.current_stream().name)))
            return x
        dbo.maybe_run_recv_hook()
        return x

    dbo.overlap(fn)(torch.zeros(2))
    sent, joined = log.index(("record", "compute0")), log.index(("record", "comm0"))
    hook = log.index(("hook", "compute1"))
    assert sent < joined < hook and log[hook - 1] == ("wait", "compute1", "compute0")
    assert not [entry for entry in log[joined + 1 :] if entry[1].endswith("0")]


def test_a_recv_hook_registered_on_a_side_stream_runs_after_it(
    log: list[tuple[str, ...]],
) -> None:
    """Inside `with torch.cuda.stream(side):` the send was enqueued on `side`: the hook,
    on its owner's comm stream, waits for `side`, not for the compute stream."""
    seen: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        backend = _backend()
        if dbo.current_ubatch_id() == 0:
            backend.set_current_stream(CpuStream("side0"))  # as torch.cuda.stream(side)
            dbo.register_recv_hook(lambda: seen.append(backend.current_stream().name))
            dbo.yield_()
        else:
            dbo.maybe_run_recv_hook()  # while ubatch 0 is parked on side0
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert seen == ["comm0"]
    hook_waits = log[log.index(("record", "side0")) + 1 :]
    assert ("wait", "comm0", "side0") in hook_waits
    assert ("wait", "comm0", "compute0") not in hook_waits


# ------------------------------------------------------------------------- KV caches


def test_the_caller_kv_cache_is_brought_up_to_date_after_every_ubatchs_streams(
    log: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last ubatch to return advances the caller's StaticCache (a device op) in its
    exit callback: its stream first waits for every ubatch's streams, so that no write a
    ubatch left queued races with it."""
    transformers = pytest.importorskip("transformers")
    from dbo.hf import cache

    bring_up_to_date = cache.Call.bring_up_to_date

    def logged(call: Any) -> None:
        log.append(("finish", _backend().current_stream().name))
        bring_up_to_date(call)

    monkeypatch.setattr(cache.Call, "bring_up_to_date", logged)
    config = transformers.Qwen2Config(num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, hidden_size=16)
    cache = transformers.StaticCache(config=config, max_cache_len=8)

    def write(keys: torch.Tensor, cache: Any) -> torch.Tensor:
        cache.update(keys, keys, 0)
        return keys

    dbo.overlap(write)(torch.ones(4, 2, 3, 8), cache)
    assert int(cache.get_seq_length()) == 3
    (finish,) = [entry for entry in log if entry[0] == "finish"]
    last = finish[1]
    waited_for = {entry[2] for entry in log[: log.index(finish)]
                  if entry[0] == "wait" and entry[1] == last}
    assert {"compute0", "comm0", "compute1", "comm1"} - {last} <= waited_for, log


@pytest.mark.parametrize("kind", ["static", "mamba"])
def test_a_cache_layer_one_ubatch_initializes_is_used_by_the_others_after_its_zero_fill(
    log: list[tuple[str, ...]], kind: str,
) -> None:
    """A StaticCache layer (or Mamba's states) not yet initialized is made, zero-filled,
    for every row by the first ubatch to write, on its stream: the other ubatch's stream
    waits for that before its own rows are written."""
    transformers = pytest.importorskip("transformers")
    if kind == "static":
        config = transformers.Qwen2Config(num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, hidden_size=16)
        cache = transformers.StaticCache(config=config, max_cache_len=8)
    else:
        cache = transformers.DynamicCache(config=transformers.MambaConfig(num_hidden_layers=1))

    def write(states: torch.Tensor, cache: Any) -> torch.Tensor:
        log.append(("write", _backend().current_stream().name))
        if kind == "static":
            cache.update(states, states, 0)
        else:
            cache.update_conv_state(states, 0, conv_kernel_size=4)
        log.append(("written",))
        return states

    dbo.overlap(write)(torch.ones(4, 2, 3, 8) if kind == "static" else torch.ones(4, 6, 3), cache)
    first, second = [entry[1] for entry in log if entry[0] == "write"]
    start = log.index(("write", second))
    during = log[start : log.index(("written",), start)]
    waits = [entry[2] for entry in during if entry[0] == "wait" and entry[1] == second]
    assert first in waits, log


def test_a_shared_cache_buffer_grows_after_every_ubatchs_streams(
    log: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DynamicCache's buffer holds every ubatch's rows: growing it copies them, so the
    growing ubatch's stream first waits for every ubatch's streams."""
    transformers = pytest.importorskip("transformers")
    from dbo.hf import dynamic

    allocate = dynamic._SharedLayer._allocate

    def logged(shared: Any, *args: Any) -> None:
        inside = current_context() is not None  # not the first update, before the overlap
        log.append(("grow", _backend().current_stream().name if inside else "caller"))
        allocate(shared, *args)
        log.append(("grown",))

    monkeypatch.setattr(dynamic._SharedLayer, "_allocate", logged)
    cache = transformers.DynamicCache()
    cache.update(torch.ones(4, 2, 3, 8), torch.ones(4, 2, 3, 8), 0)  # 3 tokens, room for 67

    def write(keys: torch.Tensor, cache: Any) -> torch.Tensor:
        cache.update(keys, keys, 0)
        return keys

    dbo.overlap(write)(torch.ones(4, 2, 80, 8), cache)
    assert cache.get_seq_length() == 83
    grow = next(entry for entry in log if entry[0] == "grow" and entry[1] == "compute0")
    start = log.index(grow)
    inside = log[start : log.index(("grown",), start)]
    waited_for = {entry[2] for entry in inside if entry[0] == "wait" and entry[1] == "compute0"}
    assert {"comm0", "compute1", "comm1"} <= waited_for, log


# ------------------------------------------------------------ streams across runners


def _round_robin_pool(size: int) -> type[CpuBackend]:
    """A backend class whose streams come round-robin from one pool of `size` queues
    shared by all its instances, as torch's per-device pool is."""
    queues = [CpuStream(f"q{i}") for i in range(size)]
    drawn = itertools.count()

    class RoundRobinPool(CpuBackend):
        def new_stream(self, name: str) -> CpuStream:
            return queues[next(drawn) % size]

        def stream_key(self, stream: CpuStream) -> str:  # type: ignore[override]
            return stream.name

    return RoundRobinPool


def _streams_of(runner: dbo.UBatchRunner) -> set[str]:
    seen: set[str] = set()

    def fn() -> None:
        seen.add(dbo.current_stream().name)
        dbo.switch_to_comm()
        seen.add(dbo.current_stream().name)
        dbo.switch_to_compute()

    runner.run(fn, [((), {})] * runner.num_ubatches)
    return seen


def test_live_runners_never_share_a_stream_from_an_aliasing_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner_module, "backend_for", lambda device: _round_robin_pool(8)())
    first, second, third = (dbo.UBatchRunner(2) for _ in range(3))
    try:
        streams = [_streams_of(first), _streams_of(second)]
        assert len(streams[0] | streams[1]) == 8
        with pytest.raises(RuntimeError, match="8 held by live runners.*fewer live runners"):
            _streams_of(third)
        assert third.state is RunnerState.IDLE
        first.close()  # its queues go back
        assert _streams_of(third) == streams[0]
    finally:
        for runner in (first, second, third):
            runner.close()


@pytest.mark.timeout(30)
def test_a_runner_broken_by_the_watchdog_keeps_its_streams_until_its_ubatch_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner_module, "backend_for", lambda device: _round_robin_pool(8)())
    release = threading.Event()

    def stuck(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            release.wait(timeout=20)
        return x

    broken = dbo.UBatchRunner(2)
    replacement, later = dbo.UBatchRunner(2), dbo.UBatchRunner(2)
    try:
        threads = broken.threads
        with pytest.raises(dbo.OverlapTimeoutError):
            broken.run(stuck, [((torch.zeros(1),), {})] * 2, timeout_s=0.3)
        broken.close(timeout_s=0)
        del broken  # the stuck run still holds its streams
        gc.collect()
        assert len(_streams_of(replacement)) == 4
        with pytest.raises(RuntimeError, match="distinct streams"):
            _streams_of(later)
        release.set()
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        gc.collect()
        assert len(_streams_of(later)) == 4
    finally:
        release.set()
        replacement.close()
        later.close()


class _FakeDriver:
    """libcuda's calls that `_create_cuda_stream` makes, logged, with the primary
    context's reference count (0: the driver destroys it and its streams)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.references = 0
        self.priorities: list[int] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            if name == "cuDevicePrimaryCtxRetain":
                self.references += 1
            elif name.startswith("cuDevicePrimaryCtxRelease"):
                self.references -= 1
            elif name == "cuCtxGetStreamPriorityRange":
                args[0]._obj.value, args[1]._obj.value = 0, -5  # least, greatest
            elif name in ("cuStreamCreate", "cuStreamCreateWithPriority"):
                args[0]._obj.value = 0x5EED  # the handle, through byref
                if name == "cuStreamCreateWithPriority":
                    self.priorities.append(args[2].value)
            return 0

        return call


def test_a_driver_made_stream_keeps_its_primary_context_retained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device the runtime has not used yet, the retain creates the primary context:
    a release would destroy it, and the new stream with it."""
    driver = _FakeDriver()
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(device_module.ctypes, "CDLL", lambda name: driver)
    assert device_module._create_cuda_stream(0) == 0x5EED
    assert driver.priorities == [0] and driver.references == 1  # the default priority


def test_comm_streams_get_the_greatest_priority_and_stay_apart_in_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A comm stream's transfer kernels start ahead of the other ubatch's queued compute
    blocks; the pool never hands a comm stream out as a compute one, or the reverse."""
    driver = _FakeDriver()
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(device_module.ctypes, "CDLL", lambda name: driver)
    assert device_module._create_cuda_stream(0, high_priority=True) == 0x5EED
    assert driver.priorities == [-5]

    handles = iter(range(1, 100))
    made: list[tuple[int, bool]] = []

    def create(index: int, high_priority: bool = False) -> int:
        made.append((next(handles), high_priority))
        return made[-1][0]

    class FakeStream:
        def __init__(self, handle: int, device: torch.device) -> None:
            self.cuda_stream, self.device = handle, device

    monkeypatch.setattr(device_module, "_create_cuda_stream", create)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeStream)
    pool = device_module._OwnStreams()
    device = torch.device("cuda", 0)
    comm, compute = pool.take(device, high_priority=True), pool.take(device)
    assert made == [(1, True), (2, False)]
    pool.give_back(comm)
    assert pool.take(device).cuda_stream == 3  # not the comm stream given back
    assert pool.take(device, high_priority=True) is comm
    pool.give_back(compute)
    assert pool.take(device) is compute


# ------------------------------------------------------------------- the inputs' device


def _fake_cuda_tensor(index: int) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(2, device=f"cuda:{index}")


def test_a_cuda_input_on_another_device_than_the_streams_is_refused() -> None:
    x = _fake_cuda_tensor(1)
    with dbo.UBatchRunner(2, device="cuda:0") as runner:
        with pytest.raises(ValueError, match=(
            r"a ubatch input is on cuda:1 but the ubatch streams are on cuda:0; pass "
            r"device='cuda:1', or call torch.cuda.set_device\(1\) in this thread"
        )):
            runner.run(lambda t: t, [((x,), {}), ((x,), {})])
        assert runner.state is RunnerState.IDLE


def test_a_bare_cuda_device_names_the_calling_threads_device_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a thread never set
    x = _fake_cuda_tensor(3)
    with (
        dbo.UBatchRunner(2, device="cuda") as runner,
        pytest.raises(ValueError, match=r"on cuda:0 \('cuda' names the calling thread"),
    ):
        runner.run(lambda t: t, [((x,), {}), ((x,), {})])


def test_the_device_check_walks_no_tree_for_flat_tensor_and_scalar_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same leaves, in the same order, as `tree_leaves`; a walk only for nested inputs."""
    x, y = torch.zeros(1), torch.ones(1)
    flat = [((x, 3, None), {"scale": y}), ((y, 4, None), {"scale": x})]
    nested = [(([x], 3), {}), (([y], 4), {})]
    tree_leaves, walks = stream_device.tree_leaves, []
    monkeypatch.setattr(stream_device, "tree_leaves", lambda t: walks.append(t) or tree_leaves(t))
    for inputs, walked in ((flat, []), (nested, [nested])):
        walks.clear()
        leaves = stream_device._input_leaves(inputs)
        assert walks == walked
        assert list(map(id, leaves)) == list(map(id, tree_leaves(inputs)))


# ------------------------------------------------------------ groups without duplicates


class _Group:
    """Enough of a process group for `comm.collectives._run`."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        self.group_name, self._size, self._backend = f"fake{size}", size, backend

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return self._backend


class _Work:
    """A collective's handle that records how often it was waited."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, *args: Any) -> bool:
        self.waits += 1
        return True

    def is_completed(self) -> bool:
        return True


def _launch_into(works: list[_Work]) -> Any:
    def launch(tensor: torch.Tensor, group: Any, async_op: bool) -> _Work:
        works.append(_Work())
        return works[-1]

    return launch


def test_a_group_without_duplicates_warns_once_naming_the_fix() -> None:
    group, works = _Group(2), []
    x = torch.zeros(2)

    def fn(t: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            collectives._run("all_reduce", _launch_into(works), (t,), (t,), group, False)
        return t

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbo.overlap(fn)(x)
        dbo.overlap(fn)(x)
    shared = [w for w in caught if "per-ubatch duplicates" in str(w.message)]
    assert len(shared) == 1 and len(works) == 8
    assert "comm.ubatch_groups(group, 2)" in str(shared[0].message)
    assert shared[0].category is RuntimeWarning


def test_a_group_of_one_rank_does_not_warn(world_of_one: None) -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t)
        return t

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbo.overlap(fn)(torch.ones(4))
    assert not [w for w in caught if "per-ubatch duplicates" in str(w.message)]


# ------------------------------------------------------------- collectives left in flight


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_cuda_collective_an_aborted_ubatch_never_waited_is_joined_on_nccl_only(
    monkeypatch: pytest.MonkeyPatch, async_op: bool, backend: str
) -> None:
    """Ubatch 0 launches a collective on CUDA tensors, ubatch 1 fails meanwhile. NCCL:
    ubatch 0's stream waits for it (`Work.wait`, no host wait) before the caller's
    stream joins ubatch 0's. gloo, whose wait would block the host: left to settle."""
    works: list[_Work] = []
    abandoned: list[Any] = []
    monkeypatch.setattr(collectives, "abandon", abandoned.append)
    x = _fake_cuda_tensor(0)

    def fn(t: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        group = _Group(1, backend)
        collectives._run("all_reduce", _launch_into(works), (x,), (x,), group, async_op)
        dbo.yield_()
        return t

    with pytest.raises(ValueError, match="ubatch 1 fails"):
        dbo.overlap(fn)(torch.zeros(2))
    nccl = backend == "nccl"
    assert [work.waits for work in works] == [1 if nccl else 0]
    assert abandoned == ([] if nccl else works)


def test_a_host_collective_an_aborted_ubatch_never_waited_is_left_to_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    works: list[_Work] = []
    abandoned: list[Any] = []
    monkeypatch.setattr(collectives, "abandon", abandoned.append)

    def fn(t: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        collectives._run("all_reduce", _launch_into(works), (t,), (t,), _Group(1), True)
        dbo.yield_()
        return t

    with pytest.raises(ValueError, match="ubatch 1 fails"):
        dbo.overlap(fn)(torch.zeros(2))
    assert abandoned == works and works[0].waits == 0


def test_on_failure_runs_instead_of_the_exit_callback_on_the_comm_stream_before_the_join(
    log: list[tuple[str, ...]],
) -> None:
    failing = {1}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me, backend = dbo.current_ubatch_id(), _backend()
        dbo.at_ubatch_exit(
            lambda: log.append(("normal", str(me))),
            on_failure=lambda: log.append(("failed", str(me), backend.current_stream().name)),
        )
        if me in failing:
            raise ValueError("ubatch 1 fails")
        dbo.yield_()
        return x

    with pytest.raises(ValueError):
        dbo.overlap(fn)(torch.zeros(2))
    for me in ("0", "1"):
        failed = log.index(("failed", me, f"comm{me}"))
        assert log[failed + 1 : failed + 3] == [("record", f"compute{me}"), ("record", f"comm{me}")]
    assert not [entry for entry in log if entry[0] == "normal"]
    log.clear()
    failing.clear()
    dbo.overlap(fn)(torch.zeros(2))
    assert [entry for entry in log if entry[0] in ("normal", "failed")] == [
        ("normal", "0"), ("normal", "1"),
    ]  # fmt: skip
    with pytest.raises(TypeError, match="on_failure must be callable or None"):
        dbo.at_ubatch_exit(print, on_failure=3)  # type: ignore[arg-type]


class _Invalidated(CpuBackend):
    """A backend whose events raise on every use once `broken` is set, as those of a
    failed CUDA-graph capture do; logs the stream each thread makes current."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.current: dict[str, str] = {}

    def record_event(self, stream: CpuStream) -> CpuEvent:
        if self.broken:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().record_event(stream)

    def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
        if self.broken:
            raise RuntimeError("operation not permitted when stream is capturing")
        super().wait_event(stream, event)

    def set_current_stream(self, stream: CpuStream) -> None:
        self.current[threading.current_thread().name] = stream.name
        super().set_current_stream(stream)


def test_a_failed_capture_reports_the_ubatchs_own_error_and_restores_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ubatch 1 ends normally; ubatch 0 then fails and its events, like its join and the
    caller's, raise: the caller gets ubatch 0's error, each worker is back on the stream
    it had, and the runner runs again."""
    backend = _Invalidated()
    monkeypatch.setattr(runner_module, "backend_for", lambda device: backend)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            dbo.yield_()
            backend.broken = True
            raise ValueError("the capture's own error")
        return x

    with dbo.UBatchRunner(2) as runner:
        with pytest.raises(ValueError, match="the capture's own error") as raised:
            runner.run(fn, [((torch.zeros(1),), {})] * 2, timeout_s=30)
        assert getattr(raised.value, "ubatch_id", None) == 0
        assert {backend.current[thread.name] for thread in runner.threads} == {"default"}
        backend.broken = False
        outputs = runner.run(lambda x: x + 1, [((torch.zeros(1),), {})] * 2)
        assert all(torch.equal(output, torch.ones(1)) for output in outputs)
