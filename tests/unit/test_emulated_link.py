"""comm.EmulatedLink on CPU: latency, bandwidth, FIFO, and overlap inside dbo."""

from __future__ import annotations

import time

import pytest
import torch

import dbo
from comm import EmulatedLink


def test_a_transfer_takes_its_latency_and_returns_the_tensor() -> None:
    link = EmulatedLink(latency_s=0.05)
    x = torch.arange(4.0)
    started = time.perf_counter()
    handle = link.transfer(x)
    assert time.perf_counter() - started < 0.02, "transfer() returns at once"
    assert not handle.is_completed()
    assert handle.wait() is x
    elapsed = time.perf_counter() - started
    assert 0.05 <= elapsed < 0.5
    assert handle.is_completed()


def test_bandwidth_adds_bytes_over_rate() -> None:
    link = EmulatedLink(latency_s=0.01, bandwidth_bytes_per_s=1000.0)
    assert link.duration_s(40) == pytest.approx(0.01 + 0.04)
    started = time.perf_counter()
    link.transfer(torch.zeros(10, dtype=torch.float32)).wait()  # 40 bytes
    assert time.perf_counter() - started >= 0.05


def test_transfers_queue_fifo_and_the_host_is_free_meanwhile() -> None:
    link = EmulatedLink(latency_s=0.04)
    first, second = link.transfer(torch.zeros(1)), link.transfer(torch.zeros(1))
    assert second.done_at - first.done_at == pytest.approx(0.04, abs=1e-3)
    started = time.perf_counter()
    second.wait()
    first.wait()  # already done: no extra wait
    assert time.perf_counter() - started < 0.2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        EmulatedLink(latency_s=-1)
    with pytest.raises(ValueError):
        EmulatedLink(latency_s=0, bandwidth_bytes_per_s=0)
    with pytest.raises(TypeError):
        EmulatedLink(0.0).transfer([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        EmulatedLink(latency_s=float("inf"))  # a transfer that never completes
    with pytest.raises(ValueError, match="finite"):
        EmulatedLink(latency_s=float("nan"))
    with pytest.raises(TypeError, match="bandwidth_bytes_per_s must be a number"):
        EmulatedLink(0.0, bandwidth_bytes_per_s=True)  # not 1 byte/s
    with pytest.raises(TypeError, match="latency_s must be a number"):
        EmulatedLink(latency_s="0.1")  # type: ignore[arg-type]
    # Numbers of other kinds are fine: a 0-dim tensor, an int.
    link = EmulatedLink(latency_s=torch.tensor(0.001), bandwidth_bytes_per_s=1000)  # type: ignore[arg-type]
    assert link.latency_s == pytest.approx(0.001)


def test_two_ubatches_overlap_their_transfers_with_compute() -> None:
    latency = 0.03
    link = EmulatedLink(latency_s=latency)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            time.sleep(latency)  # "compute" (releases the GIL like torch ops do)
            handle = link.transfer(x + 1)
            dbo.yield_()
            x = handle.wait()
        return x

    started = time.perf_counter()
    out = dbo.overlap(fn)(torch.zeros(4))
    overlapped = time.perf_counter() - started
    assert torch.equal(out, torch.full((4,), 3.0))
    # Serial would be 2 ubatches x 3 layers x (compute + transfer) = 0.36 s; with the
    # overlap the transfers hide behind the other ubatch's compute: ~0.21 s.
    assert overlapped < 0.3
