"""A process forked after dbo ran (a fork-started DataLoader worker, `multiprocessing`
with the fork method) drops the runners it inherited: `dbo.overlap` builds new ones
there, and a runner created before the fork refuses to run instead of hanging.

Each child reports through its exit code and never returns into pytest; the parent
waits for it with a bound and kills it past that.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import pytest
import torch

import dbo

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "fork"), reason="needs os.fork"
)



def _wait_for(pid: int, timeout_s: float = 30.0) -> int | None:
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


def _fork(child: Callable[[], bool]) -> int:
    """Fork; the child exits 0 if `child()` is True, 3 if False, 4 if it raised."""
    pid = os.fork()
    if pid == 0:
        code = 4
        try:
            code = 0 if child() else 3
        finally:
            os._exit(code)
    return pid


def _ubatch_threads(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` overlapped, recording (ubatch id, thread name) per ubatch into `fn.seen`."""
    seen: list[tuple[int, str]] = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        import threading

        seen.append((dbo.current_ubatch_id(), threading.current_thread().name))
        dbo.yield_()
        return fn(x)

    wrapped = dbo.overlap(traced, timeout_s=10.0)
    wrapped.seen = seen  # type: ignore[attr-defined]
    return wrapped


@pytest.mark.timeout(60)
def test_a_forked_child_overlaps_on_ubatch_threads_of_its_own() -> None:
    x = torch.arange(8.0).reshape(4, 2)
    doubled = _ubatch_threads(lambda t: t * 2)
    assert torch.equal(doubled(x), x * 2)  # the pool now holds a runner, and its threads

    def child() -> bool:
        doubled.seen.clear()  # type: ignore[attr-defined]
        if not torch.equal(doubled(x), x * 2):
            return False
        ids = sorted(ubatch_id for ubatch_id, _ in doubled.seen)  # type: ignore[attr-defined]
        names = {name for _, name in doubled.seen}  # type: ignore[attr-defined]
        return ids == [0, 1] and len(names) == 2 and all(n.startswith("dbo-ubatch") for n in names)

    assert _wait_for(_fork(child)) == 0
    assert torch.equal(doubled(x), x * 2)  # the parent's pooled runner still works


@pytest.mark.timeout(60)
def test_a_runner_created_before_the_fork_refuses_to_run_in_the_child() -> None:
    x = torch.ones(4, 2)
    parts = [((x,), {}), ((x,), {})]
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        runner.run(lambda t: t, parts)

        def child() -> bool:
            try:
                runner.run(lambda t: t, parts)
            except RuntimeError as error:
                refused = "os.fork()" in str(error)
            else:
                return False
            runner.close()  # returns at once: the workers are the parent's
            return refused

        assert _wait_for(_fork(child)) == 0
        assert [out.sum().item() for out in runner.run(lambda t: t + 1, parts)] == [16.0, 16.0]


@pytest.mark.timeout(60)
def test_locks_held_at_the_fork_block_nothing_and_the_child_records_its_own_trace() -> None:
    """A fork copies a lock in whatever state it was: the pool's and the trace's, held by
    another thread at that instant, must not stay held in the child."""
    x = torch.ones(4, 2)
    pid = -1
    try:
        with dbo.trace() as parents:
            dbo.overlap(lambda t: t + 1)(x)
            with parents._lock, dbo.runtime.pool.runner_pool._lock:  # "another thread"
                pid = os.fork()
            if pid == 0:
                with dbo.trace() as own:
                    ok = torch.equal(dbo.overlap(lambda t: t + 1, timeout_s=10.0)(x), x + 1)
                code = 0 if ok and own.spans and parents.end_s is not None else 3
        if pid == 0:
            os._exit(code)  # leaving the parent's trace block did not block either
    finally:
        if pid == 0:
            os._exit(4)
    assert _wait_for(pid) == 0
    assert [span.name for span in parents.spans].count("dbo.overlap") == 1


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_inherit_the_parents_abandoned_collectives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from comm import _abandoned

    class NeverCompletes:
        def is_completed(self) -> bool:
            return False

    monkeypatch.setattr(_abandoned, "_works", [NeverCompletes()])
    # They never complete in the child: it must not wait for them at exit.
    assert _wait_for(_fork(lambda: _abandoned.in_flight() == 0)) == 0
