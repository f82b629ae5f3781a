"""`comm`'s collectives inside `torch.compile(fullgraph=True)` code, on 2 gloo ranks: each
is one node (`comm.compiled`), no graph break, and under `dbo.overlap` the node still
yields while in flight (the baton passes at each exchange), with results equal to the
compiled code on the ubatches in turn; a compiled tensor-parallel block trains so, its
backward exchanges in the ubatch threads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _exchanges import SumInBackward, SumInForward
from _spawn import expect_ok, run_world, start_together

import comm
import dbo

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120.0


class _Exchanges(torch.nn.Module):
    """Every blocking collective `comm` traces, between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).clone()
        comm.all_reduce(y)
        gathered = torch.empty(2 * y.shape[0], 16)
        comm.all_gather_into_tensor(gathered, y)
        reduced = torch.empty_like(y)
        comm.reduce_scatter_tensor(reduced, gathered, comm.ReduceOp.MAX)
        exchanged = torch.empty_like(y)
        comm.all_to_all_single(exchanged, reduced)
        return x + self.b(torch.tanh(exchanged))


class _ParallelMLP(torch.nn.Module):
    """Megatron's column- then row-parallel MLP: an all-reduce each way."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(SumInBackward.apply(x)))
        return x + SumInForward.apply(self.down(h))


def _in_turn(fn: Any) -> Any:
    return lambda x: torch.cat([fn(part) for part in x.tensor_split(2)])


def _compile_checks() -> dict[str, Any]:
    start_together()
    rank, _, _ = comm.init_distributed(timeout_s=60)
    found: dict[str, Any] = {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Exchanges(), _Exchanges())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    found["graph breaks"] = torch._dynamo.explain(model)(x[:4]).graph_break_count
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        with torch.no_grad():
            want = _in_turn(compiled)(x)
            with dbo.trace() as timeline:
                got = dbo.overlap(compiled, timeout_s=TIMEOUT_S)(x)
            found[f"{backend} equal"] = torch.equal(got, want)
            found[f"{backend} close to eager"] = torch.allclose(want, _in_turn(model)(x),
                                                                atol=1e-5)
        found[f"{backend} turns"] = {u: t.turns for u, t in timeline.totals().items()}
    torch._dynamo.reset()
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(_ParallelMLP(), _ParallelMLP())
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    grads = []
    for step in (dbo.overlap(compiled, timeout_s=TIMEOUT_S), _in_turn(compiled)):
        mlp.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        loss = (step(inputs) ** 2).sum()
        with dbo.trace() as timeline:
            loss.backward()
        grads.append([inputs.grad, *(p.grad for p in mlp.parameters())])
        found.setdefault("backward waits", {u: t.waits for u, t in timeline.totals().items()})
    found["training equal"] = all(torch.equal(a, b) for a, b in zip(*grads))
    # A group the compiled node cannot name back is refused when the node runs.
    subgroup = torch.distributed.new_group([0, 1])
    torch._dynamo.reset()

    def on_subgroup(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        comm.all_reduce(t, group=subgroup)
        return t

    try:
        torch.compile(on_subgroup, fullgraph=True, backend="aot_eager")(x)
        found["unknown group"] = "ran"
    except ValueError as error:
        found["unknown group"] = str(error)
    return found


@pytest.mark.timeout(300)
def test_comm_collectives_compile_whole_and_still_overlap_under_dbo() -> None:
    for rank, found in enumerate(expect_ok(run_world(_compile_checks, 2, timeout_s=240))):
        assert found["graph breaks"] == 0, (rank, found)
        for backend in ("aot_eager", "inductor"):
            assert found[f"{backend} equal"] and found[f"{backend} close to eager"], found
            # Two blocks of four exchanges: each ubatch's turn ends at each, then at its end.
            assert found[f"{backend} turns"] == {0: 9, 1: 9}, found
        assert found["training equal"], (rank, found)
        waits = found["backward waits"]
        assert waits.get(0, 0) >= 2 and waits.get(1, 0) >= 2, waits
        assert waits.get(dbo.tracing.CALLER, 0) == 0, waits
        assert "comm.ubatch_groups(group)" in found["unknown group"], found["unknown group"]
