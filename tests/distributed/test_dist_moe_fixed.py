"""comm.moe.dispatch_fixed / combine_fixed across 2 and 4 real processes (gloo).

Each rank checks, for several layouts (a rank with no tokens, a rank whose experts
receive nothing, every token to one expert, -1 ids): the fixed path equals the dynamic
one bitwise when `capacity >= T`; with a small capacity the documented pairs are dropped
and counted on every rank and the receivers' counts match the senders'; no host read and
no split list; gradients equal the dynamic path's; DBO with 1-3 ubatches is bitwise the
serial run; an id out of range on one rank raises on every rank, none left waiting.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _spawn import expect_ok, run_world
from moe_fixed_checks import (
    HostReads,
    dynamic_round_trip,
    expert_scales,
    fixed_round_trip,
    kept_pairs,
)

import comm
import dbo

pytestmark = pytest.mark.distributed

EXPERTS_PER_RANK = 2
TOPK = 2


def _routing(rank: int, num_tokens: int, num_experts: int, seed: int, layout: str):
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(num_tokens, 5, generator=generator, dtype=torch.float64)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if layout == "last rank receives nothing":
        scores[:, -EXPERTS_PER_RANK:] = -1.0
    ids = scores.argsort(dim=1, descending=True)[:, :TOPK]
    if layout == "all to expert 1":
        ids[:, 0], ids[:, 1] = 1, -1
    if layout == "padding tokens":
        ids[::3] = -1
    weights = torch.rand(num_tokens, TOPK, generator=generator, dtype=torch.float64)
    return x, ids, weights


LAYOUTS = [
    ([5, 3, 8, 1], "random"),
    ([4, 0, 6, 2], "random"),  # rank 1 has no tokens at all
    ([6, 2, 3, 5], "last rank receives nothing"),
    ([7, 4, 2, 3], "all to expert 1"),
    ([6, 9, 3, 4], "padding tokens"),
]


def _check_fixed_path() -> dict[str, object]:
    rank, world, _ = comm.init_distributed(timeout_s=30)
    num_experts = EXPERTS_PER_RANK * world
    scales = expert_scales(EXPERTS_PER_RANK, rank)
    report: dict[str, object] = {"send_counts": [], "recv_counts": []}
    for seed, (tokens_per_rank, layout) in enumerate(LAYOUTS):
        x, ids, weights = _routing(rank, tokens_per_rank[rank], num_experts, seed, layout)
        capacity = max(tokens_per_rank)
        expected = dynamic_round_trip(x, ids.clamp(min=0), weights * (ids >= 0), num_experts,
                                      scales)
        with HostReads().counting() as reads:
            got = fixed_round_trip(x, ids, weights, num_experts, capacity, scales)
        assert reads.reads == 0 and reads.all_to_all_splits == [([], [])] * 3, layout
        assert torch.equal(got, expected), layout

        # A small capacity: the first pairs per (this rank, expert) in token order.
        recv_x, recv_counts, handle = comm.moe.dispatch_fixed(x, ids, num_experts, 2)
        kept = kept_pairs(ids, num_experts, 2)
        assert recv_x.shape == (EXPERTS_PER_RANK, world * 2, 5)
        assert int(handle.num_dropped) == int((ids >= 0).sum() - kept.sum()), layout
        y = comm.moe.combine_fixed(torch.tanh(recv_x) * scales.view(-1, 1, 1), handle, weights)
        all_scales = torch.arange(num_experts, dtype=torch.float64) + 1
        per_pair = torch.tanh(x).unsqueeze(1) * all_scales[ids.clamp(min=0)].unsqueeze(2)
        assert torch.allclose(y, (per_pair * (weights * kept).unsqueeze(2)).sum(dim=1)), layout
        sent = [min(2, int((ids == e).sum())) for e in range(num_experts)]
        report["send_counts"].append(sent)  # type: ignore[union-attr]
        report["recv_counts"].append(recv_counts.tolist())  # type: ignore[union-attr]
    _check_blocks_hold_each_sources_rows(rank, world, num_experts)
    _check_gradients(rank, num_experts, scales)
    _check_overlap(rank, num_experts, scales)
    _check_bad_id_raises_everywhere(rank, num_experts)
    return report


def _check_blocks_hold_each_sources_rows(rank: int, world: int, num_experts: int) -> None:
    """Block s of local expert e holds source rank s's rows for e in token order, then
    zeros: tokens carry (source rank, token index, 1) as their values."""
    num_tokens = 6
    _, ids, _ = _routing(rank, num_tokens, num_experts, 30, "random")
    x = torch.stack([torch.full((num_tokens,), float(rank)), torch.arange(num_tokens) * 1.0,
                     torch.ones(num_tokens)], dim=1)
    recv_x, recv_counts, _ = comm.moe.dispatch_fixed(x, ids, num_experts, num_tokens)
    everyone = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(everyone, ids)
    for local in range(EXPERTS_PER_RANK):
        expert = rank * EXPERTS_PER_RANK + local
        for source in range(world):
            block = recv_x[local, source * num_tokens : (source + 1) * num_tokens]
            tokens = (everyone[source] == expert).any(dim=1).nonzero().flatten()
            assert int(recv_counts[local, source]) == len(tokens)
            expected = torch.stack([torch.full((len(tokens),), float(source)),
                                    tokens * 1.0, torch.ones(len(tokens))], dim=1)
            assert torch.equal(block[: len(tokens)], expected), (local, source)
            assert not block[len(tokens):].any()


def _check_gradients(rank: int, num_experts: int, scales: torch.Tensor) -> None:
    x, ids, weights = _routing(rank, 6 + rank, num_experts, 20, "random")
    grads = []
    for fixed in (False, True):
        leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
        if fixed:
            y = fixed_round_trip(leaves[0], ids, leaves[1], num_experts, 10, scales)
        else:
            y = dynamic_round_trip(leaves[0], ids, leaves[1], num_experts, scales)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for dynamic_grad, fixed_grad in zip(*grads):
        assert torch.allclose(dynamic_grad, fixed_grad)


def _check_overlap(rank: int, num_experts: int, scales: torch.Tensor) -> None:
    x, ids, weights = _routing(rank, 7 + 2 * rank, num_experts, 21, "padding tokens")

    def layer(x_part: torch.Tensor, ids_part: torch.Tensor, w_part: torch.Tensor):
        for _ in range(2):
            x_part = fixed_round_trip(x_part, ids_part, w_part, num_experts, 3, scales, True)
        return x_part

    for num_ubatches in (1, 2, 3):
        parts = list(zip(*(torch.tensor_split(t, num_ubatches) for t in (x, ids, weights))))
        serial = torch.cat([layer(*part) for part in parts])
        runner = dbo.UBatchRunner(num_ubatches)
        overlapped = torch.cat(runner.run(layer, [(part, {}) for part in parts]))
        runner.close()
        assert torch.equal(overlapped, serial), num_ubatches


def _check_bad_id_raises_everywhere(rank: int, num_experts: int) -> None:
    x, ids, _ = _routing(rank, 4, num_experts, 22, "random")
    if rank == 1:
        ids[0, 0] = num_experts
    with pytest.raises(ValueError, match=r"the group's rank\(s\) \[1\] passed"):
        comm.moe.dispatch_fixed(x, ids, num_experts, 4)
    dist.barrier()  # every rank got here: nobody waits in a collective


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fixed_path(world_size: int) -> None:
    reports = expect_ok(run_world(_check_fixed_path, world_size, timeout_s=120))
    # What rank r received from rank s for its expert e is what s counted for r's e.
    for case in range(len(LAYOUTS)):
        for receiver, report in enumerate(reports):
            recv = report["recv_counts"][case]
            for local in range(EXPERTS_PER_RANK):
                expert = receiver * EXPERTS_PER_RANK + local
                sent = [reports[s]["send_counts"][case][expert] for s in range(world_size)]
                assert recv[local] == sent, (case, receiver, local)
