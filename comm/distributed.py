"""Start-up and shut-down of torch.distributed as launched by `torchrun`.

    torchrun --nproc-per-node 2 script.py                        # one node, 2 processes
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST \\
             --master-port 29500 --nproc-per-node 8 script.py    # on each node (its rank)

`init_distributed()` reads the environment `torchrun` sets, picks NCCL for CUDA devices
and gloo otherwise, binds the process to its GPU, and creates the per-ubatch duplicate
groups of the default group (`comm.groups`).
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm._abandoned import settle
from comm.groups import destroy_ubatch_groups, group_registry, ubatch_groups

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective may wait for its peers before it raises (seconds)."""

MAX_TIMEOUT_S = 1e8
"""The longest timeout accepted: far larger values overflow inside torch.distributed."""

TORCHRUN_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What `torchrun` sets for each process and `init_distributed` reads."""


class TorchrunEnvironmentError(RuntimeError):
    """`init_distributed` ran without the environment `torchrun` sets."""


@dataclass
class _State:
    """What `init_distributed` decided, so that later calls return the same answer."""

    device: torch.device | None = None
    world: weakref.ref[dist.ProcessGroup] | None = None  # the default group they are about
    worlds_started: int = 0  # over the torchrun store: the next rendezvous prefix

    def is_current(self) -> bool:
        """Whether `device` and the default group's duplicates are the live world's."""
        return self.world is not None and self.world() is dist.GroupMember.WORLD


_state = _State()


def _torchrun_hint(missing: list[str]) -> str:
    # As typed, not its base name: the command is pasted where the program started.
    script = sys.argv[0] if sys.argv and sys.argv[0] else "your_script.py"
    return (
        f"comm.init_distributed() needs the environment that torchrun sets; missing: "
        f"{', '.join(missing)}. Launch with\n"
        f"    torchrun --nproc-per-node 2 {script}\n"
        f"or, over several nodes (run on each, with its --node-rank),\n"
        f"    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 "
        f"--nproc-per-node 8 {script}\n"
        "or pass allow_single_process=True to run as a world of one process"
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _ranks_from_env(allow_single_process: bool) -> tuple[bool, int, int, int]:
    """(single, RANK, WORLD_SIZE, LOCAL_RANK), checked against each other; a single
    process takes (0, 1, 0) for what its environment leaves out. A partial environment
    that says there are several ranks (WORLD_SIZE != 1, or a RANK or LOCAL_RANK != 0
    without it) is a launch mistake, never a world of one."""
    environ = os.environ
    missing = [name for name in TORCHRUN_ENV_VARS if name not in environ]
    if "WORLD_SIZE" in environ:
        several = environ["WORLD_SIZE"] != "1"
    else:
        several = "RANK" in environ or environ.get("LOCAL_RANK", "0") != "0"
    if missing and (several or not allow_single_process):
        raise TorchrunEnvironmentError(_torchrun_hint(missing))
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"environment variable RANK must be in [0, WORLD_SIZE={world_size}), got {rank}"
        )
    if local_rank < 0:
        raise ValueError(f"environment variable LOCAL_RANK must be >= 0, got {local_rank}")
    return bool(missing), rank, world_size, local_rank


def _resolve_device(
    device: torch.device | str | int | None, backend: str | None, local_rank: int
) -> torch.device:
    if device is None:
        wants_cpu = backend is not None and backend.lower() == "gloo"
        device = "cuda" if torch.cuda.is_available() and not wants_cpu else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", local_rank)
    return resolved


def init_distributed(
    backend: str | None = None,
    device: torch.device | str | int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    allow_single_process: bool = False,
    num_ubatch_groups: int = 2,
) -> tuple[int, int, torch.device]:
    """Initialize torch.distributed from the torchrun environment; return (rank, world, device).

    Args:
        backend: "nccl", "gloo", ...; None: NCCL for a CUDA device, gloo otherwise.
        device: None: `cuda:LOCAL_RANK` when CUDA is available (and the backend is not
            gloo), else CPU. A CUDA device becomes the current device.
        timeout_s: how long a collective waits for its peers before raising (a dead or
            diverged peer becomes an error, not a hang). In a world initialized
            elsewhere it applies only to the per-ubatch groups created here.
        allow_single_process: without the torchrun environment, initialize a world of one
            process (rank 0, an in-process store) instead of raising.
        num_ubatch_groups: per-ubatch duplicates of the default group to create
            (`comm.ubatch_groups`); 0 creates none, nor does a world of one.

    Idempotent: later calls return the same triple; a world initialized elsewhere is
    adopted (its duplicates created by the first call here, on every rank). A later call
    naming another backend or device raises ValueError; its other arguments are ignored.
    Raises `TorchrunEnvironmentError` (a RuntimeError) showing the torchrun command when
    the environment is missing or partial, ValueError for contradictory arguments or
    environment values, RuntimeError inside an overlap.
    """
    _check_arguments(backend, timeout_s, num_ubatch_groups)
    if dist.is_initialized():
        _adopt(backend, device)
    else:
        _init_process_group(backend, device, float(timeout_s), allow_single_process)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not _state.is_current():  # a new world, or one started elsewhere: adopt it
        group_registry().timeout_s = float(timeout_s)
        if num_ubatch_groups > 0 and world_size > 1:
            ubatch_groups(None, num_ubatch_groups)
        world_group = dist.GroupMember.WORLD
        _state.world = weakref.ref(world_group) if world_group is not None else None
    assert _state.device is not None, "set by the first initialization"
    return rank, world_size, _state.device


def _check_arguments(backend: Any, timeout_s: Any, num_ubatch_groups: Any) -> None:
    if dbo.enabled():
        raise RuntimeError(
            "comm.init_distributed() was called inside dbo.overlap; initialize once per "
            "process before overlapping (it creates process groups, a collective)"
        )
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'nccl' or 'gloo', got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise ValueError(
            f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s}"
        )
    if isinstance(num_ubatch_groups, bool) or not isinstance(num_ubatch_groups, int):
        raise TypeError(f"num_ubatch_groups must be an int >= 0, got {num_ubatch_groups!r}")
    if not 0 <= num_ubatch_groups <= dbo.MAX_NUM_UBATCHES:
        raise ValueError(
            f"num_ubatch_groups must be in [0, {dbo.MAX_NUM_UBATCHES}], got {num_ubatch_groups}"
        )


_START_ANOTHER = "call comm.destroy_distributed() on every rank first to start another"


def _adopt(backend: str | None, device: torch.device | str | int | None) -> None:
    """A live world: refuse (ValueError) a call that asks for another backend than it has,
    or another device than the first call chose; for a world started elsewhere (or again
    with torch's own calls), take this call's device."""
    if not _state.is_current():
        _state.device = None
    if backend is not None:
        initialized = str(dist.get_backend()).lower()  # "gloo", or "cpu:gloo,cuda:nccl"
        names = {part.rpartition(":")[2] for part in initialized.split(",")}
        if backend.lower() not in names | {initialized}:
            raise ValueError(
                f"comm.init_distributed(backend={backend!r}): torch.distributed is already "
                f"initialized with backend {initialized!r}; {_START_ANOTHER}"
            )
    current = _state.device
    if current is None:
        current = _state.device = _resolve_device(
            device, str(dist.get_backend()), _env_int("LOCAL_RANK", 0)
        )
        if current.type == "cuda":
            torch.cuda.set_device(current)
    elif device is not None:
        wanted = _resolve_device(device, backend, current.index or 0)
        if wanted != current and not (wanted.type == current.type == "cpu"):  # cpu:N is cpu
            raise ValueError(
                f"comm.init_distributed(device={device!r}): torch.distributed is already "
                f"initialized for device {current}; {_START_ANOTHER}"
            )


def _init_process_group(
    backend: str | None,
    device: torch.device | str | int | None,
    timeout_s: float,
    allow_single_process: bool,
) -> None:
    single, rank, world_size, local_rank = _ranks_from_env(allow_single_process)
    resolved = _resolve_device(device, backend, local_rank)
    if backend is None:
        backend = "nccl" if resolved.type == "cuda" else "gloo"
    if backend.lower() == "nccl" and resolved.type != "cuda":
        raise ValueError(
            f"backend 'nccl' needs a CUDA device, got device={resolved}; use backend='gloo' "
            "for CPU tensors"
        )
    options: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if resolved.type == "cuda":
        count = torch.cuda.device_count()
        if resolved.index is None or resolved.index >= count:
            raise ValueError(
                f"device {resolved} does not exist: this node has {count} CUDA device(s); "
                "start at most that many processes per node (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(resolved)
        options["device_id"] = resolved
    if single:
        options["store"] = dist.HashStore()
    else:
        # env://, under a prefix per world of this process: torchrun's store outlives a
        # world, and a new world's group names would read the old world's keys.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=options["timeout"]))
        store.set_timeout(options["timeout"])
        options["store"] = dist.PrefixStore(f"comm.world{_state.worlds_started}", store)
        _state.worlds_started += 1
    dist.init_process_group(backend, rank=rank, world_size=world_size, **options)
    _state.device = resolved


def destroy_distributed() -> None:
    """Settle abandoned collectives, destroy the per-ubatch groups and the default
    group. Idempotent; call it on every rank at the end (and before initializing again)."""
    if dbo.enabled():
        raise RuntimeError("comm.destroy_distributed() was called inside dbo.overlap")
    settle()  # the collectives an aborted ubatch left in flight end first
    destroy_ubatch_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.device = None
    _state.world = None
