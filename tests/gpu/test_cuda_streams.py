"""CUDA backend: per-ubatch streams, fork/join events, emulated link. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import dbo
from comm import EmulatedLink

pytestmark = pytest.mark.gpu


def test_ubatches_run_on_their_own_streams_and_join_the_callers() -> None:
    caller_stream = torch.cuda.current_stream()
    seen: dict[int, tuple[int, int]] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        compute = torch.cuda.current_stream().cuda_stream
        dbo.switch_to_comm()
        comm = torch.cuda.current_stream().cuda_stream
        dbo.switch_to_compute()
        seen[me] = (compute, comm)
        return x * 2

    x = torch.arange(8.0, device="cuda")
    y = dbo.overlap(fn)(x)
    assert torch.equal(y, x * 2)
    streams = {s for pair in seen.values() for s in pair}
    assert len(streams) == 4 and caller_stream.cuda_stream not in streams
    assert torch.cuda.current_stream() == caller_stream


def test_comm_streams_have_the_greatest_priority_and_compute_streams_the_default() -> None:
    """A transfer on a comm stream starts ahead of the other ubatch's queued GEMM blocks."""
    _, greatest = torch.cuda.current_stream().priority_range()
    seen: dict[str, set[int]] = {"compute": set(), "comm": set()}

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen["compute"].add(torch.cuda.current_stream().priority)
        dbo.switch_to_comm()
        seen["comm"].add(torch.cuda.current_stream().priority)
        dbo.switch_to_compute()
        return x + 1

    dbo.overlap(fn)(torch.zeros(8, device="cuda"))
    assert seen["comm"] == {greatest}, seen
    assert seen["compute"] == {0}, seen


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_cuda_overlap_is_bitwise_equal_to_serial(num_ubatches: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 256, device="cuda") / 16

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            if dbo.enabled():
                torch.cuda._sleep(5_000_000)  # a late producer: a missing wait reads garbage
            x = torch.tanh(x @ weight)
            dbo.yield_and_switch_to_comm()
            x = x + 1
            dbo.yield_and_switch_to_compute()
        return x

    x = torch.randn(1001, 256, device="cuda")
    expected = torch.cat([fn(p) for p in torch.tensor_split(x, num_ubatches)])
    assert torch.equal(dbo.overlap(fn, num_ubatches=num_ubatches)(x), expected)


def test_emulated_link_overlaps_on_the_comm_stream() -> None:
    link = EmulatedLink(latency_s=0.002)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = x @ x.T @ x / x.shape[1]
            dbo.switch_to_comm()
            handle = link.transfer(x)
            dbo.yield_and_switch_to_compute()
            x = handle.wait()
        return x

    x = torch.randn(512, 512, device="cuda")
    expected = torch.cat([fn(p) for p in torch.tensor_split(x, 2)])
    torch.testing.assert_close(dbo.overlap(fn)(x), expected)


def test_a_recv_hook_kernel_is_ordered_before_its_owner_reads() -> None:
    # Ubatch 0's receive runs in ubatch 1's thread (on ubatch 0's comm stream) and is slow;
    # ubatch 0 then reads the buffer on its own stream and must see the received data.
    received = [torch.zeros(1 << 20, device="cuda") for _ in range(2)]

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()

        def receive() -> None:
            torch.cuda._sleep(50_000_000)  # tens of ms on any GPU clock
            received[me].fill_(float(me + 1))

        dbo.register_recv_hook(receive)
        dbo.yield_()
        dbo.maybe_run_recv_hook()
        dbo.yield_()
        return received[me][:1].clone() + x[:1] * 0

    out = dbo.overlap(fn)(torch.zeros(2, device="cuda"))
    assert out.tolist() == [1.0, 2.0]


@pytest.mark.timeout(300)  # a cold torchrun start with CUDA and 3 NCCL communicators
@pytest.mark.timeout(150)  # a cold start with CUDA and NCCL communicators
def test_nccl_world_of_one_with_per_ubatch_communicators() -> None:
    from pathlib import Path

    from world_of_one import run_world_of_one

    completed = run_world_of_one([Path(__file__).with_name("nccl_world.py")])
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "nccl world: all checks passed" in completed.stdout


def test_trace_records_the_turns_of_a_cuda_overlap() -> None:
    """The timeline is host-side: on CUDA it shows the turns (kernel launches) and the
    overlapped call, the same as on CPU."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        dbo.yield_()
        return x + 1

    x = torch.arange(8.0, device="cuda")
    with dbo.trace() as timeline:
        y = dbo.overlap(fn)(x)
    assert torch.equal(y, x * 2 + 1)
    turns = timeline.totals()
    assert turns[0].turns == turns[1].turns == 2
    assert [span.name for span in timeline.spans].count("dbo.overlap") == 1
