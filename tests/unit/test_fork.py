"""A process forked after dbo ran (a fork-started DataLoader worker, `multiprocessing`
with the fork method) has none of the parent's ubatch threads: `dbo.overlap` must build
new ones there, and a runner created before the fork must refuse to run, not hang."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import dbo

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "fork"), reason="needs os.fork"
)

# Exit codes of the child: which check failed.
_OK, _OVERLAP_WRONG, _RUNNER_RAN, _RUNNER_WRONG_ERROR, _CRASHED = 0, 3, 4, 5, 6


def _in_child(runner: dbo.UBatchRunner) -> int:
    """What the child checks; its exit code."""
    try:
        x = torch.arange(8.0).reshape(4, 2)
        if not torch.equal(dbo.overlap(lambda t: t * 2)(x), x * 2):
            return _OVERLAP_WRONG
        try:
            runner.run(lambda t: t, [((x,), {}), ((x,), {})])
        except RuntimeError as error:
            if "os.fork()" not in str(error):
                return _RUNNER_WRONG_ERROR
        else:
            return _RUNNER_RAN
        runner.close()  # must return at once: the workers are the parent's
        return _OK
    except BaseException:  # noqa: BLE001 - any failure is an exit code for the parent
        return _CRASHED


def _wait_for(pid: int, timeout_s: float) -> int | None:
    """The child's exit code, or None (after killing it) if it did not end in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


@pytest.mark.timeout(60)
def test_a_forked_child_gets_new_ubatch_threads_and_old_runners_refuse() -> None:
    x = torch.ones(4, 2)
    assert torch.equal(dbo.overlap(lambda t: t + 1)(x), x + 1)  # the pool now holds a runner
    runner = dbo.UBatchRunner(num_ubatches=2)
    runner.run(lambda t: t, [((x,), {}), ((x,), {})])
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code, never return into pytest
            os._exit(_in_child(runner))
        code = _wait_for(pid, timeout_s=30.0)
    finally:
        if pid != 0:
            runner.close()
    assert code is not None, "the forked child hung"
    assert code == _OK, f"the child failed check {code}"
    # The parent's runner and pool still work.
    assert torch.equal(dbo.overlap(lambda t: t + 1)(x), x + 1)


@pytest.mark.timeout(60)
def test_a_fork_inside_a_ubatch_neither_hangs_the_child_nor_the_parent() -> None:
    """The child of a fork made inside ubatch 0 runs the rest of the function outside any
    overlap (its `dbo.yield_()` returns at once) and its thread ends when the function
    returns, instead of parking on wake-ups it shares with the parent; the parent's run
    ends normally."""
    children: list[int] = []
    in_child: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            pid = os.fork()
            if pid == 0:
                in_child.append(True)
                if dbo.enabled() or dbo.current_ubatch_id() != 0:
                    os._exit(_CRASHED)  # the child must see no overlap
            else:
                children.append(pid)
        for _ in range(3):
            dbo.yield_()  # in the child: no-op; in the parent: a handoff
        return x + 1

    with dbo.UBatchRunner(num_ubatches=2) as runner:
        outputs = runner.run(fn, [((torch.zeros(1),), {}), ((torch.zeros(1),), {})],
                             timeout_s=20.0)
        assert not in_child, "the parent ran the child's branch"
        assert [float(out) for out in outputs] == [1.0, 1.0]
        (pid,) = children
        code = _wait_for(pid, timeout_s=30.0)
        assert code is not None, "the child forked inside a ubatch hung"
        assert code == _OK, f"the child failed check {code}"
        # The parent's wake-ups were not stolen: more runs go through.
        for _ in range(3):
            runner.run(lambda t: t, [((torch.zeros(1),), {})] * 2, timeout_s=10.0)


@pytest.mark.timeout(60)
def test_locks_held_by_another_thread_at_the_fork_do_not_block_the_child() -> None:
    """A fork copies a lock in whatever state it was: the registry's count lock and a
    trace's lock, held by some other thread at that instant, must not stay held in the
    child (its first overlapped call would block on them for good)."""
    from dbo import _context

    x = torch.ones(4, 2)
    with dbo.trace() as recording:
        dbo.overlap(lambda t: t + 1)(x)
        with _context._count_lock, recording._lock:  # "another thread" holds them now
            pid = os.fork()
            if pid == 0:
                try:
                    ok = torch.equal(dbo.overlap(lambda t: t + 1, timeout_s=5.0)(x), x + 1)
                    os._exit(_OK if ok else _OVERLAP_WRONG)
                except BaseException:  # noqa: BLE001 - reported through the exit code
                    os._exit(_CRASHED)
        code = _wait_for(pid, timeout_s=30.0)
    assert code is not None, "the child hung on a lock copied held"
    assert code == _OK, f"the child failed check {code}"


@pytest.mark.timeout(60)
def test_a_child_forked_inside_a_trace_does_not_record_into_the_parents() -> None:
    x = torch.ones(4, 2)
    with dbo.trace():
        pid = os.fork()
        if pid == 0:  # the child: its own trace must start, and the parent's stay idle
            try:
                with dbo.trace() as own:
                    dbo.overlap(lambda t: t + 1)(x)
                os._exit(0 if own.spans else 3)
            except BaseException:  # noqa: BLE001 - any failure is an exit code
                os._exit(4)
        code = _wait_for(pid, timeout_s=30.0)
    assert code == 0, code  # 4: the child's trace() raised, the parent's was still active


@pytest.mark.timeout(60)
def test_a_child_forked_while_the_trace_lock_was_held_can_leave_the_block() -> None:
    pid = -1
    with dbo.trace() as timeline:
        timeline._lock.acquire()  # as another thread recording a span at the fork would
        pid = os.fork()
        if pid != 0:
            timeline._lock.release()
    if pid == 0:  # the child got here: leaving the block did not block on the old lock
        os._exit(0)
    assert _wait_for(pid, timeout_s=10.0) == 0, "the child hung leaving the trace block"


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_inherit_the_parents_abandoned_collectives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from comm import _abandoned

    class NeverCompletes:
        def is_completed(self) -> bool:
            return False

    monkeypatch.setattr(_abandoned, "_works", [NeverCompletes()])
    pid = os.fork()
    if pid == 0:  # they never complete in the child: it must not wait for them at exit
        os._exit(0 if _abandoned.in_flight() == 0 else 3)
    assert _wait_for(pid, timeout_s=30.0) == 0


@pytest.mark.timeout(60)
def test_a_child_forked_inside_a_ubatch_runs_none_of_the_parents_hooks_or_callbacks() -> None:
    """The child runs the rest of `fn` outside any overlap: a recv hook another ubatch
    registered and this ubatch's exit callbacks belong to the parent's run (a receive
    or a collective wait run twice, the second time in a process with no peer)."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    children: list[int] = []

    def note(what: str) -> None:
        where = "parent" if os.getpid() == parent else "child"
        os.write(write_end, f"{what} in {where}\n".encode())

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 0:
            dbo.register_recv_hook(lambda: note("hook"))
            dbo.yield_()
            return x
        dbo.at_ubatch_exit(lambda: note("exit callback"))
        pid = os.fork()
        if pid == 0:
            return x  # the child's fn ends here; its worker then ends the process
        children.append(pid)
        return x

    try:
        dbo.overlap(fn, timeout_s=30)(torch.ones(4))
        assert len(children) == 1
        assert _wait_for(children[0], 30.0) == 0
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = sorted(pipe.read().splitlines())
    assert lines == ["exit callback in parent", "hook in parent"], lines
