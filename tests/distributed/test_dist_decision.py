"""Ranks with different batch sizes take the same overlap-or-inline decision.

Without agreement, a rank that runs inline issues one collective per layer while a rank
that overlaps issues one per ubatch per layer: the collectives mismatch and the job
hangs. `dbo.overlap(..., decision_group=...)` all-reduces the batch sizes first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _spawn import expect_ok, run_world

import comm
import dbo

pytestmark = pytest.mark.distributed


def _decide_in_world() -> dict[str, list[object]]:
    rank, world, _ = comm.init_distributed(timeout_s=30)
    seen: list[bool] = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        seen.append(dbo.enabled())
        total = torch.tensor([float(x.shape[0])])
        comm.all_reduce(total)  # one collective per call of `layer`
        return x + total

    outcomes: dict[str, list[object]] = {}
    cases = {
        # name: (batch on rank 0, batch on the others, min_batch_size)
        "one rank below min_batch_size": (2, 8, 4),
        "one rank below num_ubatches": (1, 8, None),
        "every rank large enough": (8, 6, 4),
    }
    for name, (batch_rank0, batch_others, min_batch_size) in cases.items():
        seen.clear()
        batch = batch_rank0 if rank == 0 else batch_others
        step = dbo.overlap(
            layer, min_batch_size=min_batch_size, decision_group=dist.group.WORLD, timeout_s=20
        )
        out = step(torch.zeros(batch, 2))
        outcomes[name] = [list(seen), out.shape[0]]
    return outcomes


@pytest.mark.timeout(90)
def test_ranks_agree_on_overlap_or_inline() -> None:
    values = expect_ok(run_world(_decide_in_world, 2, timeout_s=60))
    for rank, outcome in enumerate(values):
        assert outcome["one rank below min_batch_size"][0] == [False], (rank, outcome)
        assert outcome["one rank below num_ubatches"][0] == [False], (rank, outcome)
        assert outcome["every rank large enough"][0] == [True, True], (rank, outcome)
        expected_rows = {0: (2, 1, 8), 1: (8, 8, 6)}[rank]
        assert tuple(o[1] for o in outcome.values()) == expected_rows


def _one_rank_cannot_size_or_split_its_input(failing_split: bool) -> dict[str, object]:
    rank, _, _ = comm.init_distributed(timeout_s=60)  # a hang would outlast the test
    calls: list[int] = []

    def layer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        comm.all_reduce(x)
        return x + y

    def split(args: tuple, kwargs: dict, num_ubatches: int) -> list:
        if rank == 0:
            raise ValueError("rank 0's split fails")
        return dbo.default_split(args, kwargs, num_ubatches)

    step = dbo.overlap(layer, decision_group=dist.group.WORLD, timeout_s=20,
                       split=split if failing_split else None)
    # Rank 0's tensors disagree on dim 0 (it cannot split them), or its split= raises.
    y = torch.zeros(3 if rank == 0 and not failing_split else 4, 2)
    try:
        step(torch.zeros(4, 2), y)
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcome: dict[str, object] = {"error": type(error).__name__, "message": str(error)}
    else:
        outcome = {"error": None}
    outcome["calls"] = len(calls)
    # The group is still usable: nobody was left inside a collective.
    ones = torch.ones(1)
    dist.all_reduce(ones)
    outcome["after"] = float(ones.item())
    return outcome


@pytest.mark.timeout(90)
@pytest.mark.parametrize("failing_split", [False, True])
def test_a_rank_that_cannot_size_or_split_its_input_makes_every_rank_raise_not_wait(
    failing_split: bool,
) -> None:
    values = expect_ok(run_world(_one_rank_cannot_size_or_split_its_input, 2,
                                 args=(failing_split,), timeout_s=45))
    assert values[0]["error"] == "ValueError", values[0]
    assert values[1]["error"] == "RuntimeError", values[1]
    assert "another rank of decision_group could not size or split its input" in str(
        values[1]["message"]
    )
    for value in values:
        assert value["calls"] == 0, value
        assert value["after"] == 2.0, value


def _a_mode_on_one_rank_only() -> dict[str, object]:
    """Rank 0 counts FLOPs around the call (a dispatch mode: the call must run inline
    there), rank 1 does not: with decision_group both must go inline together, or one
    rank's in-`fn` collective pairs with the other's decision all-reduce."""
    from torch.utils.flop_counter import FlopCounterMode

    rank, _, _ = comm.init_distributed(timeout_s=30)
    seen: list[bool] = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        seen.append(dbo.enabled())
        total = torch.tensor([float(x.shape[0])])
        comm.all_reduce(total)
        return x + total

    step = dbo.overlap(layer, decision_group=dist.group.WORLD, timeout_s=20)
    if rank == 0:
        with FlopCounterMode(display=False):
            out = step(torch.zeros(8, 2))
    else:
        out = step(torch.zeros(8, 2))
    return {"seen": list(seen), "out": float(out[0, 0])}


@pytest.mark.timeout(90)
def test_a_mode_on_one_rank_sends_every_rank_inline() -> None:
    values = expect_ok(run_world(_a_mode_on_one_rank_only, 2, timeout_s=45))
    for rank, value in enumerate(values):
        assert value["seen"] == [False], (rank, value)  # one inline call on every rank
        assert value["out"] == 16.0, (rank, value)  # 8 rows on each of the 2 ranks
