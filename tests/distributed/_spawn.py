"""Run a function in N fresh processes that look like `torchrun` ranks (gloo on loopback).

    results = run_world(check_something, world_size=2, args=(...,), timeout_s=60)
    values = expect_ok(results)          # raises AssertionError with the ranks' tracebacks

Ranks are forked from one forkserver per test session, which imports torch, dbo, comm
and workspace once (`set_forkserver_preload`): a rank then starts in a fraction of a
second instead of importing torch afresh. Each rank takes the parent's environment as it
is at `run_world`, as a spawned process would.

The parent hosts the rendezvous store (a `TCPStore` bound to port 0 on 127.0.0.1, so
the kernel picks a free port and nobody can take it before the ranks connect) and
starts each rank with the environment torchrun gives it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE=True so that every rank is a
client of the parent's store, as under torchrun's agent), and with no GPU visible
(CUDA_VISIBLE_DEVICES empty, set before anything initializes CUDA): these are the gloo
tests, and on a machine with a GPU `comm.init_distributed()`'s defaults would otherwise
be NCCL on cuda:LOCAL_RANK. Each rank sets one intra-op thread and calls `fn(*args)`;
the function calls `comm.init_distributed()` itself.

Result passing: each rank sends one message on its own pipe: its return value, or the
exception's type name, message and traceback; `torch.save` bytes, so tensors travel too.
Every wait has a deadline: past `timeout_s` every rank still running is killed and
`run_world` raises TimeoutError saying which ranks reported. Ranks that reported but do
not exit within `exit_timeout_s` are killed and flagged (`exited` False).
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankResult:
    """What one rank reported."""

    rank: int
    ok: bool
    value: Any = None
    """fn's return value (ok) ."""
    error_type: str = ""
    """The exception's class name (not ok)."""
    error_message: str = ""
    traceback: str = ""
    exited: bool = True
    """False if the process had to be killed after reporting."""
    exit_code: int | None = None


_PRELOAD = ["torch", "torch.distributed", "dbo", "comm", "workspace"]


def _rank_main(
    fn: Callable[..., Any],
    args: Sequence[Any],
    environment: dict[str, str],
    rank: int,
    world_size: int,
    port: int,
    connection: multiprocessing.connection.Connection,
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        CUDA_VISIBLE_DEVICES="",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    exit_code = 0
    try:
        value = fn(*args)
        message: dict[str, Any] = {"ok": True, "value": value}
    except BaseException as error:  # noqa: B036 - report everything to the parent
        exit_code = 1
        message = {
            "ok": False,
            "error_type": type(error).__name__,
            "error_message": str(error),
            "traceback": traceback.format_exc(),
        }
    buffer = io.BytesIO()
    try:
        torch.save(message, buffer)
    except Exception as error:
        buffer = io.BytesIO()
        torch.save({"ok": False, "error_type": "PicklingError", "error_message": repr(error),
                    "traceback": ""}, buffer)
    connection.send_bytes(buffer.getvalue())
    connection.close()
    if exit_code == 0:
        # A clean shutdown on success; after a failure a peer may be gone and destroying
        # the groups could wait for it, so the process just ends.
        try:
            import comm

            comm.destroy_distributed()
        except Exception:
            exit_code = 2
    os._exit(exit_code)


def _parents_store(timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def start_together(timeout_s: float = 60.0) -> None:
    """Wait (in a rank) until every rank of the world has called this.

    For tests that initialize with a short collective timeout: process start-up times
    differ, and `init_process_group`'s rendezvous uses that timeout too. Uses the
    parent's store with its own key and timeout.
    """
    store = _parents_store(timeout_s)
    world_size = int(os.environ["WORLD_SIZE"])
    store.add("start_together", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("start_together", 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank started within {timeout_s} s")
        time.sleep(0.01)


def tell(key: str) -> None:
    """Set `key` in the parent's store (in a rank), for `wait_for` in the others."""
    _parents_store(10.0).set(key, "1")


def wait_for(key: str, timeout_s: float = 60.0) -> None:
    """Wait (in a rank) until some rank has called `tell(key)`; raises past `timeout_s`."""
    _parents_store(timeout_s).wait([key])


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    exit_timeout_s: float = 10.0,
) -> list[RankResult]:
    """Run `fn(*args)` on `world_size` spawned ranks; return their results in rank order.

    `fn` must be importable by name (a module-level function). Raises TimeoutError (after
    killing every process) if some rank has not reported within `timeout_s`.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    processes = []
    receivers: dict[int, multiprocessing.connection.Connection] = {}
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(fn, tuple(args), dict(os.environ), rank, world_size, store.port, sender),
                name=f"rank{rank}",
                daemon=True,
            )
            process.start()
            sender.close()  # the child holds the only write end: EOF when it dies
            processes.append(process)
            receivers[rank] = receiver
        results = _collect(receivers, processes, timeout_s)
        deadline = time.monotonic() + exit_timeout_s
        for result, process in zip(results, processes):
            process.join(max(0.0, deadline - time.monotonic()))
            result.exited = not process.is_alive()
            result.exit_code = process.exitcode
        return results
    finally:
        for process in processes:
            _kill(process)
        for receiver in receivers.values():
            receiver.close()
        del store


def _collect(
    receivers: dict[int, multiprocessing.connection.Connection],
    processes: list[Any],
    timeout_s: float,
) -> list[RankResult]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, RankResult] = {}
    pending = dict(receivers)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for process in processes:
                _kill(process)
            reported = {rank: ("ok" if r.ok else r.error_type) for rank, r in results.items()}
            raise TimeoutError(
                f"ranks {sorted(pending)} did not report within {timeout_s} s (killed); "
                f"reported: {reported}"
            )
        by_connection = {id(connection): rank for rank, connection in pending.items()}
        for connection in multiprocessing.connection.wait(list(pending.values()), remaining):
            rank = by_connection[id(connection)]
            del pending[rank]
            try:
                message = torch.load(io.BytesIO(connection.recv_bytes()), weights_only=False)
            except EOFError:
                processes[rank].join(1.0)
                results[rank] = RankResult(
                    rank, ok=False, error_type="ProcessDied",
                    error_message=f"rank {rank} exited (code {processes[rank].exitcode}) "
                    "without reporting",
                )
                continue
            results[rank] = RankResult(
                rank,
                ok=message["ok"],
                value=message.get("value"),
                error_type=message.get("error_type", ""),
                error_message=message.get("error_message", ""),
                traceback=message.get("traceback", ""),
            )
    return [results[rank] for rank in range(len(processes))]


def _kill(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join(2.0)


def expect_ok(results: list[RankResult]) -> list[Any]:
    """The ranks' return values; AssertionError with every failed rank's traceback."""
    failed = [r for r in results if not r.ok]
    if failed:
        details = "\n".join(
            f"--- rank {r.rank}: {r.error_type}: {r.error_message}\n{r.traceback}" for r in failed
        )
        raise AssertionError(f"{len(failed)} of {len(results)} ranks failed:\n{details}")
    return [r.value for r in results]
