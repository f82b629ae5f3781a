"""comm.moe.dispatch_fixed / combine_fixed in one process (a world of 1): the layout,
drops and -1 ids, agreement with the dynamic path, no host reads, backward, DBO."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from moe_fixed_checks import (
    HostReads,
    dynamic_round_trip,
    expert_scales,
    fixed_round_trip,
    kept_pairs,
)

import comm
import dbo

pytestmark = pytest.mark.usefixtures("world_of_one")


def _case(num_tokens: int, num_experts: int, topk: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 6, generator=generator, dtype=torch.float64)
    ids = torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=generator, dtype=torch.float64)
    return x, ids, weights


def test_rows_land_in_expert_blocks_in_token_order_with_zero_padding() -> None:
    x = torch.arange(8.0).reshape(4, 2)
    ids = torch.tensor([[2, 0], [0, -1], [2, 1], [0, 2]])
    recv_x, recv_counts, handle = comm.moe.dispatch_fixed(x, ids, 3, capacity=4)
    assert recv_x.shape == (3, 4, 2) and recv_counts.tolist() == [[3], [1], [3]]
    assert torch.equal(recv_x[0], torch.stack([x[0], x[1], x[3], torch.zeros(2)]))
    assert torch.equal(recv_x[1], torch.stack([x[2], *torch.zeros(3, 2)]))
    assert torch.equal(recv_x[2], torch.stack([x[0], x[2], x[3], torch.zeros(2)]))
    assert int(handle.num_dropped) == 0


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "topk", "seed"),
    [(9, 4, 2, 0), (16, 8, 3, 1), (1, 2, 2, 2), (0, 4, 2, 3), (12, 6, 1, 4)],
)
def test_with_capacity_at_least_T_it_equals_the_dynamic_path_bitwise(
    num_tokens: int, num_experts: int, topk: int, seed: int
) -> None:
    x, ids, weights = _case(num_tokens, num_experts, topk, seed)
    scales = expert_scales(num_experts, 0)
    expected = dynamic_round_trip(x, ids, weights, num_experts, scales)
    for capacity in (max(num_tokens, 1), num_tokens + 5):
        got = fixed_round_trip(x, ids, weights, num_experts, capacity, scales)
        assert torch.equal(got, expected)


def test_every_token_to_one_expert_and_experts_that_receive_nothing() -> None:
    x, _, weights = _case(10, 4, 1, 5)
    ids = torch.full((10, 1), 2)
    scales = expert_scales(4, 0)
    recv_x, recv_counts, _ = comm.moe.dispatch_fixed(x, ids, 4, capacity=10)
    assert recv_counts.flatten().tolist() == [0, 0, 10, 0]
    assert torch.equal(recv_x[2], x) and not recv_x[[0, 1, 3]].any()
    expected = dynamic_round_trip(x, ids, weights, 4, scales)
    assert torch.equal(fixed_round_trip(x, ids, weights, 4, 10, scales), expected)


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_a_small_capacity_drops_exactly_the_later_pairs_and_counts_them(capacity: int) -> None:
    x, ids, weights = _case(12, 4, 2, 6)
    ids[3, 1] = -1  # a "no expert" pair: neither sent nor counted as dropped
    scales = expert_scales(4, 0)
    kept = kept_pairs(ids, 4, capacity)
    recv_x, recv_counts, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity)
    assert int(handle.num_dropped) == int((ids >= 0).sum() - kept.sum())
    assert recv_counts.flatten().tolist() == [
        min(capacity, int((ids == e).sum())) for e in range(4)
    ]
    got = fixed_round_trip(x, ids, weights, 4, capacity, scales)
    reference = torch.tanh(x).unsqueeze(1) * scales[ids.clamp(min=0)].unsqueeze(2)
    expected = (reference * (weights * kept).unsqueeze(2)).sum(dim=1)
    assert torch.allclose(got, expected)


def test_minus_one_ids_and_padding_rows_never_reach_the_output() -> None:
    x, ids, weights = _case(6, 4, 2, 7)
    ids[1] = -1
    weights[1] = float("inf")  # a padding token's weights may be anything
    recv_x, _, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity=6)
    expert_out = recv_x.clone()
    counts = handle.recv_counts[:, 0]
    for expert in range(4):
        expert_out[expert, int(counts[expert]):] = float("nan")
    y = comm.moe.combine_fixed(expert_out, handle, weights)
    assert torch.equal(y[1], torch.zeros(6)) and not y.isnan().any()
    assert int(handle.num_dropped) == 0
    keep = ids >= 0
    expected = (x.unsqueeze(1) * (weights * keep).nan_to_num(0).unsqueeze(2)).sum(dim=1)
    assert torch.allclose(y, expected)


def test_an_id_out_of_range_raises_with_check_ids_and_is_dropped_without() -> None:
    x, ids, weights = _case(4, 4, 2, 8)
    ids[2, 0] = 4
    with pytest.raises(ValueError, match=r"\[-1, 4\); the group's rank\(s\) \[0\] passed"):
        comm.moe.dispatch_fixed(x, ids, 4, capacity=4)
    ids[1, 1] = -2
    _, _, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity=4, check_ids=False)
    assert int(handle.num_dropped) == 2


def _bad_calls() -> list[tuple[Any, type, str]]:
    x, ids, weights = _case(4, 4, 2, 9)
    fixed = comm.moe.dispatch_fixed
    return [
        (lambda: fixed(x, ids, 4, 0), ValueError, "capacity must be an int >= 1"),
        (lambda: fixed(x, ids, 4, 2.0), TypeError, "capacity must be an int"),
        (lambda: fixed(x, ids, 4, True), ValueError, "capacity"),
        (lambda: fixed(x, ids.float(), 4, 2), TypeError, "integer tensor"),
        (lambda: fixed(x, ids[:3], 4, 2), ValueError, "num_tokens = x.shape"),
        (lambda: fixed(x[0], ids, 4, 2), ValueError, r"\[num_tokens, hidden\]"),
        (lambda: fixed(x, ids.to("meta"), 4, 2), ValueError, "same device"),
        (lambda: fixed(x, ids, 0, 2), ValueError, "num_experts must be an int >= 1"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_dispatch_fixed_raises_before_any_collective(
    monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    launched: list[Any] = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: launched.append(a))
    call, error, text = _bad_calls()[index]
    with pytest.raises(error, match=text):
        call()
    assert launched == []


def test_bad_combine_fixed_raises_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    x, ids, weights = _case(4, 4, 2, 10)
    recv_x, _, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity=3)
    _, _, dynamic_handle = comm.moe.dispatch(x, ids, 4)
    launched: list[Any] = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: launched.append(a))
    combine = comm.moe.combine_fixed
    cases = [
        (lambda: combine(recv_x[:, :2], handle, weights), ValueError, r"\[4, 3, hidden\]"),
        (lambda: combine(recv_x[0], handle, weights), ValueError, "recv_x's layout"),
        (lambda: combine(recv_x, handle, weights[:, :1]), ValueError, r"\[4, 2\]"),
        (lambda: combine(recv_x, handle, weights.long()), TypeError, "floating"),
        (lambda: combine(recv_x, dynamic_handle, weights), TypeError, "FixedDispatchHandle"),
        (lambda: combine(recv_x, handle, weights.to("meta")), ValueError, "same device"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text):
            call()
    assert launched == []


def test_the_fixed_path_reads_nothing_on_the_host_and_passes_no_split_lists() -> None:
    shapes = set()
    for seed, over_capacity in ((11, False), (12, True)):
        x, ids, weights = _case(8, 4, 2, seed)
        if over_capacity:
            ids[:] = 1  # everything to one expert, over capacity
        with HostReads().counting() as reads:
            recv_x, recv_counts, handle = comm.moe.dispatch_fixed(
                x, ids, 4, capacity=3, check_ids=False
            )
            comm.moe.combine_fixed(recv_x * 2, handle, weights)
        assert reads.reads == 0
        assert reads.all_to_all_splits == [([], [])] * 3  # counts, rows, rows back
        shapes.add((tuple(recv_x.shape), tuple(recv_counts.shape)))
    assert shapes == {((4, 3, 6), (4, 1))}  # T, K, capacity and W alone set the shapes
    # The id check is the one read; the dynamic path reads once per dispatch.
    with HostReads().counting() as reads:
        comm.moe.dispatch_fixed(x, ids, 4, capacity=3)
    assert reads.reads == 1
    with HostReads().counting() as reads:
        comm.moe.dispatch(x, ids, 4)
    assert reads.reads == 1


def test_gradients_equal_the_dynamic_paths() -> None:
    x, ids, weights = _case(10, 4, 2, 13)
    scales = expert_scales(4, 0)
    grads = []
    for round_trip in (
        lambda *a: dynamic_round_trip(*a, 4, scales),
        lambda *a: fixed_round_trip(*a, 4, 10, scales),
    ):
        leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
        y = round_trip(leaves[0], ids, leaves[1])
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for dynamic_grad, fixed_grad in zip(*grads):
        assert torch.allclose(dynamic_grad, fixed_grad)


def test_only_the_experts_training_still_gives_them_gradients() -> None:
    x, ids, weights = _case(6, 4, 2, 14)
    scale = torch.ones(4, 1, 1, dtype=torch.float64, requires_grad=True)
    recv_x, _, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity=6)
    comm.moe.combine_fixed(recv_x * scale, handle, weights).sum().backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0
    with torch.no_grad():
        recv_x, _, handle = comm.moe.dispatch_fixed(x, ids, 4, capacity=6)
        assert not comm.moe.combine_fixed(recv_x, handle, weights).requires_grad


@pytest.mark.parametrize("num_ubatches", [1, 2, 3])
def test_inside_an_overlap_it_is_bitwise_the_serial_run(num_ubatches: int) -> None:
    x, ids, weights = _case(11, 4, 2, 15)
    ids[4] = -1
    scales = expert_scales(4, 0)

    def layer(x_part: torch.Tensor, ids_part: torch.Tensor, w_part: torch.Tensor):
        return fixed_round_trip(x_part, ids_part, w_part, 4, 3, scales, check_ids=True)

    parts = list(zip(*(torch.tensor_split(t, num_ubatches) for t in (x, ids, weights))))
    serial = torch.cat([layer(*part) for part in parts])
    assert torch.equal(dbo.overlap(layer, num_ubatches=num_ubatches)(x, ids, weights), serial)


def test_training_through_an_overlap_gives_the_serial_gradients() -> None:
    x, ids, weights = _case(10, 4, 2, 16)
    ids[2] = -1
    expert_weights = torch.randn(4, 6, 6, dtype=torch.float64)
    grads = []
    for overlapped in (False, True):
        weight = expert_weights.clone().requires_grad_()
        tokens = x.clone().requires_grad_()

        def layer(x_part, ids_part, w_part, weight=weight):
            recv_x, _, handle = comm.moe.dispatch_fixed(x_part, ids_part, 4, 6, check_ids=False)
            expert_out = torch.tanh(torch.bmm(recv_x, weight)).clone()
            expert_out[:, -1] = float("nan")  # row 5 of 5 tokens: padding in every block
            return comm.moe.combine_fixed(expert_out, handle, w_part)

        if overlapped:
            out = dbo.overlap(layer)(tokens, ids, weights)
        else:
            parts = zip(*(t.tensor_split(2) for t in (tokens, ids, weights)))
            out = torch.cat([layer(*part) for part in parts])
        (out * out).sum().backward()
        grads.append((tokens.grad, weight.grad))
    assert not any(grad.isnan().any() for grad in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_bad_id_in_one_ubatch_raises_from_the_overlap() -> None:
    x, ids, weights = _case(8, 4, 2, 17)
    ids[6, 1] = 9  # in ubatch 1's half

    def layer(x_part, ids_part, w_part):
        return fixed_round_trip(x_part, ids_part, w_part, 4, 4, expert_scales(4, 0), True)

    with pytest.raises(ValueError, match=r"\[-1, 4\); the group's rank\(s\) \[0\]"):
        dbo.overlap(layer, timeout_s=30)(x, ids, weights)
