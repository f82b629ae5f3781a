"""A ubatch that raises: the others unwind at their next yield point, in ring order;
the caller gets the first failure with its ubatch id; nothing of the failed call is kept;
the runner and its workers stay usable."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import dbo
from dbo.runtime.baton import Baton
from dbo.runtime.runner import UBatchRunner


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_after_a_failure_the_others_unwind_one_at_a_time_in_ring_order(
    num_ubatches: int,
) -> None:
    """Each ubatch unwinds in its turn, even one that handed the baton on but had not
    parked yet when the next one failed: its `finally` blocks may launch collectives,
    whose order must match across ranks."""
    order: list[int] = []

    def make_fn(failing: int) -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            me = dbo.current_ubatch_id()
            try:
                for turn in range(5):
                    if me == failing and turn == 2:
                        raise ValueError("boom")
                    dbo.yield_()
                return x
            except dbo.UBatchAbortedError:
                order.append(me)
                raise

        return fn

    with UBatchRunner(num_ubatches=num_ubatches) as runner:
        for failing in range(num_ubatches):
            for _ in range(15):
                order.clear()
                with pytest.raises(ValueError, match="boom"):
                    runner.run(make_fn(failing), [((torch.zeros(1),), {})] * num_ubatches,
                               timeout_s=10.0)
                expected = [(failing + k) % num_ubatches for k in range(1, num_ubatches)]
                assert order == expected


@pytest.mark.timeout(30)
def test_a_ubatch_raising_an_abort_error_of_its_own_aborts_the_others() -> None:
    """`UBatchAbortedError` raised by `fn` in a run that is not aborted (re-raised from
    another runner's run) is this ubatch's own failure: the others unwind."""
    reached_after_yield: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            raise dbo.UBatchAbortedError("an inner run was aborted")
        dbo.yield_()
        reached_after_yield.append(dbo.current_ubatch_id())
        return x

    with UBatchRunner(2) as runner:
        with pytest.raises(dbo.UBatchAbortedError, match="an inner run was aborted") as caught:
            runner.run(fn, [((torch.zeros(2),), {}), ((torch.zeros(2),), {})], timeout_s=10)
        assert caught.value.ubatch_id == 0  # type: ignore[attr-defined]
        assert reached_after_yield == []
        assert runner.run(lambda x: x + 1, [((torch.zeros(1),), {})] * 2, timeout_s=10)[0] == 1


class _StrRaises(Exception):
    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")  # e.g. unpickled without its fields


class _StrNotAString(Exception):
    def __str__(self) -> str:
        return None  # type: ignore[return-value]  # str() then raises TypeError


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", [_StrRaises, _StrNotAString])
def test_an_exception_whose_str_fails_aborts_the_others_and_leaves_the_runner_usable(
    kind: type[Exception],
) -> None:
    """The abort reason formats the error without letting a failing `str()` escape: the
    others are aborted and the pooled workers keep serving."""
    reached_after_yield: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            raise kind()
        dbo.yield_()
        reached_after_yield.append(dbo.current_ubatch_id())
        return x * 2

    step = dbo.overlap(fn, timeout_s=10.0)
    x = torch.ones(4, 3)
    with pytest.raises(kind) as raised:
        step(x)
    assert raised.value.ubatch_id == 0  # type: ignore[attr-defined]
    assert reached_after_yield == []  # ubatch 1 was aborted at its yield
    workers = [t for t in threading.enumerate() if t.name.startswith("dbo-ubatch")]
    assert all(t.is_alive() for t in workers)
    for _ in range(3):  # the same pooled runner, and its workers, again
        assert torch.equal(dbo.overlap(lambda t: t * 2, timeout_s=10.0)(x), x * 2)


def test_the_abort_reason_survives_an_exception_whose_str_fails() -> None:
    from dbo.errors import describe

    assert describe(ValueError("bad split")) == "ValueError: bad split"
    assert describe(_StrRaises()).startswith("_StrRaises")
    assert describe(_StrNotAString()).startswith("_StrNotAString")


@pytest.mark.parametrize("notes", [("tagged upstream",), "not even a sequence of notes"])
def test_an_error_whose_notes_are_not_a_list_still_reaches_the_caller(notes: object) -> None:
    """`__notes__` set to a tuple (or worse) by other code: the ubatch's own error still
    reaches the caller, with the note naming its ubatch."""

    class Tagged(ValueError):
        pass

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            error = Tagged("the real failure")
            error.__notes__ = notes  # type: ignore[attr-defined]
            raise error
        return x

    with pytest.raises(Tagged, match="the real failure") as caught:
        dbo.overlap(fn, timeout_s=30)(torch.ones(4))
    assert caught.value.ubatch_id == 1  # type: ignore[attr-defined]
    assert any("raised in ubatch 1 of 2" in note for note in caught.value.__notes__)


@pytest.mark.timeout(30)
def test_a_worker_outlives_an_error_escaping_its_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error escaping a job (a bug of the runtime itself) is printed, and the worker
    keeps serving: a dead worker would hang every later run."""
    original_finish = Baton.finish
    failures = [RuntimeError("bookkeeping bug")]

    def finish_then_fail(self: Baton, ubatch_id: int) -> None:
        original_finish(self, ubatch_id)
        if failures and ubatch_id == 1:
            raise failures.pop()

    monkeypatch.setattr(Baton, "finish", finish_then_fail)
    with UBatchRunner(2) as runner:
        x = torch.ones(4, 3)
        parts = [((x[:2],), {}), ((x[2:],), {})]
        for _ in range(3):
            outputs = runner.run(lambda t: t + 1, parts, timeout_s=10.0)
            assert [torch.equal(out, part[0][0] + 1) for out, part in zip(outputs, parts)] == [
                True, True,
            ]
    assert failures == []
    assert "unexpected error in worker" in capsys.readouterr().err


@pytest.mark.parametrize("failing_ubatch", [0, 1])
def test_a_failed_call_frees_its_inputs_when_the_caller_drops_the_error(
    failing_ubatch: int,
) -> None:
    """Nothing holds the error in a reference cycle: a caller that retries after an
    out-of-memory error gets the failed call's memory back without a gc pass."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        dbo.yield_()
        if dbo.current_ubatch_id() == failing_ubatch:
            raise ValueError("boom")
        return y

    overlapped = dbo.overlap(fn)
    gc.disable()
    try:
        x = torch.randn(64, 32)
        alive = weakref.ref(x)
        with pytest.raises(ValueError, match="boom"):
            overlapped(x)
        del x
        deadline = time.monotonic() + 5.0  # the workers may still be leaving their frames
        while alive() is not None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert alive() is None
    finally:
        gc.enable()


class _Held:
    pass


def test_callbacks_an_aborted_ubatch_left_are_freed_while_the_error_is_kept() -> None:
    """The exit callbacks and recv hooks of an aborted ubatch never run, and are dropped:
    the error's traceback (which holds the run) does not keep what they hold alive."""
    refs: list[weakref.ref[_Held]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        held, other = _Held(), _Held()
        refs.extend([weakref.ref(held), weakref.ref(other)])
        dbo.at_ubatch_exit(functools.partial(id, held))
        dbo.register_recv_hook(functools.partial(id, other))
        del held, other
        dbo.yield_()  # aborted here: neither runs
        return x

    gc.disable()  # reference counting alone must free them
    try:
        try:
            dbo.overlap(fn, timeout_s=30.0)(torch.zeros(2))
        except ValueError as error:
            failure = error
        assert "ubatch 1 fails" in str(failure)
        assert len(refs) == 2
        assert all(ref() is None for ref in refs)
        del failure
    finally:
        gc.enable()
