"""comm.moe dispatch/combine in one process (a world of 1): routing, weighting, checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm
import dbo


def test_dispatch_groups_rows_by_expert_and_combine_weights_them(world_of_one: None) -> None:
    x = torch.arange(12.0).reshape(4, 3)
    topk_ids = torch.tensor([[2, 0], [1, 2], [0, 0], [3, 1]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2], [3.0, 0.0]])
    recv_x, recv_ids, handle = comm.moe.dispatch(x, topk_ids, num_experts=4)
    # Rows sorted by expert id, (token, k) order kept within an expert.
    assert recv_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 3]
    assert torch.equal(recv_x, x[[0, 2, 2, 1, 3, 0, 1, 3]])
    assert handle.num_recv_tokens == 8 and handle.send_splits == (8,)
    assert handle.num_recv_tokens_per_expert.tolist() == [[3, 2, 2, 1]]
    assert handle.rows_per_local_expert == (3, 2, 2, 1)
    # Expert e multiplies by (e + 1): y[t] = sum_k w[t, k] * (id[t, k] + 1) * x[t].
    expert_out = recv_x * (recv_ids + 1).unsqueeze(1).to(recv_x.dtype)
    y = comm.moe.combine(expert_out, handle, weights)
    factor = (weights * (topk_ids + 1).to(weights.dtype)).sum(dim=1, keepdim=True)
    assert torch.allclose(y, x * factor)
    assert y.dtype == x.dtype


def test_no_tokens_and_other_hidden_sizes(world_of_one: None) -> None:
    recv_x, recv_ids, handle = comm.moe.dispatch(
        torch.empty(0, 5), torch.empty(0, 2, dtype=torch.int32), num_experts=3
    )
    assert recv_x.shape == (0, 5) and recv_ids.shape == (0,)
    y = comm.moe.combine(torch.empty(0, 7), handle, torch.empty(0, 2))
    assert y.shape == (0, 7)
    # Expert output wider than the input: combine follows expert_out's width.
    x = torch.randn(3, 2)
    ids = torch.tensor([[1], [0], [1]], dtype=torch.int16)
    recv_x, _, handle = comm.moe.dispatch(x, ids, num_experts=2)
    y = comm.moe.combine(torch.cat([recv_x, recv_x], dim=1), handle, torch.ones(3, 1))
    assert torch.equal(y, torch.cat([x, x], dim=1))


def test_inside_an_overlap_equals_serial(world_of_one: None) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=generator)
    ids = torch.randint(0, 6, (10, 2), generator=generator)
    weights = torch.rand(10, 2, generator=generator)

    def round_trip(x_part: torch.Tensor, ids_part: torch.Tensor, w_part: torch.Tensor):
        recv_x, recv_ids, handle = comm.moe.dispatch(x_part, ids_part, 6)
        return comm.moe.combine(torch.tanh(recv_x) * (recv_ids + 1).unsqueeze(1), handle, w_part)

    parts = list(zip(*(torch.tensor_split(t, 2) for t in (x, ids, weights))))
    serial = torch.cat([round_trip(*part) for part in parts])
    overlapped = dbo.overlap(round_trip)(x, ids, weights)
    assert torch.equal(overlapped, serial)
    reference = (torch.tanh(x).unsqueeze(1) * (ids + 1).unsqueeze(2) * weights.unsqueeze(2)).sum(1)
    assert torch.allclose(serial, reference, atol=1e-6)


def _bad_dispatch_calls() -> list[tuple[Any, type, str]]:
    x = torch.randn(4, 3)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    return [
        (lambda: comm.moe.dispatch(x, ids.float(), 4), TypeError, "integer tensor"),
        (lambda: comm.moe.dispatch(x, ids.bool(), 4), TypeError, "integer tensor"),
        (lambda: comm.moe.dispatch(x, ids[:3], 4), ValueError, "num_tokens = x.shape"),
        (lambda: comm.moe.dispatch(x, ids[:, :0], 4), ValueError, "k >= 1"),
        (lambda: comm.moe.dispatch(x[0], ids, 4), ValueError, r"\[num_tokens, hidden\]"),
        (lambda: comm.moe.dispatch(x, ids.to("meta"), 4), ValueError, "same device"),
        (lambda: comm.moe.dispatch(x, ids, 0), ValueError, ">= 1"),
        (lambda: comm.moe.dispatch(x, ids, 4.0), TypeError, "num_experts must be an int"),
        (lambda: comm.moe.dispatch(x, ids, True), ValueError, "num_experts"),
        (lambda: comm.moe.dispatch(x.tolist(), ids, 4), TypeError, "x must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_dispatch_calls())))
def test_bad_dispatch_raises_before_any_collective(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    launched: list[Any] = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: launched.append(a))
    call, error, text = _bad_dispatch_calls()[index]
    with pytest.raises(error, match=text):
        call()
    assert launched == []


@pytest.mark.parametrize("bad_id", [4, -1])
def test_an_expert_id_out_of_range_raises_after_the_counts_exchange_only(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, bad_id: int
) -> None:
    launched: list[Any] = []
    real = dist.all_to_all_single
    monkeypatch.setattr(
        dist, "all_to_all_single", lambda *a, **k: launched.append(a) or real(*a, **k)
    )
    ids = torch.tensor([[0, 1], [2, bad_id]])
    with pytest.raises(ValueError, match=r"\[0, 4\); the group's rank\(s\) \[0\] passed"):
        comm.moe.dispatch(torch.randn(2, 3), ids, 4)
    # The counts exchange carries every rank's flag, so every rank raises before the rows.
    assert len(launched) == 1


def test_bad_combine_raises_before_any_collective(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4, 3)
    recv_x, _, handle = comm.moe.dispatch(x, torch.zeros(4, 2, dtype=torch.int64), 2)
    weights = torch.ones(4, 2)
    launched: list[Any] = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: launched.append(a))
    cases = [
        (lambda: comm.moe.combine(recv_x[:7], handle, weights), ValueError,
         r"expert_out must be \[num_recv_tokens, hidden\] = \[8, hidden\]"),
        (lambda: comm.moe.combine(recv_x, handle, weights[:, :1]), ValueError, r"\[4, 2\]"),
        (lambda: comm.moe.combine(recv_x, handle, weights.long()), TypeError, "floating"),
        (lambda: comm.moe.combine(recv_x, "handle", weights), TypeError, "DispatchHandle"),
        (lambda: comm.moe.combine(recv_x, handle, weights.to("meta")), ValueError, "same device"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text):
            call()
    assert launched == []


def test_num_experts_must_divide_over_the_ranks() -> None:
    # A world of 1 divides everything: check the rule dispatch applies for 4 ranks.
    from comm.moe._exchange import check_dispatch

    x, topk_ids = torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by the group size 4"):
        check_dispatch(x, topk_ids, 6, 4)
    assert check_dispatch(x, topk_ids, 8, 4)[2] == 8


def test_dispatch_refuses_a_cuda_graph_capture_and_names_the_fixed_shape_path(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[Any] = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="comm.moe.dispatch cannot be captured.*dispatch_fixed"):
        comm.moe.dispatch(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.int64), 2)
    assert launched == []
