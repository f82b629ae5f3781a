"""Backward through comm.moe across real processes (2 gloo ranks).

Every rank must run its backward all-to-alls in the same order, and every rank must run
them at all. Each test's ranks return their gradients (x and the rank's own expert
weights, float64) and the parent compares them with a single-process dense reference of
the whole world (every rank's tokens, every expert, no communication): the distributed
backward computes the gradient of the sum of the ranks' losses.

- (a) an overlapped forward whose ubatch threads record data-dependent numbers of
  autograd ops (ordered by each thread's sequence counter alone, the ranks would pair
  the wrong ubatches' exchanges and get silently wrong gradients);
- (b) the usual expert loop that skips experts with no rows, overlapped (the same
  hazard, with different sizes: a gloo abort);
- (c) without dbo, a rank whose `expert_out` does not require grad (no rows for its
  experts, or frozen experts) still runs both backward all-to-alls, sending zeros;
- (d) only the experts train (the layer's input needs no grad on any rank) and one
  rank's experts get no rows: that rank's `combine` still records a backward, so its
  peer neither waits nor pairs the exchange with a later collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _spawn import expect_ok, run_world, start_together

import comm
import dbo

pytestmark = pytest.mark.distributed

WORLD = 2


def _expert_weights(num_experts: int, hidden: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    weights = torch.randn(num_experts, hidden, hidden, generator=generator, dtype=torch.float64)
    return weights / hidden**0.5


def _combine_weights(num_tokens: int, topk: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(77 + rank)
    return torch.rand(num_tokens, topk, generator=generator, dtype=torch.float64) + 0.5


# ---------------------------------------------------------------- the scenarios' data
def _data_dependent_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a): 2 experts (one per rank), hidden 4, 8 tokens. Rank 0's first half and rank
    1's second half are "large" (mean > 0.5): those ubatches record extra ops. Both
    halves route alike, so every exchange moves the same number of rows in both
    ubatches (a mismatch is silent)."""
    hidden = 4
    grid = torch.arange(4 * hidden, dtype=torch.float64).reshape(4, hidden)
    big, small = 1.0 + grid / 100, grid / 1000
    x = torch.cat([big, small]) if rank == 0 else torch.cat([small, big])
    ids = torch.tensor([[0], [1]] * 4)
    return x, ids


def _skewed_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b), (c): 4 experts (two per rank), hidden 8, 8 tokens. The first half goes to
    expert 0 (rank 0), the second half to expert 2 (rank 1): in each half one rank's
    experts get no rows at all."""
    hidden = 8
    x = torch.arange(8 * hidden, dtype=torch.float64).reshape(8, hidden) / 50 + rank
    ids = torch.tensor([[0]] * 4 + [[2]] * 4)
    return x, ids


def _tanh_expert(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(rows @ weight)


def _affine_tanh_expert(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(rows @ weight) * 2 + 1


_SKEWED: dict[str, Any] = dict(  # uneven loads: some experts get no rows on some ranks
    inputs=_skewed_inputs, num_experts=4, hidden=8, expert=_affine_tanh_expert, frozen=()
)

SCENARIOS: dict[str, dict[str, Any]] = {
    "data_dependent_ops": dict(
        inputs=_data_dependent_inputs,
        num_experts=2,
        hidden=4,
        expert=_tanh_expert,
        frozen=(),
    ),
    "skip_empty_experts": _SKEWED,
    "no_grad_expert_out": _SKEWED,
    # rank 1's experts are frozen: its expert_out never needs grad
    "frozen_experts": {**_SKEWED, "frozen": (2, 3)},
    # (d) x needs no grad (a frozen model below the layer): only the experts train
    "experts_only_train": {**_SKEWED, "x_grad": False},
}


# ---------------------------------------------------------------- the ranks' side
def _moe_forward(
    name: str, rank: int, weights: list[torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The scenario's MoE layer as a rank runs it (expert parallel, `weights` local)."""
    spec = SCENARIOS[name]
    num_experts, expert, frozen = spec["num_experts"], spec["expert"], spec["frozen"]
    per_rank = num_experts // WORLD

    def forward(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        recv, local_ids, handle = comm.moe.dispatch(x, ids, num_experts)
        if name == "data_dependent_ops":
            out = expert(recv, weights[0])
            if float(x.mean()) > 0.5:  # data-dependent extra autograd ops (same values)
                for _ in range(4):
                    out = out * 1.0
        else:
            # skip_empty_experts: every row connected; otherwise zeros that do not
            # require grad until an expert with rows writes into them.
            out = recv * 1.0 if name == "skip_empty_experts" else torch.zeros_like(recv)
            # (experts_only_train: recv needs no grad, so `out` is plain until written)
            for local in range(per_rank):
                mask = local_ids == local
                if bool(mask.any()):  # skip experts that got no rows
                    rows = expert(recv[mask], weights[local])
                    if rank * per_rank + local in frozen:
                        rows = rows.detach()
                    out = out.index_put((mask,), rows)
        return comm.moe.combine(out, handle, gates)

    return forward


def _rank_gradients(name: str, mode: str) -> dict[str, Any]:
    """Forward (overlapped or serial halves), loss = sum(y^2), the grads of x and of this
    rank's experts; also whether the forward equals the serial halves bitwise."""
    start_together()
    rank, world, _ = comm.init_distributed(timeout_s=20)
    assert world == WORLD
    spec = SCENARIOS[name]
    per_rank = spec["num_experts"] // world
    all_weights = _expert_weights(spec["num_experts"], spec["hidden"])
    weights = [all_weights[rank * per_rank + e].clone().requires_grad_() for e in range(per_rank)]
    x, ids = spec["inputs"](rank)
    x_grad = spec.get("x_grad", True)
    x = x.clone().requires_grad_(x_grad)
    gates = _combine_weights(x.shape[0], ids.shape[1], rank)
    forward = _moe_forward(name, rank, weights)
    wrt = [x, *weights] if x_grad else weights
    half = x.shape[0] // 2

    def serial() -> torch.Tensor:
        first = forward(x[:half], ids[:half], gates[:half])
        return torch.cat([first, forward(x[half:], ids[half:], gates[half:])])

    results: dict[str, Any] = {}
    for step in range(2):  # twice: a second step must not touch the first one's graph
        if mode == "overlap":
            y = dbo.overlap(forward)(x, ids, gates)
            with torch.no_grad():
                results["forward_equal"] = torch.equal(y, serial())
        else:
            y = serial()
        if x_grad:
            grads = torch.autograd.grad(y.pow(2).sum(), wrt, allow_unused=True)
        else:
            # backward(), not autograd.grad(inputs=weights): a rank's exchange whose
            # rows had no rows' worth of grad leads to no weight of its own, and
            # autograd.grad would prune it (a documented limit); backward runs it.
            y.pow(2).sum().backward()
            grads = tuple(weight.grad for weight in weights)
            for weight in weights:
                weight.grad = None
        grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt))
        if not x_grad:
            grads = (torch.zeros_like(x), *grads)
        results[f"step{step}"] = {"x": grads[0], "weights": torch.stack(grads[1:])}
    return results


# ---------------------------------------------------------------- the reference
def _dense_reference(name: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Grads of sum over ranks of sum(y_r^2): per rank's x, and of every expert."""
    spec = SCENARIOS[name]
    weights = _expert_weights(spec["num_experts"], spec["hidden"]).requires_grad_()
    xs, loss = [], torch.zeros((), dtype=torch.float64)
    for rank in range(WORLD):
        x, ids = spec["inputs"](rank)
        x = x.clone().requires_grad_()
        gates = _combine_weights(x.shape[0], ids.shape[1], rank)
        rows = []
        for t in range(x.shape[0]):
            total = torch.zeros(x.shape[1], dtype=torch.float64)
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                out = spec["expert"](x[t : t + 1], weights[e])[0]
                if e in spec["frozen"]:
                    out = out.detach()
                total = total + gates[t, k] * out
            rows.append(total)
        loss = loss + torch.stack(rows).pow(2).sum()
        xs.append(x)
    grads = torch.autograd.grad(loss, [*xs, weights])
    return list(grads[:WORLD]), grads[WORLD]


def _check_against_reference(name: str, mode: str) -> None:
    values = expect_ok(run_world(_rank_gradients, WORLD, args=(name, mode), timeout_s=90))
    grad_xs, grad_weights = _dense_reference(name)
    per_rank = SCENARIOS[name]["num_experts"] // WORLD
    for rank, value in enumerate(values):
        if mode == "overlap":
            assert value["forward_equal"], f"rank {rank}: DBO forward differs from serial"
        own = grad_weights[rank * per_rank : (rank + 1) * per_rank]
        for step in ("step0", "step1"):
            got = value[step]
            expected_x = grad_xs[rank] if SCENARIOS[name].get("x_grad", True) else 0 * got["x"]
            assert torch.allclose(got["x"], expected_x, rtol=1e-9, atol=1e-12), (
                f"rank {rank} {step}: grad x off by {(got['x'] - expected_x).abs().max()}"
            )
            assert torch.allclose(got["weights"], own, rtol=1e-9, atol=1e-12), (
                f"rank {rank} {step}: expert grads off by {(got['weights'] - own).abs().max()}"
            )


@pytest.mark.timeout(150)
def test_overlapped_backward_with_data_dependent_op_counts_matches_reference() -> None:
    """(a) ubatch 0 records extra autograd ops on rank 0, ubatch 1 on rank 1: the backward
    exchanges must still pair up by ubatch (reverse launch order) on both ranks."""
    _check_against_reference("data_dependent_ops", "overlap")


@pytest.mark.timeout(150)
def test_overlapped_backward_when_experts_with_no_rows_are_skipped() -> None:
    """(b) the expert loop skips experts without rows (a different number of ops per rank
    and ubatch, and exchanges of different sizes): runs to completion, correct grads."""
    _check_against_reference("skip_empty_experts", "overlap")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["no_grad_expert_out", "frozen_experts"])
def test_backward_when_a_ranks_expert_out_does_not_require_grad(name: str) -> None:
    """(c) no dbo: a rank whose expert_out does not require grad (its experts got no rows
    and left zeros_like(recv); or its experts are frozen) still takes part in both
    backward all-to-alls, sending zeros where it has no gradient."""
    _check_against_reference(name, "serial")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["serial", "overlap"])
def test_backward_when_only_the_experts_train_and_a_rank_gets_no_rows(mode: str) -> None:
    """(d) x needs no grad on any rank: whether `combine` is differentiable depends on
    `expert_out` alone, which needs none on the rank whose experts got no rows. The ranks
    agree (one flag all-reduce per such `combine`): every rank takes part in the
    backward, and the experts' gradients include the tokens of the rank with no rows."""
    _check_against_reference("experts_only_train", mode)
