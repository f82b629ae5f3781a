"""comm collectives across real processes: inside dbo.overlap == the same calls outside;
a failed collective's handle raises at every wait; argument checks keep ranks in step.

One spawned world per world size runs every check (2 and 3 ubatches, all four
collectives, blocking and async, uneven and zero-size all-to-all splits); each rank
compares the overlapped results with the serial ones *and* with values computed
locally from how the inputs were built, so a collective that is wrong the same way in
both runs still fails.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from _spawn import expect_ok, run_world, start_together, tell, wait_for

import comm
import dbo

pytestmark = pytest.mark.distributed

COLUMNS = 3


def _rows(source: int, dest: int, ubatch_id: int, case: int) -> int:
    """Rows `source` sends to `dest` in all-to-all case `case`, by ubatch (0 happens)."""
    if case == 0:  # uneven, with zeros
        return (source * 3 + dest * 2 + ubatch_id) % 4
    if case == 1:  # rank 0 sends nothing at all, rank 1 receives nothing at all
        return 0 if source == 0 or dest == 1 else source + dest + ubatch_id
    return 0  # case 2: nothing moves anywhere


def _value(source: int, dest: int, ubatch_id: int, row: int) -> float:
    return float(source * 10_000 + dest * 1000 + ubatch_id * 100 + row)


def _collective_step(ubatch_tag: torch.Tensor, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every collective once, for the ubatch named by `ubatch_tag` ([1], its id)."""
    ubatch_id = int(ubatch_tag[0])
    results: dict[str, torch.Tensor] = {}
    for case in range(3):
        input_splits = [_rows(rank, dest, ubatch_id, case) for dest in range(world)]
        output_splits = [_rows(source, rank, ubatch_id, case) for source in range(world)]
        send = torch.tensor(
            [
                [_value(rank, dest, ubatch_id, row) + column / 10 for column in range(COLUMNS)]
                for dest in range(world)
                for row in range(input_splits[dest])
            ]
        ).reshape(-1, COLUMNS)
        received = torch.full((sum(output_splits), COLUMNS), -1.0)
        comm.all_to_all_single(received, send, output_splits, input_splits)
        results[f"a2a_case{case}"] = received

    equal_send = torch.arange(world * 2 * COLUMNS, dtype=torch.float64).reshape(-1, COLUMNS)
    equal_send += 1000 * rank + 100 * ubatch_id
    equal_received = torch.empty_like(equal_send)
    comm.all_to_all_single(equal_received, equal_send)
    results["a2a_equal"] = equal_received

    summed = torch.arange(5, dtype=torch.float32) + rank + ubatch_id
    comm.all_reduce(summed)
    results["all_reduce_sum"] = summed
    maximum = torch.tensor([rank * (ubatch_id + 1)], dtype=torch.int64)
    comm.all_reduce(maximum, op=comm.ReduceOp.MAX)
    results["all_reduce_max"] = maximum

    gathered = torch.empty(world * 2, 4)
    comm.all_gather_into_tensor(gathered, torch.full((2, 4), float(rank * 10 + ubatch_id)))
    results["all_gather"] = gathered

    scattered = torch.empty(3)
    scatter_input = torch.arange(world * 3, dtype=torch.float32) * (rank + 1) + ubatch_id
    comm.reduce_scatter_tensor(scattered, scatter_input)
    results["reduce_scatter"] = scattered

    # Async: launch, compute something of our own, then the DBO-aware wait.
    async_out = torch.empty(world, 2)
    work = comm.all_to_all_single(
        async_out, torch.full((world, 2), float(rank + 10 * ubatch_id)), async_op=True
    )
    assert work is not None, "async_op=True returns a handle"
    results["own_compute"] = torch.ones(4, 4) @ torch.ones(4, 4)
    work.wait()
    work.wait()  # idempotent
    results["a2a_async"] = async_out
    return results


def _expected(rank: int, world: int, ubatch_id: int) -> dict[str, torch.Tensor]:
    """What `_collective_step` must return, computed without communication."""
    expected: dict[str, torch.Tensor] = {}
    for case in range(3):
        rows = [
            [_value(source, rank, ubatch_id, row) + column / 10 for column in range(COLUMNS)]
            for source in range(world)
            for row in range(_rows(source, rank, ubatch_id, case))
        ]
        expected[f"a2a_case{case}"] = torch.tensor(rows).reshape(-1, COLUMNS)
    chunks = []
    for source in range(world):
        base = torch.arange(world * 2 * COLUMNS, dtype=torch.float64).reshape(-1, COLUMNS)
        base += 1000 * source + 100 * ubatch_id
        chunks.append(base[rank * 2 : rank * 2 + 2])
    expected["a2a_equal"] = torch.cat(chunks)
    expected["all_reduce_sum"] = sum(
        torch.arange(5, dtype=torch.float32) + source + ubatch_id for source in range(world)
    )
    expected["all_reduce_max"] = torch.tensor([(world - 1) * (ubatch_id + 1)])
    expected["all_gather"] = torch.cat(
        [torch.full((2, 4), float(source * 10 + ubatch_id)) for source in range(world)]
    )
    expected["reduce_scatter"] = sum(
        (torch.arange(world * 3, dtype=torch.float32) * (source + 1) + ubatch_id)[
            rank * 3 : rank * 3 + 3
        ]
        for source in range(world)
    )
    expected["own_compute"] = torch.full((4, 4), 4.0)
    expected["a2a_async"] = torch.tensor(
        [[float(source + 10 * ubatch_id)] * 2 for source in range(world)]
    )
    return expected


def _check_collectives_in_world() -> dict[str, int]:
    rank, world, _ = comm.init_distributed(timeout_s=30)
    groups = comm.ubatch_groups()  # created by init_distributed: a lookup, no collective
    assert len(groups) == 2 and groups[0] is not groups[1], groups
    num_checked = 0
    events: list[tuple[int, str]] = []

    def step(tag: torch.Tensor) -> dict[str, torch.Tensor]:
        events.append((dbo.current_ubatch_id(), "start"))
        out = _collective_step(tag, rank, world)
        events.append((dbo.current_ubatch_id(), "end"))
        return out

    for num_ubatches in (2, 3):
        tags = torch.arange(num_ubatches).reshape(num_ubatches, 1)
        serial = [_collective_step(tags[u], rank, world) for u in range(num_ubatches)]
        events.clear()
        overlapped = dbo.overlap(step, num_ubatches=num_ubatches, merge=dbo.merge_parts)(tags)
        # The ubatches interleaved: all started before the first one ended.
        assert [kind for _, kind in events[:num_ubatches]] == ["start"] * num_ubatches, events
        for ubatch_id in range(num_ubatches):
            expected = _expected(rank, world, ubatch_id)
            for name, value in expected.items():
                got_serial = serial[ubatch_id][name]
                got_overlap = overlapped[ubatch_id][name]
                assert torch.equal(got_serial, value.to(got_serial.dtype)), (
                    f"serial {name} ubatch {ubatch_id}: {got_serial} != {value}"
                )
                assert torch.equal(got_overlap, got_serial), (
                    f"overlapped {name} ({num_ubatches} ubatches) ubatch {ubatch_id}: "
                    f"{got_overlap} != serial {got_serial}"
                )
                num_checked += 1
    return {"rank": rank, "world": world, "num_checked": num_checked}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_inside_overlap_equal_serial(world_size: int) -> None:
    values = expect_ok(run_world(_check_collectives_in_world, world_size, timeout_s=90))
    assert [v["rank"] for v in values] == list(range(world_size))
    assert all(v["world"] == world_size for v in values)
    # Every result of every ubatch, for 2 + 3 ubatches, on every rank.
    per_ubatch = len(_expected(0, world_size, 0))
    assert all(v["num_checked"] == per_ubatch * (2 + 3) for v in values), values


def _waits_after_a_peer_never_joins(first_timeout_ms: int | None) -> list[str]:
    start_together()
    rank = comm.init_distributed(timeout_s=3)[0]
    if rank == 1:
        wait_for("rank 0 waited", timeout_s=60)  # never joins the all-reduce below
        return []
    seen: list[str] = []
    handle = comm.all_reduce(torch.ones(2), async_op=True)
    assert handle is not None
    if first_timeout_ms is not None:
        try:  # the caller's own timeout: the collective is still in flight afterwards
            handle.wait(timedelta(milliseconds=first_timeout_ms))
            seen.append("returned")
        except RuntimeError:
            seen.append("in flight" if "in flight" in repr(handle) else repr(handle))
    errors = []
    for _ in range(3):  # the group's timeout: a failure, raised by every later wait
        try:
            seen.append(f"returned {handle.wait()!r}")
        except RuntimeError as error:
            errors.append(error)
            seen.append("raised")
    chained = all(
        type(later) is RuntimeError
        and later.__cause__ is errors[0]
        and str(later).startswith("the collective all_reduce failed: ")
        for later in errors[1:]
    )
    seen.append("later waits chain the first error" if chained else repr(errors))
    tell("rank 0 waited")
    return seen


@pytest.mark.timeout(120)
def test_every_wait_after_the_group_timed_out_raises() -> None:
    """A peer never joins: the first wait raises the group's timeout, every later one a
    RuntimeError chained to it; none returns as if the all-reduce had completed."""
    results = run_world(
        _waits_after_a_peer_never_joins, 2, args=(None,), timeout_s=60, exit_timeout_s=3
    )
    assert results[0].ok, results[0].traceback
    assert results[0].value == [
        "raised", "raised", "raised", "later waits chain the first error"
    ]


@pytest.mark.timeout(120)
def test_a_wait_whose_own_timeout_passed_leaves_the_collective_in_flight() -> None:
    """`wait(timeout)` raises when its own timeout passes and the handle stays in flight
    (a later wait waits again) until the collective itself fails."""
    results = run_world(
        _waits_after_a_peer_never_joins, 2, args=(300,), timeout_s=60, exit_timeout_s=3
    )
    assert results[0].ok, results[0].traceback
    assert results[0].value == [
        "in flight", "raised", "raised", "raised", "later waits chain the first error"
    ]


def _gather_layouts() -> list[Any]:
    start_together()
    rank, world = comm.init_distributed(timeout_s=15)[:2]
    refused = []
    for call in (
        lambda: comm.reduce_scatter_tensor(torch.zeros(()), torch.ones(world)),  # gloo: SIGSEGV
        lambda: comm.reduce_scatter_tensor(torch.zeros(3), torch.ones(world, 3)),
        lambda: comm.all_gather_into_tensor(torch.zeros(world, 3), torch.ones(3)),
        lambda: comm.all_gather_into_tensor(torch.zeros(world), torch.ones(())),
    ):
        try:
            call()
            refused.append("launched")
        except ValueError as error:
            refused.append("concatenation" in str(error))
    # Nothing was launched above: the next collectives match across ranks.
    gathered = torch.zeros(world * 2, 3)
    comm.all_gather_into_tensor(gathered, torch.full((2, 3), float(rank)))
    scattered = torch.zeros(2)
    comm.reduce_scatter_tensor(scattered, torch.arange(world * 2.0))
    return [refused, gathered[:, 0].tolist(), scattered.tolist()]


@pytest.mark.timeout(120)
def test_gloo_layouts_are_checked_before_launching_across_ranks() -> None:
    """Layouts gloo rejects (a 0-dim reduce-scatter output crashes it) are refused on
    every rank before anything is launched, so the ranks stay in step."""
    values = expect_ok(run_world(_gather_layouts, 2, timeout_s=60))
    for rank, (refused, gathered, scattered) in enumerate(values):
        assert refused == [True] * 4
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert scattered == [4.0 * rank, 4.0 * rank + 2.0]
