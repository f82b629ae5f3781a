"""`dbo.capture_graph` on CUDA: a replay equals eager DBO bitwise, the workspace keeps the
capture's addresses, replays allocate nothing, growth after the capture is refused, a
failed capture leaves no stream capturing; an MoE layer on the fixed-shape path in a
world of one NCCL rank (this file run by torchrun). Skipped without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dbo
import workspace
from workspace import WorkspaceLockedError

pytestmark = pytest.mark.gpu

HIDDEN = 256
_SLEEP_CYCLES = 2_000_000  # about a millisecond: a missing edge reads stale data


def toy_model(weights: list[torch.Tensor], streams: list[int] | None = None) -> Any:
    """GEMMs on the compute stream, elementwise work on the comm stream behind a sleep
    (a replay whose merge did not wait for the comm branch would read the last one's)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        for weight in weights:
            x = torch.tanh(x @ weight)
            dbo.yield_and_switch_to_comm()
            if streams is not None:
                streams.append(torch.cuda.current_stream().cuda_stream)
            torch.cuda._sleep(_SLEEP_CYCLES)
            x = x * 0.5 + 1
            dbo.yield_and_switch_to_compute()
        return x

    return forward


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_a_replay_is_bitwise_equal_to_eager_dbo_on_the_same_inputs(num_ubatches: int) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(HIDDEN, HIDDEN, device="cuda") / 16 for _ in range(3)]
    streams: list[int] = []
    forward = toy_model(weights, streams)
    with torch.no_grad():
        graph = dbo.capture_graph(forward, torch.randn(96, HIDDEN, device="cuda"),
                                  num_ubatches=num_ubatches, warmup=2)
        per_run = len(streams) // 3
        assert set(streams[-per_run:]) == set(streams[:per_run])  # warmup's streams
        eager = dbo.overlap(forward, num_ubatches=num_ubatches)
        for _ in range(3):
            x = torch.randn(96, HIDDEN, device="cuda")
            expected = eager(x)
            got = graph(x)
            torch.cuda.synchronize()
            assert torch.equal(got, expected)
            assert got.data_ptr() == graph.outputs.data_ptr()


@pytest.mark.usefixtures("fresh_workspace_global")
def test_the_workspace_keeps_the_captured_addresses_and_replays_allocate_nothing() -> None:
    manager = workspace.init_workspace_manager("cuda", num_ubatches=2)
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda") / 16
    addresses: dict[int, int] = {}

    def forward(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = manager.get_simultaneous(((x.shape[0], HIDDEN), torch.float32))
        addresses[dbo.current_ubatch_id()] = scratch.data_ptr()
        torch.matmul(x, weight, out=scratch)
        dbo.yield_()
        return torch.tanh(scratch)

    with torch.no_grad():
        graph = dbo.capture_graph(forward, torch.randn(64, HIDDEN, device="cuda"))
    captured = dict(addresses)
    assert manager.is_locked() and len(captured) == 2
    allocations = manager.stats().num_allocations
    x = torch.randn(64, HIDDEN, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(1000):
        out = graph(x)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated"):
        assert after[key] == before[key], key
    assert manager.stats().num_allocations == allocations
    with torch.no_grad():
        expected = dbo.overlap(forward)(x)
    assert addresses == captured
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.usefixtures("fresh_workspace_global")
def test_growth_after_the_capture_raises_workspace_locked_error() -> None:
    manager = workspace.init_workspace_manager("cuda", num_ubatches=2)

    def forward(x: torch.Tensor, rows: int = 1) -> torch.Tensor:
        (scratch,) = manager.get_simultaneous(((x.shape[0] * rows, HIDDEN), torch.float32))
        scratch.zero_()
        dbo.yield_()
        return x + scratch[: x.shape[0]]

    static = torch.randn(32, HIDDEN, device="cuda")
    with torch.no_grad():
        dbo.capture_graph(forward, static)
        with pytest.raises(WorkspaceLockedError, match="locked"):
            dbo.overlap(forward)(static, 4)


@pytest.mark.parametrize("failure", ["raise", "host read"])
def test_a_failed_capture_leaves_no_stream_capturing_and_the_runner_usable(failure: str) -> None:
    """A Python error during the capture, and a host read, which CUDA refuses on a
    capturing stream and which invalidates the capture."""
    seen: set[Any] = set()
    calls = [0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        seen.add(torch.cuda.current_stream())
        dbo.switch_to_comm()
        seen.add(torch.cuda.current_stream())
        y = x * 2
        dbo.switch_to_compute()
        if dbo.current_ubatch_id() == 1 and calls[0] > 4:  # the capture, after 2 warmups
            if failure == "raise":
                raise ValueError("boom")
            float(y.sum())
        dbo.yield_()
        return y + 1

    static = torch.randn(16, HIDDEN, device="cuda")
    own_error = "boom" if failure == "raise" else "stream is capturing"  # not the join's
    with torch.no_grad(), pytest.raises(
        ValueError if failure == "raise" else RuntimeError, match=own_error
    ) as raised:
        dbo.capture_graph(forward, static)
    assert getattr(raised.value, "ubatch_id", None) == 1
    caller = torch.cuda.current_stream()
    for stream in seen | {caller}:
        with torch.cuda.stream(stream):
            assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == caller

    def plain(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        return x * 3

    x = torch.randn(16, HIDDEN, device="cuda")
    with torch.no_grad():
        assert torch.equal(dbo.overlap(plain)(x), x * 3)
        graph = dbo.capture_graph(plain, static)
        assert torch.equal(graph(x), x * 3)


def test_the_capture_stream_is_one_of_dbos_own_streams_and_goes_back_after() -> None:
    """Not one of torch's pool, which NCCL's internal streams come from: the next stream
    dbo hands out (its streams given back are handed out again, the last first) is it."""
    from dbo.device.cuda import CudaBackend
    from dbo.runtime.context import current_context

    if torch.version.hip:
        pytest.skip("HIP streams come from torch's pool")
    seen: set[int] = set()

    def forward(x: torch.Tensor) -> torch.Tensor:
        context = current_context()
        assert context is not None and context.run is not None
        seen.add(int(context.run.caller_stream.cuda_stream))  # the capture's side stream
        dbo.yield_()
        return x * 2

    with torch.no_grad():
        dbo.capture_graph(forward, torch.randn(8, HIDDEN, device="cuda"))
    assert len(seen) == 1
    backend = CudaBackend(torch.device("cuda", torch.cuda.current_device()))
    stream = backend.new_stream("capture")  # default priority: not a comm stream
    try:
        assert int(stream.cuda_stream) in seen
    finally:
        backend.release_stream(stream)


@pytest.mark.timeout(150)  # a cold start with CUDA and 3 NCCL communicators
def test_an_moe_layer_on_the_fixed_shape_path_replays_like_eager_dbo() -> None:
    from world_of_one import run_world_of_one

    completed = run_world_of_one([Path(__file__)])
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "capture_graph moe: all checks passed" in completed.stdout


def _moe_world() -> int:
    """One NCCL rank: a fixed-shape MoE layer captured and replayed equals eager DBO
    bitwise; the dynamic path is refused before anything is captured."""
    import comm
    from comm.moe import combine_fixed, dispatch_fixed

    _, world_size, device = comm.init_distributed(backend="nccl")
    assert world_size == 1 and len(comm.ubatch_groups(None, 2)) == 2
    torch.manual_seed(0)
    tokens, num_experts = 64, 4
    router = torch.randn(HIDDEN, num_experts, device=device)
    experts = torch.randn(num_experts, HIDDEN, HIDDEN, device=device) / HIDDEN**0.5

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(x)
        dbo.yield_()
        weights, ids = torch.softmax(h @ router, dim=-1).topk(2, dim=-1)
        return h, weights, ids

    def fixed(x: torch.Tensor) -> torch.Tensor:
        h, weights, ids = route(x)
        recv, _, handle = dispatch_fixed(h, ids, num_experts, capacity=tokens // 2)
        return combine_fixed(torch.bmm(recv, experts), handle, weights)

    def dynamic(x: torch.Tensor) -> torch.Tensor:
        h, weights, ids = route(x)
        recv, _, handle = comm.moe.dispatch(h, ids, num_experts)
        return comm.moe.combine(recv, handle, weights)

    with torch.no_grad():
        graph = dbo.capture_graph(fixed, torch.randn(tokens, HIDDEN, device=device))
        for _ in range(3):
            x = torch.randn(tokens, HIDDEN, device=device)
            expected = dbo.overlap(fixed)(x)
            got = graph(x)
            torch.cuda.synchronize()
            if not torch.equal(got, expected):
                print("fixed-shape MoE: replay != eager DBO")
                return 1
        try:
            dbo.capture_graph(dynamic, torch.randn(tokens, HIDDEN, device=device))
        except RuntimeError as error:
            if "dispatch_fixed" not in str(error):
                raise
        else:
            print("the dynamic comm.moe path was captured instead of refused")
            return 1
    if torch.cuda.is_current_stream_capturing():
        print("a stream is still capturing after the refusal")
        return 1
    comm.destroy_distributed()
    print("capture_graph moe: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(_moe_world())
