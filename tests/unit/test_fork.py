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
