"""Start gloo ranks as real scripts (`_rank_script.py`) and watch them end.

    ranks = run_ranks("fault", world_size=2, spec={...}, out_dir=tmp_path, limit_s=60)

The parent hosts the rendezvous store (a `TCPStore` on port 0 of 127.0.0.1: the kernel
picks a free port) and gives each rank the environment torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE so that every rank
is a client of this store), no visible GPU and one intra-op thread. Each rank runs in a
session of its own, so that "nothing left running" means its process group is empty.
The parent polls every 10 ms and notes when each process ended: the ranks exit through
the interpreter's own exit, and the tests read their exit codes. Past `limit_s`, or when
the caller leaves, every process still there is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

SCRIPT = Path(__file__).with_name("_rank_script.py")
POLL_S = 0.01


@dataclass
class RankRun:
    """How one rank's process went."""

    rank: int
    returncode: int | None
    """The exit status (negative: the signal that ended it); None: killed at the limit."""
    ended_at: float | None
    """time.time() when the parent saw the process gone (to within `POLL_S`)."""
    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the rank recorded (`_rank_script.record`), by event name."""
    stderr: str = ""
    left_running: bool = False
    """Whether a process of its group was still there after it ended."""

    def at(self, event: str) -> float:
        """When the rank recorded `event` (time.time()); KeyError if it never did."""
        return float(self.events[event]["t"])


def run_ranks(
    mode: str, world_size: int, spec: dict[str, Any], out_dir: Path, limit_s: float
) -> list[RankRun]:
    """Run `_rank_script.py MODE` on `world_size` ranks; wait (at most `limit_s`) for all
    of them to end; return how each went, in rank order."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    (out_dir / "spec.json").write_text(json.dumps(spec))
    processes: list[subprocess.Popen[bytes]] = []
    ended_at: dict[int, float] = {}
    try:
        for rank in range(world_size):
            env = {
                **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            }
            with open(out_dir / f"rank{rank}.err", "wb") as stderr:
                processes.append(subprocess.Popen(
                    [sys.executable, str(SCRIPT), mode, str(out_dir)], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                    start_new_session=True,
                ))
        deadline = time.monotonic() + limit_s
        while len(ended_at) < world_size and time.monotonic() < deadline:
            for rank, process in enumerate(processes):
                if rank not in ended_at and process.poll() is not None:
                    ended_at[rank] = time.time()
            time.sleep(POLL_S)
        left = {rank: _group_alive(process.pid) for rank, process in enumerate(processes)}
    finally:
        for process in processes:
            _kill_group(process)
        del store
    return [
        RankRun(
            rank, process.returncode if rank in ended_at else None, ended_at.get(rank),
            _events(out_dir / f"rank{rank}.jsonl"),
            (out_dir / f"rank{rank}.err").read_text(errors="replace"), left[rank],
        )
        for rank, process in enumerate(processes)
    ]


def _events(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["event"]: line for line in lines}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    if _group_alive(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5.0)


def describe(ranks: list[RankRun]) -> str:
    """Every rank's exit status, events and stderr tail, for an assertion message."""
    return "\n".join(
        f"--- rank {r.rank}: returncode {r.returncode}, events {r.events}\n{r.stderr[-3000:]}"
        for r in ranks
    )
