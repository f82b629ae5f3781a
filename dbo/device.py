"""Device backends: the few stream and event operations the runtime needs.

Each ubatch has a compute stream and a comm stream. On CUDA they are real
`torch.cuda.Stream`s and the switch calls order them with `torch.cuda.Event`s. On CPU
every op is synchronous, so streams are named placeholders and an event is a host-side
flag that is complete once recorded; the runtime runs the same protocol on both, which
is what lets the CPU tests check it (a wait on an event that was never recorded is a
protocol bug, and the CPU backend raises on it).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Collection
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves


class DeviceBackend(Protocol):
    """What the runtime asks of a device."""

    device: torch.device

    def new_stream(self, name: str) -> Any:
        """A stream on this device for a runner to hold until `release_stream`."""

    def release_stream(self, stream: Any) -> None:
        """`stream` (from `new_stream`) is no longer used: it may be handed out again."""

    def stream_key(self, stream: Any) -> Any:
        """What identifies the device queue behind `stream` (equal keys: one queue)."""

    def current_stream(self) -> Any:
        """The calling thread's current stream."""

    def set_current_stream(self, stream: Any) -> None:
        """Make `stream` the calling thread's current stream (kernels go there)."""

    def record_event(self, stream: Any) -> Any:
        """A new event recorded on `stream`: it completes when `stream`'s work so far does."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on `stream` wait for `event` (does not block the host)."""

    def enter_thread(self) -> None:
        """Prepare a worker thread to launch work on this device."""

    def hand_over(self, outputs: Any, stream: Any) -> None:
        """The tensors in `outputs` (any nesting), made on the ubatch streams, are used
        and freed on `stream` from now on: keep the allocator from reusing their memory
        for the ubatch streams' later work before `stream` is done with them."""


class CpuStream:
    """A named placeholder: CPU ops run synchronously in the thread that issues them."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"CpuStream({self.name!r})"


class CpuEvent:
    """A CPU event: complete once recorded (CPU work is synchronous); names its stream."""

    __slots__ = ("stream",)

    def __init__(self, stream: CpuStream) -> None:
        self.stream = stream


class _CpuCurrentStream(threading.local):
    stream: CpuStream | None = None


class CpuBackend:
    """Streams and events for CPU tensors: synchronous, tracked for protocol checks."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = torch.device("cpu") if device is None else device
        self._default = CpuStream("default")
        self._current = _CpuCurrentStream()

    def new_stream(self, name: str) -> CpuStream:
        return CpuStream(name)

    def release_stream(self, stream: CpuStream) -> None:
        """Nothing to do: a placeholder costs nothing."""

    def stream_key(self, stream: CpuStream) -> int:
        return id(stream)

    def current_stream(self) -> CpuStream:
        return self._current.stream or self._default

    def set_current_stream(self, stream: CpuStream) -> None:
        self._current.stream = stream

    def record_event(self, stream: CpuStream) -> CpuEvent:
        return CpuEvent(stream)

    def wait_event(self, stream: CpuStream, event: CpuEvent) -> None:
        if not isinstance(event, CpuEvent):
            raise TypeError(f"{stream!r} cannot wait on {event!r}: not an event of this backend")

    def enter_thread(self) -> None:
        """Nothing to do on CPU."""

    def hand_over(self, outputs: Any, stream: CpuStream) -> None:
        """Nothing to do: CPU memory is free once the host is done with it."""


class CudaBackend:
    """`torch.cuda` streams and events on one device; its streams are dbo's own
    (`_OwnStreams`), never one of torch's pool."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        # A comm stream gets the device's greatest priority: its kernels (a transfer, a
        # copy) then start ahead of the other ubatch's queued compute blocks.
        high = name.startswith("comm")
        if torch.version.hip:  # no driver API here: torch's pool (the runner checks aliasing)
            return torch.cuda.Stream(device=self.device, priority=-1 if high else 0)
        return _own_streams.take(self.device, high_priority=high)

    def release_stream(self, stream: torch.cuda.Stream) -> None:
        _own_streams.give_back(stream)

    def stream_key(self, stream: torch.cuda.Stream) -> int:
        return int(stream.cuda_stream)  # two Stream objects can be one CUDA stream

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def set_current_stream(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)

    def record_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def enter_thread(self) -> None:
        # The current device is thread-local: a new thread starts on device 0.
        torch.cuda.set_device(self.device)

    def hand_over(self, outputs: Any, stream: torch.cuda.Stream) -> None:
        # A block freed after the caller's merge goes back to the pool of the ubatch
        # stream that allocated it, for reuse at once. The next run orders its streams
        # after its own caller's stream only: a caller on another stream (another
        # thread) would get it while this caller's merge may still read it.
        if type(outputs) in (list, tuple) and all(type(x) is torch.Tensor for x in outputs):
            leaves: Any = outputs  # the usual `fn` returning one tensor: no tree walk
        else:
            leaves = tree_leaves(outputs)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                leaf.record_stream(stream)


class _OwnStreams:
    """The CUDA streams dbo makes, and those no runner holds now, per device.

    `torch.cuda.Stream()` hands out a per-device pool of 32 round-robin, the pool that
    ProcessGroupNCCL's internal streams and graph capture's come from too. These come
    from the driver (`cuStreamCreate`, non-blocking, in torch's primary context) as
    `ExternalStream`s: nothing else gets one. High-priority ones (the device's greatest
    priority, for comm) and default-priority ones are kept apart. Never destroyed (the
    caching allocator records events on streams its live blocks were used on), only reused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.device, bool], list[torch.cuda.Stream]] = {}
        self._made: dict[int, bool] = {}
        """Each stream dbo made (its handle): whether it has the greatest priority."""

    def take(self, device: torch.device, high_priority: bool = False) -> torch.cuda.Stream:
        with self._lock:
            free = self._free.get((device, high_priority))
            if free:
                return free.pop()
        handle = _create_cuda_stream(device.index, high_priority)
        stream = torch.cuda.ExternalStream(handle, device=device)
        with self._lock:
            self._made[int(stream.cuda_stream)] = high_priority
        return stream

    def give_back(self, stream: torch.cuda.Stream) -> None:
        with self._lock:
            high_priority = self._made.get(int(stream.cuda_stream))
            if high_priority is not None:  # not a pool stream (HIP)
                self._free.setdefault((stream.device, high_priority), []).append(stream)


_own_streams = _OwnStreams()
_CU_STREAM_NON_BLOCKING = 0x1


def _create_cuda_stream(index: int, high_priority: bool = False) -> int:
    """A new non-blocking stream (its handle) in device `index`'s primary context, at the
    device's greatest priority if `high_priority`."""
    torch.cuda.init()
    driver = ctypes.CDLL("libcuda.so.1")  # loaded already: the CUDA runtime uses it

    def check(result: int, call: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            driver.cuGetErrorName(result, ctypes.byref(name))
            reason = name.value.decode() if name.value else f"error {result}"
            raise RuntimeError(f"{call} failed on cuda:{index}: {reason}")

    device, context, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    check(driver.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    # Retained for good, never released: on a device the runtime has not used yet this
    # retain creates the primary context, and a release would destroy it with the stream.
    check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuCtxRetain")
    check(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        if high_priority:
            least, greatest = ctypes.c_int(), ctypes.c_int()
            check(driver.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                  "cuCtxGetStreamPriorityRange")
            check(driver.cuStreamCreateWithPriority(
                ctypes.byref(stream), _CU_STREAM_NON_BLOCKING, greatest
            ), "cuStreamCreateWithPriority")
        else:
            check(driver.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING),
                  "cuStreamCreate")
    finally:
        driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    assert stream.value, "cuStreamCreate succeeded, so it wrote a handle"
    return stream.value


_MAX_STREAM_DRAWS = 128
"""New streams drawn, at most, looking for distinct ones (from a backend whose pool aliases)."""


def distinct_streams(backend: DeviceBackend, count: int, taken: Collection[Any] = ()) -> list[Any]:
    """`count` new streams that are distinct queues, none of them the caller's current
    stream nor one whose key is in `taken`; RuntimeError when the device cannot give that
    many (a shared queue would serialize two ubatches)."""
    refused = {*taken, backend.stream_key(backend.current_stream())}
    streams: list[Any] = []
    drawn: list[Any] = []
    while len(streams) < count and len(drawn) < _MAX_STREAM_DRAWS:
        role = "compute" if len(streams) % 2 == 0 else "comm"
        drawn.append(backend.new_stream(f"{role}{len(streams) // 2}"))
        key = backend.stream_key(drawn[-1])
        if key not in refused:
            refused.add(key)
            streams.append(drawn[-1])
    kept = {id(stream) for stream in streams} if len(streams) == count else set()
    for stream in drawn:
        if id(stream) not in kept:
            backend.release_stream(stream)
    if len(streams) < count:
        raise RuntimeError(
            f"could not get {count} distinct streams on {backend.device} (got "
            f"{len(streams)} in {len(drawn)} draws, {len(taken)} held by live runners): "
            "use fewer ubatches, or fewer live runners (close the UBatchRunners you no "
            "longer use)"
        )
    return streams


class StreamLease:
    """A runner's streams on one device, none another live runner's, until `release()`
    or until nothing refers to the lease (a run the watchdog gave up on keeps it)."""

    def __init__(self, streams: list[Any], give_back: Any) -> None:
        self.streams = streams
        self.release = weakref.finalize(self, give_back)
        self.release.atexit = False


class _HeldStreams:
    """The stream keys that live runners hold, per device, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[torch.device, set[Any]] = {}
        self._returned: list[tuple[DeviceBackend, list[Any]]] = []
        """Released, still in `_keys`: a release may come from the garbage collector
        inside `lease`, under the lock, so it only appends."""

    def lease(self, backend: DeviceBackend, count: int) -> StreamLease:
        with self._lock:
            while self._returned:
                returned_by, streams = self._returned.pop()
                held = self._keys.setdefault(returned_by.device, set())
                held.difference_update(returned_by.stream_key(stream) for stream in streams)
                for stream in streams:
                    returned_by.release_stream(stream)
            held = self._keys.setdefault(backend.device, set())
            streams = distinct_streams(backend, count, held)
            held.update(backend.stream_key(stream) for stream in streams)
        return StreamLease(streams, functools.partial(self._returned.append, (backend, streams)))

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._keys.clear()
        self._returned.clear()


held_streams = _HeldStreams()


def backend_for(device: torch.device | str | int | None) -> DeviceBackend:
    """The backend for `device` (None or a non-CUDA device: the CPU backend)."""
    if device is None:
        return CpuBackend()
    device = torch.device(device)
    if device.type == "cuda":
        return CudaBackend(device)
    return CpuBackend(device)
