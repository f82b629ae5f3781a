"""comm collectives in one process: argument checks, outside-overlap behaviour, and the
DBO protocol (stream moves, one yield per collective, per-ubatch groups) in a world of 1."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm
import dbo
from comm import collectives


def test_collectives_need_an_initialized_world() -> None:
    comm.destroy_distributed()
    x = torch.zeros(2)
    for call in (
        lambda: comm.all_reduce(x),
        lambda: comm.all_to_all_single(x.clone(), x),
        lambda: comm.all_gather_into_tensor(x.clone(), x),
        lambda: comm.reduce_scatter_tensor(x.clone(), x),
    ):
        with pytest.raises(RuntimeError, match="comm.init_distributed"):
            call()


def test_outside_an_overlap_they_are_the_plain_ops(world_of_one: None) -> None:
    x = torch.arange(6.0).reshape(3, 2)
    out = torch.empty_like(x)
    assert comm.all_to_all_single(out, x) is None
    assert torch.equal(out, x)
    out.zero_()
    comm.all_to_all_single(out, x, [3], [3])
    assert torch.equal(out, x)
    summed = x.clone()
    comm.all_reduce(summed)
    assert torch.equal(summed, x)
    gathered = torch.empty(6)
    comm.all_gather_into_tensor(gathered, torch.arange(6.0))
    assert torch.equal(gathered, torch.arange(6.0))
    scattered = torch.empty(2, 3)
    comm.reduce_scatter_tensor(scattered, torch.ones(2, 3), op=comm.ReduceOp.MAX)
    assert torch.equal(scattered, torch.ones(2, 3))

    work = comm.all_reduce(summed, async_op=True)
    assert isinstance(work, comm.CollectiveWork)
    assert isinstance(work.work, dist.Work)
    work.wait()
    assert work.is_completed()
    assert "waited" in repr(work)


def test_inside_an_overlap_one_yield_per_collective_and_back_on_compute(
    world_of_one: None,
) -> None:
    events: list[tuple[int, str, bool]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        u = dbo.current_ubatch_id()
        out = torch.empty_like(x)
        events.append((u, "launch", dbo.on_comm_stream()))
        comm.all_to_all_single(out, x)
        events.append((u, "done", dbo.on_comm_stream()))
        total = out.clone()
        comm.all_reduce(total)
        events.append((u, "reduced", dbo.on_comm_stream()))
        return total

    x = torch.arange(8.0).reshape(4, 2)
    y = dbo.overlap(body)(x)
    assert torch.equal(y, x)
    # Each collective yields once: the two ubatches alternate at every collective.
    assert [(u, what) for u, what, _ in events] == [
        (0, "launch"), (1, "launch"), (0, "done"), (1, "done"), (0, "reduced"), (1, "reduced")
    ]
    assert not any(on_comm for _, _, on_comm in events), "always back on the compute stream"


def test_a_caller_already_on_its_comm_stream_stays_there(world_of_one: None) -> None:
    where: list[bool] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        dbo.switch_to_comm()
        comm.all_reduce(x)
        where.append(dbo.on_comm_stream())
        dbo.switch_to_compute()
        return x

    dbo.overlap(body)(torch.ones(2, 2))
    assert where == [True, True]


def test_async_inside_an_overlap_yields_at_wait(world_of_one: None) -> None:
    events: list[tuple[int, str]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        u = dbo.current_ubatch_id()
        out = torch.empty_like(x)
        work = comm.all_to_all_single(out, x, async_op=True)
        assert work is not None
        assert not dbo.on_comm_stream(), "launch returns on the compute stream"
        events.append((u, "own compute"))
        work.wait()
        events.append((u, "waited"))
        work.wait()  # a second wait neither blocks nor yields
        events.append((u, "again"))
        return out

    x = torch.arange(4.0).reshape(2, 2)
    assert torch.equal(dbo.overlap(body)(x), x)
    assert events == [
        (0, "own compute"), (1, "own compute"), (0, "waited"), (0, "again"),
        (1, "waited"), (1, "again"),
    ]


def test_inside_an_overlap_ubatch_i_uses_its_duplicate_group(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = comm.ubatch_groups(None, 2)
    used: list[tuple[int, Any]] = []
    original = dist.all_reduce

    def recording_all_reduce(tensor: Any, op: Any, group: Any, async_op: bool) -> Any:
        used.append((dbo.current_ubatch_id(), group))
        return original(tensor, op, group, async_op)

    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)

    def body(x: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(x)
        return x

    dbo.overlap(body, num_ubatches=3)(torch.ones(3, 2))
    comm.all_reduce(torch.ones(2))
    assert used == [
        (0, groups[0]), (1, groups[1]), (2, groups[0]), (0, dist.group.WORLD)
    ]


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2), [3], [4]),
         ValueError, r"sums to 3, but output has 4 rows"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2), [2, 2], None),
         ValueError, "one entry per rank of the group"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2), [-1], None),
         ValueError, ">= 0"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2), [4.0], None),
         TypeError, "ints"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2),
                                        torch.tensor([4]), None),
         TypeError, "tolist"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 3)),
         ValueError, "same row shape"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32)),
         TypeError, "same dtype"),
        (lambda: comm.all_to_all_single(torch.empty(4, 2, device="meta"), torch.empty(4, 2)),
         ValueError, "same device"),
        (lambda: comm.all_to_all_single(torch.empty(2, 4).t(), torch.empty(4, 2)),
         ValueError, "contiguous"),
        (lambda: comm.all_to_all_single(torch.empty(()), torch.empty(())),
         ValueError, "dim 0"),
        (lambda: comm.all_to_all_single(torch.empty(4), [0.0] * 4),
         TypeError, "input must be a torch.Tensor"),
        (lambda: comm.all_reduce(torch.empty(2), op="sum"), TypeError, "ReduceOp"),
        (lambda: comm.all_reduce(torch.empty(2), async_op=1), TypeError, "async_op"),
        (lambda: comm.all_reduce(torch.empty(2), group="world"), TypeError, "ProcessGroup"),
        (lambda: comm.all_gather_into_tensor(torch.empty(3), torch.empty(2)),
         ValueError, "world_size \\* input.numel\\(\\) = 1 \\* 2"),
        (lambda: comm.reduce_scatter_tensor(torch.empty(3), torch.empty(2)),
         ValueError, "world_size \\* output.numel\\(\\)"),
    ],
)
def test_bad_arguments_raise_before_launching(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, call: Any, error: type, text: str
) -> None:
    launched: list[str] = []
    for module, name in [(dist, "all_to_all_single"), (dist, "all_reduce"),
                         (collectives, "_all_gather"), (collectives, "_reduce_scatter")]:
        # every launch goes through these
        monkeypatch.setattr(module, name, lambda *a, _n=name: launched.append(_n))
    with pytest.raises(error, match=text):
        call()
    assert launched == []

    # Inside an overlap the same error reaches the caller, same type.
    def body(x: torch.Tensor) -> torch.Tensor:
        call()
        return x

    with pytest.raises(error, match=text):
        dbo.overlap(body)(torch.zeros(2))
    assert launched == []


def test_an_async_collective_never_waited_is_waited_when_its_ubatch_returns(
    world_of_one: None,
) -> None:
    handles: list[comm.CollectiveWork] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        work = comm.all_reduce(out, async_op=True)
        assert work is not None
        handles.append(work)
        return out  # the caller forgot work.wait()

    x = torch.arange(4.0)
    out = dbo.overlap(fn, timeout_s=30)(x)
    assert torch.equal(out, x)  # a world of one: the sum is the input
    assert [repr(handle) for handle in handles] == ["CollectiveWork(waited, yields=True)"] * 2


def test_exit_callbacks_run_in_order_at_a_normal_end_only() -> None:
    calls: list[tuple[int, str]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        assert dbo.at_ubatch_exit(lambda: calls.append((me, "first")))
        assert dbo.at_ubatch_exit(lambda: calls.append((me, "second")))
        dbo.yield_()
        calls.append((me, "body done"))
        return x

    dbo.overlap(fn, timeout_s=30)(torch.zeros(2))
    assert calls == [
        (0, "body done"), (0, "first"), (0, "second"),
        (1, "body done"), (1, "first"), (1, "second"),
    ]  # fmt: skip
    assert dbo.at_ubatch_exit(lambda: None) is False  # outside: nothing to end

    def failing(x: torch.Tensor) -> torch.Tensor:
        dbo.at_ubatch_exit(lambda: calls.append((9, "after a failure")))
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        dbo.overlap(failing, timeout_s=30)(torch.zeros(2))
    assert (9, "after a failure") not in calls


def test_a_waited_async_handle_does_not_keep_its_tensors_until_the_ubatch_ends(
    world_of_one: None,
) -> None:
    import gc
    import weakref

    alive: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            buffer = x.clone()
            ref = weakref.ref(buffer)
            work = comm.all_reduce(buffer, async_op=True)
            assert work is not None
            work.wait()
            del work, buffer
            # gloo's worker thread may drop its own reference to the work a moment
            # after completing it: give it that moment, but end well inside the ubatch
            # (a reference kept until the ubatch ends would never go here).
            deadline = time.monotonic() + 2.0
            while ref() is not None and time.monotonic() < deadline:
                time.sleep(0.001)
            alive.append(ref() is not None)
        return x

    gc.collect()
    gc.disable()
    try:
        dbo.overlap(fn, timeout_s=30)(torch.zeros(4))
    finally:
        gc.enable()
    assert alive == [False] * 6
