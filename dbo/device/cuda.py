"""The CUDA backend: `torch.cuda` streams and events, on streams dbo makes itself from
the driver (never one of torch's pool)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class CudaBackend:
    """`torch.cuda` streams and events on one device; its streams are dbo's own
    (`_OwnStreams`), never one of torch's pool."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda", f"CudaBackend is made for cuda devices only, got {device}"
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
        return stream.record_event()  # a new event

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
    from the driver (`cuStreamCreateWithPriority`, non-blocking, in torch's primary
    context) as `ExternalStream`s: nothing else gets one. High-priority ones (the device's greatest
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
    least, priority = ctypes.c_int(), ctypes.c_int(0)  # 0: the default priority
    check(driver.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    # Retained for good, never released: on a device the runtime has not used yet this
    # retain creates the primary context, and a release would destroy it with the stream.
    check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuCtxRetain")
    check(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        if high_priority:  # the greatest priority, written into `priority`
            check(driver.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(priority)),
                  "cuCtxGetStreamPriorityRange")
        check(driver.cuStreamCreateWithPriority(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING,
                                                priority), "cuStreamCreateWithPriority")
    finally:
        driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    assert stream.value, "cuStreamCreate succeeded, so it wrote a handle"
    return stream.value
