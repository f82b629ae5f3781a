"""`dbo.run_state()`: per-run state shared by the ubatch threads of one overlap run."""

from __future__ import annotations

import threading
from typing import Any

import torch

import dbo


def test_run_state_is_none_outside_an_overlap() -> None:
    assert dbo.run_state() is None
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(dbo.run_state()))
    thread.start()
    thread.join(timeout=10)
    assert seen == [None]


def test_one_dict_shared_by_the_ubatches_of_a_run_and_a_fresh_one_per_run() -> None:
    def fn(x: torch.Tensor) -> tuple[int, list[int]]:
        state = dbo.run_state()
        assert isinstance(state, dict)
        order = state.setdefault("order", [])
        order.append(dbo.current_ubatch_id())
        dbo.yield_()  # every ubatch has written before anyone reads
        return id(state), list(order)

    with dbo.UBatchRunner(num_ubatches=3) as runner:
        first = runner.run(fn, [((torch.zeros(1),), {})] * 3)
        second = runner.run(fn, [((torch.zeros(1),), {})] * 3)
    for outputs in (first, second):
        assert len({state_id for state_id, _ in outputs}) == 1  # one dict per run
        assert [order for _, order in outputs] == [[0, 1, 2]] * 3  # shared, fresh
    assert dbo.run_state() is None

    # dbo.overlap too; a thread started inside a ubatch is outside any run.
    def in_overlap(x: torch.Tensor) -> torch.Tensor:
        state = dbo.run_state()
        assert state is not None and state.get("mark") in (None, "set")
        state["mark"] = "set"
        helper: list[Any] = []
        thread = threading.Thread(target=lambda: helper.append(dbo.run_state()))
        thread.start()
        thread.join(timeout=10)
        assert helper == [None]
        return x

    dbo.overlap(in_overlap)(torch.zeros(4))
    dbo.overlap(in_overlap)(torch.zeros(4))
