"""The overlapped backward on CUDA, where autograd would run every ubatch's kernels on its
one device thread: each ubatch's backward runs in its ubatch thread, on its forward's
streams, gives the in-turn gradients, and one ubatch's backward communication overlaps
the other's backward compute (event timing); the training examples (and the one under
FSDP2) keep their checks on NCCL. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import dbo

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SLEEP_CYCLES = 20_000_000  # ~10 ms on current GPUs: long against launch latencies
TRANSFER_CYCLES = 2_000_000  # ~1 ms: shorter than ubatch 1's GEMMs


class _Probe(torch.autograd.Function):
    """Identity whose backward notes (ubatch, stream, thread) and, given `operand`, times
    with events some "compute" (GEMMs on `operand`: ubatch 1 ten times ubatch 0's) and
    then a "transfer" (a one-block sleep kernel) on the ubatch's comm stream."""

    notes: list[dict[str, Any]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, operand: torch.Tensor | None) -> torch.Tensor:
        ctx.operand = operand
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        me = dbo.current_ubatch_id()
        note: dict[str, Any] = {
            "ubatch": me, "thread": threading.current_thread().name,
            "stream": torch.cuda.current_stream().cuda_stream,
        }
        if ctx.operand is not None:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
            for _ in range(1 if me == 0 else 10):
                ctx.operand @ ctx.operand
            events[1].record()
            dbo.yield_and_switch_to_comm()  # the other ubatch computes meanwhile
            events[2].record()
            torch.cuda._sleep(TRANSFER_CYCLES)
            events[3].record()
            dbo.yield_and_switch_to_compute()
            note["events"] = events
        _Probe.notes.append(note)
        return grad, None


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 256)).cuda()


def _grads(model: torch.nn.Module, x: torch.Tensor, step: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    (step(x) ** 2).sum().backward()
    torch.cuda.synchronize()
    return [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]


def test_the_overlapped_backward_gives_the_in_turn_gradients_on_cuda() -> None:
    model = _model()

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.enabled():
            torch.cuda._sleep(SLEEP_CYCLES)  # a late producer: a missing wait reads garbage
        h = model[1](model[0](x))
        dbo.yield_()
        return _Probe.apply(model[2](h), None)

    x = torch.randn(1001, 256, device="cuda", requires_grad=True)
    got = _grads(model, x, dbo.overlap(fn))
    want = _grads(model, x, lambda x: torch.cat([fn(part) for part in x.tensor_split(2)]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_each_ubatch_backward_runs_in_its_thread_on_its_own_stream() -> None:
    model = _model()
    _Probe.notes = []
    caller_stream = torch.cuda.current_stream().cuda_stream
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    _grads(model, x, dbo.overlap(lambda x: _Probe.apply(model(x), None)))
    by_ubatch = {note["ubatch"]: note for note in _Probe.notes}
    assert sorted(by_ubatch) == [0, 1], _Probe.notes
    assert all(note["thread"].startswith("dbo-ubatch-") for note in _Probe.notes)
    streams = {note["stream"] for note in _Probe.notes}
    assert len(streams) == 2 and caller_stream not in streams, _Probe.notes


def test_one_ubatch_backward_transfer_overlaps_the_other_ubatch_compute() -> None:
    model = _model()
    _Probe.notes = []
    operand = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    _grads(model, x, dbo.overlap(lambda x: _Probe.apply(model(x), operand)))
    events = {note["ubatch"]: note["events"] for note in _Probe.notes}
    start = events[0][0]

    def span(ubatch: int, first: int) -> tuple[float, float]:  # ms after ubatch 0 began
        return start.elapsed_time(events[ubatch][first]), start.elapsed_time(
            events[ubatch][first + 1]
        )

    transfer_0, compute_1 = span(0, 2), span(1, 0)
    overlap_ms = min(transfer_0[1], compute_1[1]) - max(transfer_0[0], compute_1[0])
    assert overlap_ms > 0.5 * (transfer_0[1] - transfer_0[0]), (transfer_0, compute_1)


@pytest.mark.timeout(150)
@pytest.mark.skipif(os.environ.get("DBO_IN_GPU_CHECK") == "1",
                    reason="benchmarks/gpu_check.py runs train_moe.py as a step")
def test_the_training_example_on_nccl_keeps_losses_and_weights_equal(tmp_path: Path) -> None:
    from world_of_one import run_world_of_one

    completed = run_world_of_one(
        [ROOT / "examples" / "train_moe.py", "--steps", "3", "--tokens", "256", "--json",
         "--out", tmp_path]
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert (result["backend"], result["device"]) == ("nccl", "cuda")
    assert result["losses_equal"] and result["weights_equal"]


@pytest.mark.timeout(150)
@pytest.mark.skipif(os.environ.get("DBO_IN_GPU_CHECK") == "1",
                    reason="benchmarks/gpu_check.py runs train_fsdp.py as a step")
def test_the_fsdp_training_example_on_nccl_trains_as_in_turn() -> None:
    from world_of_one import run_world_of_one

    completed = run_world_of_one(
        [ROOT / "examples" / "train_fsdp.py", "--steps", "3", "--tokens", "256", "--json"]
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert (result["backend"], result["device"]) == ("nccl", "cuda")
    assert result["losses_close"]
    assert result["reduce_scatters_dbo"] == result["reduce_scatters_split"]  # 0 in a world of 1
