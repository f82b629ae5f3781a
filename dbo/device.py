"""Device backends: the few stream and event operations the runtime needs.

Each ubatch has a compute stream and a comm stream. On CUDA they are real
`torch.cuda.Stream`s and the switch calls order them with `torch.cuda.Event`s. On CPU
every op is synchronous, so streams are named placeholders and an event is a host-side
flag that is complete once recorded; the runtime runs the same protocol on both, which
is what lets the CPU tests check it (a wait on an event that was never recorded is a
protocol bug, and the CPU backend raises on it).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves


class DeviceBackend(Protocol):
    """What the runtime asks of a device."""

    device: torch.device

    def new_stream(self, name: str) -> Any:
        """A new stream on this device."""

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

    def synchronize(self) -> None:
        """Block the host until all work on the device is done."""


class CpuStream:
    """A named placeholder: CPU ops run synchronously in the thread that issues them."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"CpuStream({self.name!r})"


class CpuEvent:
    """A host-side completion flag; complete as soon as it is recorded."""

    __slots__ = ("stream",)

    def __init__(self, stream: CpuStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: CPU work recorded before the event has already run."""


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

    def synchronize(self) -> None:
        """Nothing to do: CPU work is synchronous."""


class CudaBackend:
    """`torch.cuda` streams and events on one device."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a cuda device, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def stream_key(self, stream: torch.cuda.Stream) -> int:
        # torch.cuda.Stream() hands out streams round-robin from a small per-device pool:
        # two Stream objects can be one CUDA stream.
        return int(stream.cuda_stream)

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

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def backend_for(device: torch.device | str | int | None) -> DeviceBackend:
    """The backend for `device` (None or a non-CUDA device: the CPU backend)."""
    if device is None:
        return CpuBackend()
    device = torch.device(device)
    if device.type == "cuda":
        return CudaBackend(device)
    return CpuBackend(device)
