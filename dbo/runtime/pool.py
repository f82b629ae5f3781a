"""The runners `dbo.overlap` leases, pooled per process, and what a fork leaves of them."""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dbo import tracing
from dbo.device.streams import held_streams
from dbo.runtime import affinity, context
from dbo.runtime import exit as interpreter_exit
from dbo.runtime.runner import RunnerState, UBatchRunner

_MAX_IDLE_RUNNERS = 2  # per key; more exist only while callers overlap
_MAX_IDLE_RUNNERS_IN_ALL = 8  # over all keys (callers pinned to many different cores)
_PoolKey = tuple[int, "torch.device | None", "frozenset[int] | None"]  # the caller's CPUs last


class RunnerPool:
    """The runners `dbo.overlap` uses, per (num_ubatches, device, caller's CPUs: workers
    keep the CPUs they were created with); closed at exit. Each call leases a runner of
    its own, so concurrent callers (a helper thread inside a ubatch among them) never
    wait for each other's runs; a runner not idle after its run (broken) is closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[_PoolKey, UBatchRunner]] = []
        """Idle runners, least recently returned first (at most 8: a linear scan)."""
        self._generation = 0
        self._atexit_registered = False

    @contextmanager
    def lease(self, num_ubatches: int, device: torch.device | None) -> Iterator[UBatchRunner]:
        key = (num_ubatches, device, affinity.cpus_of_this_thread())
        with self._lock:
            matches = [i for i, (idle_key, _) in enumerate(self._idle) if idle_key == key]
            runner = self._idle.pop(matches[-1])[1] if matches else None  # the most recent
            generation = self._generation
            if not self._atexit_registered:
                atexit.register(self.close_all)
                self._atexit_registered = True
        if runner is None:
            runner = UBatchRunner(num_ubatches, device)
        try:
            yield runner
        finally:
            to_close = [runner]
            with self._lock:
                reusable = runner.state is RunnerState.IDLE and generation == self._generation
                idle_alike = sum(1 for idle_key, _ in self._idle if idle_key == key)
                if reusable and idle_alike < _MAX_IDLE_RUNNERS:
                    self._idle.append((key, runner))
                    to_close = []
                    if len(self._idle) > _MAX_IDLE_RUNNERS_IN_ALL:  # the least recently used
                        to_close = [self._idle.pop(0)[1]]
            for closing in to_close:
                closing.close(timeout_s=0)  # a broken one's workers end with their ubatch

    def reset_after_fork(self) -> None:
        """In a forked child: drop the pooled runners (their threads are the parent's)."""
        self._lock = threading.Lock()
        self._idle = []
        self._generation += 1

    def close_all(self) -> None:
        """Close the idle runners; runners leased now are closed when their run ends."""
        with self._lock:
            runners = [runner for _, runner in self._idle]
            self._idle = []
            self._generation += 1
        for runner in runners:
            runner.close(timeout_s=1.0)


runner_pool = RunnerPool()


def _after_fork_in_child() -> None:
    """In a forked child (only the forking thread survives): drop the runners,
    registrations and locks it inherited; new runners are built on first use."""
    runner_pool.reset_after_fork()
    context.reset_after_fork()
    interpreter_exit.reset_after_fork()
    held_streams.reset_after_fork()
    tracing.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_default_runners() -> None:
    """Close the worker threads `dbo.overlap` created (they are recreated on next use)."""
    runner_pool.close_all()
