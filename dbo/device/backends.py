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
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dbo.device.cuda import CudaBackend


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


@dataclass(eq=False, slots=True)  # each stream its own queue: compared by identity
class CpuStream:
    """A named placeholder: CPU ops run synchronously in the thread that issues them."""

    name: str


@dataclass(eq=False, slots=True)
class CpuEvent:
    """A CPU event: complete once recorded (CPU work is synchronous); names its stream."""

    stream: CpuStream


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


def backend_for(device: torch.device | str | int | None) -> DeviceBackend:
    """The backend for `device` (None or a non-CUDA device: the CPU backend)."""
    device = torch.device("cpu" if device is None else device)
    return CudaBackend(device) if device.type == "cuda" else CpuBackend(device)
