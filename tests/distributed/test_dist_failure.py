"""Failures across real processes: one rank raises, the others error out, nobody hangs;
bad arguments raise before any collective, so every rank can carry on.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from _spawn import expect_ok, run_world, start_together, tell, wait_for

import comm
import dbo

pytestmark = pytest.mark.distributed


class InjectedFailure(RuntimeError):
    """The error one rank raises on purpose."""


def _overlapped_forward(failing_rank: int, fail_at_step: int | None):
    rank = torch.distributed.get_rank()
    weight = torch.eye(8) * 0.5

    def forward(x: torch.Tensor) -> torch.Tensor:
        for step in range(10):
            x = torch.tanh(x @ weight)
            if (
                step == fail_at_step
                and rank == failing_rank
                and dbo.current_ubatch_id() == 1
            ):
                raise InjectedFailure(f"rank {rank} fails on purpose at step {step}")
            out = torch.empty_like(x)
            comm.all_to_all_single(out, x)
            x = out
        return x

    return dbo.overlap(forward)


def _fail_one_rank(failing_rank: int, timeout_s: float, hold: bool) -> dict[str, object]:
    """Run a good forward, then one where `failing_rank` raises inside ubatch 1.

    With `hold`, the failing rank stays alive after its error until every other rank has
    raised (so they can only learn about it from the group's timeout), then returns; the
    others return when their forward raised. Returns what happened, with wall-clock times
    (one machine).
    """
    start_together()  # the short timeout also bounds the rendezvous
    rank, world, _ = comm.init_distributed(timeout_s=timeout_s)
    x = torch.randn(4 * world, 8)
    _overlapped_forward(failing_rank, None)(x)  # warm: all connections are up
    torch.distributed.barrier()
    started = time.time()
    try:
        _overlapped_forward(failing_rank, 2)(x)
    except Exception as error:
        raised_at = time.time()
        if rank != failing_rank:
            tell(f"rank {rank} raised")
        elif hold:
            for other in range(world):
                if other != rank:
                    wait_for(f"rank {other} raised", timeout_s=30)
        return {
            "rank": rank,
            "error_type": type(error).__name__,
            "message": str(error)[:300],
            "started": started,
            "raised_at": raised_at,
        }
    return {"rank": rank, "error_type": None, "started": started, "raised_at": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world_size", "hold"),
    [(2, False), (3, True)],
    ids=["failing-rank-exits", "failing-rank-stays-alive"],
)
def test_one_rank_raises_inside_overlap_every_rank_errors(world_size: int, hold: bool) -> None:
    timeout_s = 2.0
    failing_rank = 1
    results = run_world(
        _fail_one_rank, world_size, args=(failing_rank, timeout_s, hold), timeout_s=60
    )
    values = expect_ok(results)  # each rank returned its record (none hung or crashed)
    assert all(r.exited for r in results), [(r.rank, r.exit_code) for r in results]
    failed = values[failing_rank]
    assert failed["error_type"] == "InjectedFailure", failed
    for value in values:
        if value["rank"] == failing_rank:
            continue
        assert value["error_type"] is not None, f"rank {value['rank']} did not see the failure"
        assert "fails on purpose" not in value["message"]
        waited = value["raised_at"] - failed["raised_at"]
        # The group's timeout bounds the wait (slack: 2 loaded CPU cores).
        assert waited < timeout_s + 4.0, (value, failed)
        if hold:
            # Still alive, the failing rank cannot close connections: only the timeout
            # ends the wait, so it took about timeout_s.
            assert waited > 0.5 * timeout_s, (value, failed)


# --------------------------------------------------------------------------- bad input
def _bad_calls(world: int) -> list[tuple[str, object]]:
    """(name, thunk) of calls that must raise before launching anything."""
    x = torch.randn(6, 4)
    ids = torch.zeros(6, 2, dtype=torch.int64)
    weights = torch.ones(6, 2)
    out = torch.empty(6, 4)
    num_experts = 2 * world
    _, _, handle = comm.moe.dispatch(x, ids, num_experts)  # a good one, for combine
    return [
        ("splits not summing to dim 0", lambda: comm.all_to_all_single(
            out, x, [3] + [0] * (world - 1), [2] + [0] * (world - 1))),
        ("one split per rank", lambda: comm.all_to_all_single(out, x, [6], [6])),
        ("negative split", lambda: comm.all_to_all_single(
            out, x, [7, -1] + [0] * (world - 2), [6] + [0] * (world - 1))),
        ("uneven without splits", lambda: comm.all_to_all_single(
            torch.empty(5, 4), torch.empty(5, 4))),
        ("dtype mismatch", lambda: comm.all_to_all_single(out.double(), x)),
        ("device mismatch", lambda: comm.all_to_all_single(out.to("meta"), x)),
        ("gather size", lambda: comm.all_gather_into_tensor(torch.empty(5), torch.empty(2))),
        ("scatter dtype", lambda: comm.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.int64), torch.empty(2 * world))),
        ("not a tensor", lambda: comm.all_reduce([1.0, 2.0])),
        ("topk_ids out of range", lambda: comm.moe.dispatch(x, ids + num_experts, num_experts)),
        ("negative topk_ids", lambda: comm.moe.dispatch(x, ids - 1, num_experts)),
        ("float topk_ids", lambda: comm.moe.dispatch(x, ids.float(), num_experts)),
        ("num_experts not divisible", lambda: comm.moe.dispatch(x, ids, 2 * world + 1)),
        ("topk rows", lambda: comm.moe.dispatch(x, ids[:5], num_experts)),
        ("combine weights shape", lambda: comm.moe.combine(
            torch.empty(handle.num_recv_tokens, 4), handle, weights[:, :1])),
        ("combine rows", lambda: comm.moe.combine(
            torch.empty(handle.num_recv_tokens + 1, 4), handle, weights)),
    ]


def _check_bad_input() -> list[tuple[str, str, str]]:
    """Every rank makes the same bad calls, outside and inside an overlap; after each, a
    good all_reduce must give the right sum (a launched half-call would break it)."""
    start_together()
    rank, world, _ = comm.init_distributed(timeout_s=10)
    seen = []
    for inside in (False, True):
        for name, call in _bad_calls(world):
            def attempt(_: torch.Tensor, call=call) -> torch.Tensor:
                call()
                return torch.zeros(1)

            try:
                if inside:
                    dbo.overlap(attempt)(torch.zeros(2))
                else:
                    attempt(torch.zeros(2))
            except (TypeError, ValueError) as error:
                seen.append((name, type(error).__name__, str(error)))
            else:
                raise AssertionError(f"{name}: no error (inside={inside})")
            total = torch.tensor([float(rank + 1)])
            comm.all_reduce(total)
            assert total.item() == world * (world + 1) / 2, (name, total)
    return seen


@pytest.mark.timeout(90)
def test_bad_input_raises_before_any_collective() -> None:
    values = expect_ok(run_world(_check_bad_input, 2, timeout_s=60))
    for seen in values:
        names = [name for name, _, _ in seen]
        assert len(names) == 2 * len(set(names)) == 32, names
        kinds = {name: kind for name, kind, _ in seen}
        assert kinds["dtype mismatch"] == "TypeError"
        assert kinds["float topk_ids"] == "TypeError"
        assert kinds["splits not summing to dim 0"] == "ValueError"
        assert kinds["topk_ids out of range"] == "ValueError"
        assert kinds["num_experts not divisible"] == "ValueError"
        messages = {name: message for name, _, message in seen}
        assert "sums to 3" in messages["splits not summing to dim 0"]
        # Raised on every rank after the counts exchange, which carries every rank's flag.
        assert "rank(s) [0, 1] passed" in messages["topk_ids out of range"], messages
        assert "divisible" in messages["num_experts not divisible"]


# --------------------------------------------------------------------------- the harness
def _hang_on_rank_one(pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}.pid"), "w") as file:
        file.write(str(os.getpid()))
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return 0


@pytest.mark.timeout(60)
def test_spawn_helper_kills_a_world_that_hangs(tmp_path: Any) -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not report"):
        run_world(_hang_on_rank_one, 2, args=(str(tmp_path),), timeout_s=6)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (killed and reaped by run_world)
