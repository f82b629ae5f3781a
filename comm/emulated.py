"""An emulated network link (fixed latency plus bandwidth, FIFO) to measure in one
process how much communication DBO hides, with no network. Inside an overlap:

    handle = link.transfer(x)
    dbo.yield_()            # the other ubatch computes while x is "on the wire"
    x = handle.wait()
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch


class TransferHandle:
    """An in-flight transfer; `wait()` returns the delivered tensor."""

    def __init__(
        self, delivered: torch.Tensor, done_at: float, event: Any = None
    ) -> None:
        self._delivered = delivered
        self._done_at = done_at
        self._event = event

    @property
    def done_at(self) -> float:
        """`time.perf_counter()` at which a CPU transfer completes."""
        return self._done_at

    def is_completed(self) -> bool:
        if self._event is not None:
            return bool(self._event.query())
        return time.perf_counter() >= self._done_at

    def wait(self) -> torch.Tensor:
        """The delivered tensor, once the transfer is complete.

        CPU: sleeps only the time that remains (the GIL is released meanwhile). CUDA:
        makes the current stream wait for the transfer; does not block the host.
        """
        if self._event is not None:
            stream = torch.cuda.current_stream(self._delivered.device)
            stream.wait_event(self._event)
            # Read on this stream from now on: keep the allocator from reusing it early.
            self._delivered.record_stream(stream)
            return self._delivered
        remaining = self._done_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return self._delivered


class EmulatedLink:
    """A link with a fixed latency (`latency_s` >= 0) and an optional bandwidth
    (`bandwidth_bytes_per_s`; None: latency only): a transfer takes `latency_s +
    num_bytes / bandwidth_bytes_per_s`.

    CPU tensors: the completion time is fixed at launch (no thread, no CPU); the
    delivered tensor is the input itself; FIFO across all callers. CUDA tensors: a sleep
    kernel of the transfer's duration, then a copy, on the current stream (in an
    overlap, switch to the comm stream first); FIFO per stream, so two ubatches' comm
    streams each get a link of their own.
    """

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float | None = None) -> None:
        latency_s = _number("latency_s", latency_s)
        if bandwidth_bytes_per_s is not None:
            bandwidth_bytes_per_s = _number("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
        # Finite: an infinite latency never completes, and sleeping for it fails.
        if not 0 <= latency_s < math.inf:
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s}")
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")
        self.latency_s = float(latency_s)
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._cuda_cycles_per_s: float | None = None

    def duration_s(self, num_bytes: int) -> float:
        """How long a transfer of `num_bytes` occupies the link."""
        if self.bandwidth_bytes_per_s is None:
            return self.latency_s
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def transfer(self, tensor: torch.Tensor) -> TransferHandle:
        """Start sending `tensor`; returns at once with a handle."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"transfer needs a tensor, got {type(tensor).__name__}")
        duration = self.duration_s(tensor.numel() * tensor.element_size())
        if tensor.is_cuda:
            return self._transfer_cuda(tensor, duration)
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + duration
            return TransferHandle(tensor, self._free_at)

    def calibrate(self, device: torch.device | str | int = "cuda") -> None:
        """Measure the CUDA sleep kernel's clock now (it synchronizes the device);
        otherwise the first CUDA transfer does it, inside its overlap. On GPUs whose
        clock boosts under load, calibrate after a warmup."""
        self._cycles_per_second(torch.device(device))

    def _transfer_cuda(self, tensor: torch.Tensor, duration: float) -> TransferHandle:
        cycles = int(duration * self._cycles_per_second(tensor.device)) if duration > 0 else 0
        with torch.cuda.device(tensor.device):  # _sleep runs on the current device's stream
            stream = torch.cuda.current_stream()
            if cycles > 0:
                torch.cuda._sleep(cycles)
            delivered = tensor.clone()
            tensor.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return TransferHandle(delivered, float("nan"), event)

    def _cycles_per_second(self, device: torch.device) -> float:
        """Calibrate `torch.cuda._sleep` once: GPU clock cycles per second."""
        if self._cuda_cycles_per_s is None:
            cycles = 10_000_000
            with torch.cuda.device(device):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(cycles)  # warm up
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                self._cuda_cycles_per_s = cycles / (start.elapsed_time(end) / 1000.0)
        return self._cuda_cycles_per_s


def _number(name: str, value: Any) -> float:
    """`value` as a float (ints, floats, numpy scalars, 0-dim tensors); TypeError for
    anything else, bools and strings included."""
    try:
        if not isinstance(value, (bool, str, bytes)):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise TypeError(f"{name} must be a number, got {value!r}")
