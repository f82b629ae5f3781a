"""Training under DBO across gloo ranks: the overlapped backward gives the gradients of
the same ubatches in turn bit for bit (inputs and parameters), on the README's MoE
layer, the demo model (both MoE paths), the tensor-parallel MLP, a Megatron-style one
whose backward all-reduces with `comm` (the waits are in the ubatch threads) and a
Hugging Face MoE model through `comm.moe.shard_experts`; a failure in one rank's
backward reaches every rank."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _exchanges import ReadmeMoELayer, SumInBackward, SumInForward
from _spawn import expect_ok, run_world, start_together

import comm
import dbo

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


class MegatronMLP(torch.nn.Module):
    """x + gelu(x @ W_in) @ W_out, column- then row-parallel, with conjugate all-reduces
    in forward and backward (Megatron's f and g)."""

    def __init__(self, hidden: int, ffn: int, seed: int) -> None:
        super().__init__()
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        generator = torch.Generator().manual_seed(seed)
        w_in = torch.randn(hidden, ffn, generator=generator) / hidden**0.5
        w_out = torch.randn(ffn, hidden, generator=generator) / ffn**0.5
        shard = slice(rank * ffn // world_size, (rank + 1) * ffn // world_size)
        self.w_in = torch.nn.Parameter(w_in[:, shard].contiguous())
        self.w_out = torch.nn.Parameter(w_out[shard].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = SumInBackward.apply(x)
        partial = torch.nn.functional.gelu(h @ self.w_in) @ self.w_out
        return x + SumInForward.apply(partial)


def _models(world_size: int) -> dict[str, tuple[torch.nn.Module, Callable[[int], Any]]]:
    """name -> (model, inputs(rank)), each small; the same weights on every rank."""
    from hf_moe import build_model
    from moe_overlap import MoEModel
    from tensor_parallel_mlp import ParallelMLP

    def features(rank: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(100 + rank)
        return torch.randn(48, 32, generator=generator, requires_grad=True)

    def same_features(rank: int) -> torch.Tensor:  # tensor parallel: every rank's tokens
        return features(0)

    def token_ids(rank: int) -> torch.Tensor:
        return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(rank))

    torch.manual_seed(0)
    readme = torch.nn.Sequential(*[ReadmeMoELayer(32, num_experts=2 * world_size)
                                   for _ in range(2)])
    hf = build_model("qwen3_moe", 2, 32, 2 * world_size, 2, 64)
    comm.moe.shard_experts(hf)
    return {
        "readme_moe": (readme, features),
        "demo_moe": (MoEModel(2, 32, 64, 2, 2), features),
        "demo_moe_fixed_shape": (MoEModel(2, 32, 64, 2, 2, capacity=24), features),
        "tensor_parallel_mlp": (
            torch.nn.Sequential(*[ParallelMLP(32, 64, seed) for seed in range(2)]),
            same_features,
        ),
        "megatron_mlp": (
            torch.nn.Sequential(*[MegatronMLP(32, 64, seed) for seed in range(2)]),
            same_features,
        ),
        "hf_qwen3_moe": (hf, token_ids),
    }


def _loss(output: Any) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return (logits.float() ** 2).mean()


def _gradients(
    model: torch.nn.Module, inputs: torch.Tensor, step: Callable[[torch.Tensor], Any]
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    inputs.grad = None
    _loss(step(inputs)).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return ([inputs.grad.clone()] if inputs.requires_grad else []) + grads


def _check_every_model_trains_bitwise() -> dict[str, Any]:
    start_together()
    rank, world_size, _ = comm.init_distributed(timeout_s=60)
    equal: dict[str, Any] = {}
    for name, (model, make_inputs) in _models(world_size).items():
        inputs = make_inputs(rank)
        model.train()

        def in_turn(x: torch.Tensor, model: torch.nn.Module = model) -> Any:
            return dbo.default_merge([model(part) for part in x.tensor_split(2)])

        want = _gradients(model, inputs, in_turn)
        got = _gradients(model, inputs, dbo.overlap(model, timeout_s=60))
        again = _gradients(model, inputs, dbo.overlap(model, timeout_s=60))
        equal[name] = (
            len(got) == len(want) == len(again) > 1
            and all(torch.equal(a, b) for a, b in zip(got, want))
            and all(torch.equal(a, b) for a, b in zip(again, want))
        )
        if name == "megatron_mlp":  # where the backward's all-reduces waited
            loss = _loss(dbo.overlap(model, timeout_s=60)(inputs))
            with dbo.trace() as timeline:
                loss.backward()
            equal["backward waits per ubatch"] = {
                ubatch: total.waits for ubatch, total in timeline.totals().items()
            }
    return equal


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_under_dbo_equal_the_same_ubatches_in_turn_bitwise(world_size: int) -> None:
    results = expect_ok(
        run_world(_check_every_model_trains_bitwise, world_size, timeout_s=240)
    )
    for rank, equal in enumerate(results):
        waits = equal.pop("backward waits per ubatch")
        assert equal and all(equal.values()), f"rank {rank}: {equal}"
        # Each ubatch waited for its own two backward all-reduces; the caller for none.
        assert waits.get(0, 0) >= 2 and waits.get(1, 0) >= 2, waits
        assert waits.get(dbo.tracing.CALLER, 0) == 0, waits


def _fail_in_one_ranks_backward(failing_rank: int) -> str:
    """Rank `failing_rank` raises first thing in ubatch 1's backward, before its exchanges: its
    peer waits there until the group's timeout, then raises too."""
    start_together()
    rank, world_size, _ = comm.init_distributed(timeout_s=10)
    model = ReadmeMoELayer(16, num_experts=2 * world_size)

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if rank == failing_rank and dbo.current_ubatch_id() == 1:
                raise KeyError("injected in the backward")
            return grad

    step = dbo.overlap(lambda x: Fail.apply(model(x)), timeout_s=60)
    x = torch.randn(32, 16, requires_grad=True)
    try:
        _loss(step(x)).backward()
    except Exception as error:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(error).__name__}: ubatch {getattr(error, 'ubatch_id', None)}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_failure_in_one_ranks_backward_raises_on_every_rank() -> None:
    results = expect_ok(run_world(_fail_in_one_ranks_backward, 2, args=(0,), timeout_s=90))
    assert results[0] == "KeyError: ubatch 1", results
    assert results[1] != "no error", results
