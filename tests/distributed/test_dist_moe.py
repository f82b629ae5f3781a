"""comm.moe dispatch/combine across real processes.

- identity experts: combine(dispatch(x)) == x * sum_k(weights), for uneven loads, a rank
  that receives nothing and a rank with no tokens at all, outside and inside an overlap;
- a full MoE layer (router, top-k, two-matmul experts split over the ranks) equals a
  single-process dense reference (allclose), and DBO equals the serial run of the same
  ubatch split bitwise.
"""

from __future__ import annotations

import pytest
import torch
from _spawn import expect_ok, run_world

import comm
import dbo

pytestmark = pytest.mark.distributed

HIDDEN = 16
FFN = 32
TOPK = 2
EXPERTS_PER_RANK = 2


def _tokens(rank: int, num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float64)


def _routing(
    num_tokens: int, num_experts: int, rank: int, seed: int, skip_rank_experts: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k ids (distinct per token) and weights; optionally avoid one rank's experts."""
    generator = torch.Generator().manual_seed(seed * 100 + rank + 7)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skip_rank_experts is not None:
        start = skip_rank_experts * EXPERTS_PER_RANK
        scores[:, start : start + EXPERTS_PER_RANK] = -1.0
    weights, ids = scores.topk(TOPK, dim=1)
    return ids, weights.to(torch.float64)


def _check_identity_round_trip() -> int:
    rank, world, _ = comm.init_distributed(timeout_s=30)
    num_experts = EXPERTS_PER_RANK * world
    num_checked = 0
    runner = dbo.UBatchRunner(2)
    # (tokens per rank, the rank whose experts nobody picks)
    layouts = [
        ([5, 3, 8, 1][:world], None),
        ([4, 0, 6, 2][:world], None),  # rank 1 has no tokens at all
        ([6, 2, 3, 5][:world], world - 1),  # the last rank receives nothing
        ([0] * world, None),  # nothing anywhere
    ]
    for seed, (num_tokens_per_rank, skipped) in enumerate(layouts):
        num_tokens = num_tokens_per_rank[rank]
        x = _tokens(rank, num_tokens, seed)
        ids, weights = _routing(num_tokens, num_experts, rank, seed, skipped)
        expected = x * weights.sum(dim=1, keepdim=True)

        recv_x, recv_ids, handle = comm.moe.dispatch(x, ids, num_experts)
        assert recv_ids.shape == (recv_x.shape[0],) and recv_ids.dtype == torch.int64
        assert int(handle.num_recv_tokens_per_expert.sum()) == recv_x.shape[0]
        if skipped == rank:
            assert recv_x.shape[0] == 0, "nobody routes to this rank's experts"
        if recv_ids.numel():
            assert int(recv_ids.min()) >= 0 and int(recv_ids.max()) < EXPERTS_PER_RANK
        y = comm.moe.combine(recv_x.clone(), handle, weights)
        assert y.shape == x.shape and torch.allclose(y, expected), (seed, y, expected)

        # Inside an overlap (a runner, so that a rank with fewer tokens than ubatches
        # still runs two ubatches and matches the other ranks' collectives).
        def round_trip(x_part: torch.Tensor, ids_part: torch.Tensor, w_part: torch.Tensor):
            recv, _, part_handle = comm.moe.dispatch(x_part, ids_part, num_experts)
            return comm.moe.combine(recv, part_handle, w_part)

        parts = list(zip(*(torch.tensor_split(t, 2) for t in (x, ids, weights))))
        outputs = runner.run(round_trip, [(tuple(p), {}) for p in parts])
        assert torch.allclose(torch.cat(outputs), expected), seed
        num_checked += 1
    runner.close()
    return num_checked


class _MoELayer:
    """A router, top-k softmax gating, and `num_experts` two-matmul experts (float64)."""

    def __init__(self, num_experts: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.num_experts = num_experts
        self.router = torch.randn(HIDDEN, num_experts, generator=generator, dtype=torch.float64)
        self.w1 = torch.randn(num_experts, HIDDEN, FFN, generator=generator, dtype=torch.float64)
        self.w2 = torch.randn(num_experts, FFN, HIDDEN, generator=generator, dtype=torch.float64)
        self.w1 /= HIDDEN**0.5
        self.w2 /= FFN**0.5

    def gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ self.router
        weights, ids = logits.topk(TOPK, dim=1)
        return ids, torch.softmax(weights, dim=1)

    def expert(self, expert_id: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.relu(rows @ self.w1[expert_id]) @ self.w2[expert_id]

    def forward_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Expert-parallel: this rank runs its own experts on the rows sent to it."""
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        ids, weights = self.gate(x)
        recv_x, recv_ids, handle = comm.moe.dispatch(x, ids, self.num_experts)
        dbo.yield_()  # let the other ubatch route while this one computes next
        out = torch.empty_like(recv_x)
        per_rank = self.num_experts // world
        for local in range(per_rank):
            rows = (recv_ids == local).nonzero().squeeze(1)
            out[rows] = self.expert(rank * per_rank + local, recv_x[rows])
        return comm.moe.combine(out, handle, weights) + x

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense, single process: every expert here, no communication."""
        ids, weights = self.gate(x)
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(TOPK):
                y[t] += weights[t, k] * self.expert(int(ids[t, k]), x[t : t + 1])[0]
        return y + x


def _check_moe_layer() -> dict[str, float]:
    rank, world, _ = comm.init_distributed(timeout_s=30)
    layer = _MoELayer(num_experts=EXPERTS_PER_RANK * world, seed=3)
    x = _tokens(rank, 9 + 3 * rank, seed=11)  # uneven token counts per rank

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        for _ in range(2):  # two layers
            tokens = layer.forward_parallel(tokens)
        return tokens

    reference = layer.forward_reference(layer.forward_reference(x))
    whole = forward(x)
    assert torch.allclose(whole, reference, rtol=1e-10, atol=1e-10), (whole - reference).abs().max()
    for num_ubatches in (2, 3):
        parts = torch.tensor_split(x, num_ubatches)
        serial = torch.cat([forward(part) for part in parts])
        overlapped = dbo.overlap(forward, num_ubatches=num_ubatches)(x)
        assert torch.allclose(serial, reference, rtol=1e-10, atol=1e-10)
        assert torch.equal(overlapped, serial), (
            f"{num_ubatches} ubatches: DBO differs from serial by "
            f"{(overlapped - serial).abs().max()}"
        )
    return {"max_error": float((whole - reference).abs().max())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_moe(world_size: int) -> None:
    """Both checks share one spawned world per world size."""

    values = expect_ok(run_world(_check_moe_both, world_size, timeout_s=90))
    for value in values:
        assert value["num_identity_layouts"] == 4
        assert value["max_error"] < 1e-10


def _check_moe_both() -> dict[str, float]:
    num_identity_layouts = _check_identity_round_trip()
    result = _check_moe_layer()
    result["num_identity_layouts"] = num_identity_layouts
    return result
