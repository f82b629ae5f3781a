"""Faults in one process: the table `test_faults.py` runs case by case, and as a script.

    python _one_process_faults.py        # every case in a fresh interpreter, then exits

Each case injects one fault into an overlapped call: an exception after k yields of
ubatch u (k = 0: before its first yield; k = its yield count: after its last; the
ubatches yield unequal numbers of times), the same in a ubatch's backward (the caller
of `backward()` gets it), inside a recv hook (run by the next ubatch, or pending until
the overlap returns), in `split`, in `merge`, a KeyboardInterrupt raised by a ubatch,
and a real SIGINT while the caller waits. `check(case)` asserts:
the caller gets the injected exception (the ubatch's id attached) within `MAX_DELAY_S`
of the fault; no worker thread is left inside a job; the threads are the baseline plus
the pooled runners' workers; and the next call gives the right result.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

import dbo.runtime.exit

MAX_DELAY_S = 1.0
"""The longest the caller may take to raise after the fault."""


class Injected(Exception):
    """The exception a case raises on purpose."""


@dataclass(frozen=True)
class Case:
    kind: str  # "yield", "backward", "recv_hook", "pending_hook", "split", "merge",
    # "ubatch_kbd", "sigint"
    num_ubatches: int = 2
    ubatch: int = 0
    after_yields: int = 0

    @property
    def id(self) -> str:
        if self.kind in ("yield", "backward"):
            where = "backward-" if self.kind == "backward" else ""
            return (f"{where}ubatch{self.ubatch}of{self.num_ubatches}-after{self.after_yields}"
                    "yields")
        return f"{self.kind}-ubatch{self.ubatch}of{self.num_ubatches}"


def num_yields(ubatch: int) -> int:
    return 2 + ubatch


def table() -> list[Case]:
    cases = [
        Case("yield", num, ubatch, k)
        for num in (2, 3) for ubatch in range(num) for k in range(num_yields(ubatch) + 1)
    ]
    cases += [
        Case("backward", 2, ubatch, k) for ubatch in range(2) for k in range(num_yields(ubatch) + 1)
    ]
    cases += [Case("recv_hook", 2, u) for u in (0, 1)] + [Case("pending_hook", 2, 1)]
    cases += [Case("split"), Case("merge"), Case("ubatch_kbd", 2, 1), Case("sigint", 2, 0)]
    return cases


def _fn(case: Case, fault_at: list[float]) -> Any:
    def fault(error: BaseException) -> None:
        fault_at.append(time.perf_counter())
        raise error

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        if case.kind == "recv_hook" and me == case.ubatch:
            dbo.register_recv_hook(lambda: fault(Injected(f"hook of ubatch {me}")))
        if case.kind == "pending_hook" and me == case.ubatch:
            dbo.register_recv_hook(lambda: fault(Injected("pending hook")))
            return x * 2
        yields = 400 if case.kind == "sigint" else num_yields(me)  # sigint: ~2 s, cut short
        for k in range(yields + 1):
            if me == case.ubatch and k == case.after_yields:
                if case.kind == "yield":
                    fault(Injected(f"ubatch {me} after {k} yields"))
                if case.kind == "ubatch_kbd":
                    fault(KeyboardInterrupt())
            if case.kind == "sigint":
                time.sleep(0.005)  # the caller is waiting when the signal comes
            if k < yields:
                dbo.yield_()
                dbo.maybe_run_recv_hook()
        return _BackwardFault.apply(x * 2, case, fault) if case.kind == "backward" else x * 2

    return fn


class _BackwardFault(torch.autograd.Function):
    """Identity whose backward yields as the forward does and raises where `case` says."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, case: Case, fault: Any) -> torch.Tensor:
        ctx.case, ctx.fault = case, fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        me = dbo.current_ubatch_id()
        for k in range(num_yields(me) + 1):
            if me == ctx.case.ubatch and k == ctx.case.after_yields:
                ctx.fault(Injected(f"ubatch {me} after {k} yields of its backward"))
            if k < num_yields(me):
                dbo.yield_()
        return grad, None, None


def _sigint_soon(fault_at: list[float]) -> threading.Timer:
    """SIGINT to this process in 0.1 s (Python's handler installed: a background job may
    start with SIGINT ignored); the caller restores the previous handler."""
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def send() -> None:
        fault_at.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.1, send)
    timer.start()
    return timer


def _split(case: Case, fault_at: list[float]) -> Any:
    def split(args: tuple[Any, ...], kwargs: dict[str, Any], num: int) -> Any:
        if case.kind == "split":
            fault_at.append(time.perf_counter())
            raise Injected("split")
        return dbo.default_split(args, kwargs, num)

    return split


def _merge(case: Case, fault_at: list[float]) -> Any:
    def merge(outputs: list[Any]) -> Any:
        if case.kind == "merge":
            fault_at.append(time.perf_counter())
            raise Injected("merge")
        return dbo.default_merge(outputs)

    return merge


def workers_in_a_job() -> list[str]:
    """The threads whose stack holds a ubatch job (a worker parked mid-run, or running)."""
    frames = sys._current_frames()
    busy = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        while frame is not None:
            if frame.f_code.co_name == "__call__" and frame.f_code.co_filename.endswith(
                "_worker.py"
            ):
                busy.append(thread.name)
                break
            frame = frame.f_back
    return busy


def pooled_worker_threads() -> set[threading.Thread]:
    """The worker threads of the runners `dbo.overlap` keeps idle."""
    pool = dbo.runtime.pool.runner_pool
    with pool._lock:
        return {thread for _, runner in pool._idle for thread in runner.threads}


def check(case: Case, baseline: set[threading.Thread]) -> None:
    """Run `case` once and assert what the module docstring says."""
    fault_at: list[float] = []
    step = dbo.overlap(
        _fn(case, fault_at), num_ubatches=case.num_ubatches, timeout_s=10.0,
        split=_split(case, fault_at), merge=_merge(case, fault_at),
    )
    x = torch.arange(4.0 * case.num_ubatches).reshape(2 * case.num_ubatches, 2)
    x.requires_grad_(case.kind == "backward")
    expected_type = KeyboardInterrupt if case.kind in ("ubatch_kbd", "sigint") else Injected
    previous_handler = signal.getsignal(signal.SIGINT)
    timer = _sigint_soon(fault_at) if case.kind == "sigint" else None
    try:
        y = step(x)
        if case.kind == "backward":
            y.sum().backward()
    except expected_type as error:
        caught_at = time.perf_counter()
        if case.kind in ("yield", "backward", "ubatch_kbd"):
            assert getattr(error, "ubatch_id", None) == case.ubatch, (case, error)
        if case.kind in ("yield", "backward"):
            assert f"after {case.after_yields} yields" in str(error), (case, error)
    else:
        raise AssertionError(f"{case.id}: no {expected_type.__name__}")
    finally:
        if timer is not None:
            timer.join(5.0)
            signal.signal(signal.SIGINT, previous_handler)
    assert len(fault_at) == 1, (case, fault_at)
    delay = caught_at - fault_at[0]
    assert delay < MAX_DELAY_S, f"{case.id}: the caller raised {delay:.3f} s after the fault"
    deadline = time.monotonic() + 2.0  # a closed runner's workers end after their job
    while True:
        busy = workers_in_a_job()
        extra = set(threading.enumerate()) - baseline - pooled_worker_threads()
        if (not busy and not extra) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not busy, f"{case.id}: workers still in a job: {busy}"
    assert not extra, f"{case.id}: threads beyond the baseline and the pool: {extra}"
    fault_at.clear()
    clean = dbo.overlap(_fn(Case("none", case.num_ubatches, -1), fault_at),
                        num_ubatches=case.num_ubatches, timeout_s=10.0)
    x.grad = None
    y = clean(x)
    assert torch.equal(y, x * 2), case
    if x.requires_grad:
        y.sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0)), case


def main() -> None:
    baseline = set(threading.enumerate())
    cases = table()
    for case in cases:
        check(case, baseline)
    # What the exit would wait for (`dbo.wait_at_exit`): nothing may be left running.
    assert not any(still_running(0) for still_running in dbo.runtime.exit._left_running)
    print(f"ok {len(cases)} cases {time.time()}", flush=True)


if __name__ == "__main__":
    main()
