"""Wake-ups (`dbo.runtime.wakeup`) and the baton's use of them: every kind keeps the handoff
contract, and a wake-up is only a hint (a left-over set never lets a ubatch run out of
turn)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch

import dbo
from dbo.errors import UBatchAbortedError
from dbo.runtime import wakeup
from dbo.runtime.baton import Baton

KINDS = pytest.mark.parametrize("kind", wakeup.kinds(), ids=lambda kind: kind.__name__)


def _waiter(wakeup: object) -> threading.Thread:
    thread = threading.Thread(target=wakeup.wait, daemon=True)  # type: ignore[attr-defined]
    thread.start()
    return thread


@KINDS
def test_a_set_before_the_wait_is_kept(kind: type) -> None:
    wakeup = kind()
    wakeup.set()
    waiter = _waiter(wakeup)
    waiter.join(5.0)
    assert not waiter.is_alive()


@KINDS
def test_a_wait_blocks_until_another_thread_sets(kind: type) -> None:
    wakeup = kind()
    waiter = _waiter(wakeup)
    waiter.join(0.2)
    assert waiter.is_alive(), "wait() returned without a set"
    wakeup.set()
    waiter.join(5.0)
    assert not waiter.is_alive()


@KINDS
def test_sets_coalesce_into_one_wake_up(kind: type) -> None:
    wakeup = kind()
    wakeup.set()
    wakeup.set()
    wakeup.wait()  # consumes both
    waiter = _waiter(wakeup)
    waiter.join(0.2)
    try:
        assert waiter.is_alive(), "a second wait() returned on the same (coalesced) sets"
    finally:
        wakeup.set()
        waiter.join(5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="eventfd is Linux-only")
def test_linux_gets_eventfd_wake_ups() -> None:
    """The fast kind must not silently fall back to locks."""
    assert type(wakeup.new_wakeup()) is wakeup.EventfdWakeup


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_eventfd_wake_ups_close_their_descriptor_when_dropped() -> None:
    if wakeup.EventfdWakeup not in wakeup.kinds():
        pytest.skip("no eventfd here")
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    wakeups = [wakeup.EventfdWakeup() for _ in range(50)]
    assert len(os.listdir("/proc/self/fd")) >= before + 50
    del wakeups
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


# ----------------------------------------------------------------- the baton on each kind
def _ping_pong(baton: Baton, rounds: int) -> tuple[list[int], list[BaseException]]:
    """Two ubatch threads that log their id, then yield, `rounds` times each."""
    order: list[int] = []
    errors: list[BaseException] = []

    def ubatch(ubatch_id: int) -> None:
        try:
            baton.wait_turn(ubatch_id)
            for _ in range(rounds):
                order.append(ubatch_id)
                baton.yield_(ubatch_id)
        except BaseException as error:  # noqa: B036 - reported to the test
            errors.append(error)
        finally:
            baton.finish(ubatch_id)

    threads = [threading.Thread(target=ubatch, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    baton.start()
    assert baton.wait_done(10.0), "the ping-pong did not finish in 10 s"
    for thread in threads:
        thread.join(5.0)
    return order, errors


@KINDS
def test_the_baton_alternates_on_every_kind(kind: type) -> None:
    order, errors = _ping_pong(Baton(2, [kind(), kind()]), rounds=200)
    assert errors == []
    assert order == [0, 1] * 200


@KINDS
def test_a_left_over_wake_up_does_not_let_a_ubatch_run_out_of_turn(kind: type) -> None:
    """A set no handoff made (left by an aborted run, or an abort racing a handoff) wakes
    the thread, which finds it does not hold the baton and parks again."""
    wakeups = [kind(), kind()]
    wakeups[1].set()  # ubatch 1 would run first if a wake-up were a turn
    order, errors = _ping_pong(Baton(2, wakeups), rounds=50)
    assert errors == []
    assert order == [0, 1] * 50


@KINDS
def test_an_abort_wakes_every_parked_ubatch(kind: type) -> None:
    baton = Baton(3, [kind(), kind(), kind()])
    raised: list[int] = []

    def parked(ubatch_id: int) -> None:
        try:
            baton.wait_turn(ubatch_id)
        except UBatchAbortedError:
            raised.append(ubatch_id)

    threads = [threading.Thread(target=parked, args=(i,), daemon=True) for i in (1, 2)]
    for thread in threads:
        thread.start()
    baton.abort("test", wake_all=True)
    for thread in threads:
        thread.join(5.0)
    assert sorted(raised) == [1, 2]


def test_a_runner_worker_woken_out_of_turn_parks_again() -> None:
    """The runner's workers park on the wake-ups their batons use, between runs too: a
    set no handoff made must not start ubatch 1 before ubatch 0 yields to it. Ubatch 0
    sets ubatch 1's wake-up twice during its first turn: the first set makes worker 1
    take its job and park in the baton, the second wakes it there."""
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        order: list[int] = []
        wake_of_1 = runner._workers[1].wake

        def fn(x: torch.Tensor) -> torch.Tensor:
            me = dbo.current_ubatch_id()
            for turn in range(20):
                order.append(me)
                if me == 0 and turn == 0:
                    for _ in range(2):
                        wake_of_1.set()
                        time.sleep(0.05)  # drops the GIL: worker 1 may run if it thinks it may
                        order.append(me)
                dbo.yield_()
            return x

        inputs = [((torch.zeros(1),), {}), ((torch.zeros(1),), {})]
        for _ in range(3):
            order.clear()
            runner.run(fn, inputs, timeout_s=10.0)
            assert order == [0, 0, 0] + [1, 0] * 19 + [1]
