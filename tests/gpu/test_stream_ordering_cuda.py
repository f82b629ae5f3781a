"""Stream ordering on CUDA: side streams, recv hooks on their owner's comm stream, streams
distinct across live runners and usable on a device the runtime has not used yet, the
inputs' device. Producers run late (`torch.cuda._sleep` first) and outputs start as NaN,
so a missing wait reads the wrong data instead of passing by luck of timing. Skipped
without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import dbo

pytestmark = pytest.mark.gpu

_LATE = 20_000_000
"""Cycles a late producer spins first (`torch.cuda._sleep`): milliseconds on any GPU,
far longer than the host takes to enqueue what follows."""


def test_a_switch_from_a_side_stream_waits_for_it_and_returns_to_it() -> None:
    sides = [torch.cuda.Stream(), torch.cuda.Stream()]
    stayed = [False, False]

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        side = sides[me]
        produced = torch.full_like(x, float("nan"))
        out = torch.full_like(x, float("nan"))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a shared expert's usual place
            torch.cuda._sleep(_LATE)
            produced.copy_(x * 2)
            dbo.switch_to_comm()
            out.copy_(produced)  # on the comm stream: after side's producer
            dbo.switch_to_compute()
            stayed[me] = torch.cuda.current_stream() == side
            out.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        return out

    x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    y = dbo.overlap(fn)(x)
    assert stayed == [True, True]
    assert torch.equal(y, x * 2 + 1)


def test_a_recv_hook_runs_on_its_owners_comm_stream_not_behind_the_other_ubatch() -> None:
    """Ubatch 0's receive runs in ubatch 1's thread while ubatch 1's compute stream is
    busy: on ubatch 0's comm stream it finishes long before that work does."""
    comm_of: dict[int, torch.cuda.Stream] = {}
    ran_on: list[torch.cuda.Stream] = []
    marks: dict[str, torch.cuda.Event] = {}

    def mark(name: str) -> None:
        marks[name] = torch.cuda.Event(enable_timing=True)
        marks[name].record()

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        dbo.switch_to_comm()
        comm_of[me] = torch.cuda.current_stream()
        dbo.switch_to_compute()
        received = torch.full_like(x, float("nan"))
        if me == 0:

            def receive() -> None:
                ran_on.append(torch.cuda.current_stream())
                received.copy_(x + 1)
                mark("received")

            dbo.register_recv_hook(receive)
        dbo.yield_()
        if me == 1:
            torch.cuda._sleep(5 * _LATE)  # ubatch 1's own compute, queued before the hook
            mark("busy")
            dbo.maybe_run_recv_hook()
        dbo.yield_()
        return received if me == 0 else x + 1

    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    mark("start")
    y = dbo.overlap(fn)(x)
    torch.cuda.synchronize()
    assert ran_on == [comm_of[0]]
    assert torch.equal(y, x + 1)
    start = marks["start"]
    assert start.elapsed_time(marks["received"]) < start.elapsed_time(marks["busy"]) / 2


def _streams_of(runner: dbo.UBatchRunner) -> set[int]:
    seen: set[int] = set()

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.add(torch.cuda.current_stream().cuda_stream)
        dbo.switch_to_comm()
        seen.add(torch.cuda.current_stream().cuda_stream)
        dbo.switch_to_compute()
        return x

    x = torch.zeros(1, device="cuda")
    runner.run(fn, [((x,), {})] * runner.num_ubatches)
    return seen


def test_nine_live_runners_of_two_ubatches_have_36_distinct_cuda_streams() -> None:
    """None of them is one of torch's pool streams either (NCCL's internal streams and
    CUDA-graph capture come from that pool); closed runners' streams are reused."""
    runners = [dbo.UBatchRunner(2, device="cuda") for _ in range(9)]
    try:
        ours = [_streams_of(runner) for runner in runners]
    finally:
        for runner in runners:
            runner.close()
    every = set().union(*ours)
    assert len(every) == 36
    pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    pool |= {torch.cuda.Stream(priority=-1).cuda_stream for _ in range(64)}
    pool.add(torch.cuda.current_stream().cuda_stream)
    assert not every & pool
    with dbo.UBatchRunner(2, device="cuda") as again:
        assert _streams_of(again) <= every


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_thread_that_never_set_its_device_gets_an_error_not_streams_on_cuda0() -> None:
    x = torch.ones(4, device="cuda:1")
    errors: list[str] = []

    def serve() -> None:  # a serving thread: its current device is cuda:0
        try:
            dbo.overlap(lambda t: t * 2, device="cuda")(x)
        except ValueError as error:
            errors.append(str(error))

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert errors and "input is on cuda:1 but the ubatch streams are on cuda:0" in errors[0]


def test_a_stream_made_before_the_runtime_used_its_device_runs_kernels() -> None:
    """In a fresh process, dbo's first stream creates the device's primary context: it
    stays retained, so the stream (and the context torch then uses) stays valid."""
    code = (
        "import torch\n"
        "from dbo.device import _own_streams\n"
        "stream = _own_streams.take(torch.device('cuda', 0))\n"
        "with torch.cuda.stream(stream):\n"
        "    x = torch.full((1024,), 2.0, device='cuda') * 3\n"
        "stream.synchronize()\n"
        "assert x.sum().item() == 6 * 1024\n"
        "print('stream ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert completed.returncode == 0 and "stream ok" in completed.stdout, completed.stderr[-4000:]
