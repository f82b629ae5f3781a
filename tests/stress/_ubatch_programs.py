"""Random ubatch programs for the single-process stress tests, and their checks.

A `Schedule` is one overlapped call: a program (a tuple of `Op`) per ubatch and an
input batch. `OverlappedCaller` runs it with `dbo.overlap`; `run_serial` runs the same
ubatch parts one after another in the calling thread, where every dbo call is a no-op:
the reference output. Inside the overlap the ubatches append their turns, recv hooks
and ends to one event log (only the baton holder runs Python, so appends never race),
and `check_events` compares it with what the baton and the recv hooks promise.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

import comm
import dbo
from workspace import WorkspaceManager

FEATURES = 8
MODULUS = 97.0
"""Values stay integers in [0, 97): every op is exact in float32, in any order."""
WATCHDOG_S = 30.0
"""The overlap's `timeout_s`: a stuck baton fails the test instead of hanging it."""
MAX_YIELDS = 50
"""Yield points per ubatch, at most."""

KINDS = ("yield",) * 4 + (
    "compute", "sleep", "workspace", "link", "hook", "run_hooks", "nested", "switch",
)
"""Op kinds; yields weigh four times the others."""
SLEEP_US = (0, 1, 2, 5, 10, 20, 50, 1000)
WORKSPACE_BYTES = (0, 256, 1000, 4096, 16384, 65536, 131072, 262144)
"""Scratch bytes a `workspace` op asks for beside its saved rows: the capacity grows
whenever a ubatch asks for more than any before it."""
_WEIGHTS = (
    torch.tensor([[(3 * i + 5 * j) % 4 - 1 for j in range(FEATURES)] for i in range(FEATURES)]),
    torch.tensor([[(i * j + 1) % 3 - 1 for j in range(FEATURES)] for i in range(FEATURES)]),
)
WEIGHTS = tuple(w.to(torch.float32) for w in _WEIGHTS)
LINK = comm.EmulatedLink(latency_s=20e-6, bandwidth_bytes_per_s=1e9)
"""Shared by every schedule (and every caller thread): FIFO across all of them."""


@dataclass(frozen=True)
class Op:
    """One step of a ubatch program; `arg` in [0, 8) picks its variant."""

    kind: str
    arg: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.arg}"

    @property
    def num_yields(self) -> int:
        if self.kind in ("yield", "workspace", "nested"):
            return 1
        if self.kind == "link":
            return self.arg % 2
        if self.kind == "switch":
            return 0 if self.arg % 3 == 0 else 2
        return 0


Program = tuple[Op, ...]


def capped(ops: list[Op]) -> Program:
    """`ops` up to the last one that keeps the program within `MAX_YIELDS` yields."""
    kept: list[Op] = []
    yields = 0
    for op in ops:
        if yields + op.num_yields > MAX_YIELDS:
            break
        kept.append(op)
        yields += op.num_yields
    return tuple(kept)


def num_yields(program: Program) -> int:
    return sum(op.num_yields for op in program)


@dataclass(frozen=True)
class Schedule:
    """One overlapped call: `programs[i]` is ubatch i's; `batch` rows of `FEATURES`."""

    programs: tuple[Program, ...]
    batch: int
    seed: int

    @property
    def num_ubatches(self) -> int:
        return len(self.programs)

    def input(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        values = torch.randint(0, int(MODULUS), (self.batch, FEATURES), generator=generator)
        return values.to(torch.float32)


MAX_OPS = 64
"""Ops per program, at most (before the cap on yields): about 0.65 yields per op."""


def decode(data: bytes) -> Program:
    """One op per byte (cheap to draw; shrinking bytes towards 0 shrinks ops towards
    plain yields), capped at `MAX_YIELDS` yields."""
    return capped([Op(KINDS[b % len(KINDS)], b // len(KINDS) % 8) for b in data])


def programs(max_ops: int = MAX_OPS) -> st.SearchStrategy[Program]:
    """Programs of a uniformly drawn length (a plain list strategy favours short ones)."""
    lengths = st.integers(0, max_ops)
    return lengths.flatmap(lambda n: st.binary(min_size=n, max_size=n)).map(decode)


def schedules(num_ubatches: int, max_ops: int = MAX_OPS) -> st.SearchStrategy[Schedule]:
    """Schedules of `num_ubatches` ubatches; the batch splits unevenly as often as not."""
    return st.builds(
        Schedule,
        st.tuples(*[programs(max_ops)] * num_ubatches),
        st.integers(num_ubatches, 3 * num_ubatches + 1),
        st.integers(0, 2**16),
    )


@dataclass
class Record:
    """What one call's ubatches did, in order; `serial`: the reference run (no log)."""

    manager: WorkspaceManager
    serial: bool
    events: list[tuple[Any, ...]] = field(default_factory=list)
    turns: dict[int, int] = field(default_factory=dict)
    threads: dict[int, int] = field(default_factory=dict)
    num_hooks: int = 0

    def turn(self, ubatch_id: int) -> None:
        """Log the turn ubatch `ubatch_id` starts now (its start, or a yield's return)."""
        if not self.serial:
            step = self.turns.get(ubatch_id, 0)
            self.turns[ubatch_id] = step + 1
            self.events.append(("turn", ubatch_id, step))

    def yield_(self, ubatch_id: int) -> None:
        dbo.yield_()
        self.turn(ubatch_id)


def _compute(x: torch.Tensor, arg: int) -> torch.Tensor:
    return torch.remainder(x @ WEIGHTS[arg % 2] + arg, MODULUS)


def _workspace(x: torch.Tensor, ubatch_id: int, op: Op, step: int, rec: Record) -> torch.Tensor:
    """Park `x` and a pattern in the slot across a yield; both must come back untouched."""
    saved, scratch = rec.manager.get_simultaneous(
        ((x.shape[0], FEATURES), torch.float32), ((WORKSPACE_BYTES[op.arg],), torch.uint8)
    )
    saved.copy_(x)
    pattern = (ubatch_id * 67 + step) % 251 + 1
    scratch.fill_(pattern)
    rec.yield_(ubatch_id)
    if not (bool((scratch == pattern).all()) and torch.equal(saved, x)):
        raise AssertionError(
            f"ubatch {ubatch_id}: its workspace bytes changed across a yield at step {step} "
            f"(pattern {pattern}, {scratch.numel()} scratch bytes, capacity "
            f"{rec.manager.capacity_bytes})"
        )
    return torch.remainder(saved + 3, MODULUS)


def _nested(x: torch.Tensor, ubatch_id: int, op: Op, rec: Record) -> torch.Tensor:
    """An overlapped function called inside a ubatch runs inline in that ubatch."""
    thread = threading.current_thread()

    def inner(part: torch.Tensor) -> torch.Tensor:
        if not rec.serial and not (
            dbo.enabled()
            and dbo.current_ubatch_id() == ubatch_id
            and threading.current_thread() is thread
        ):
            raise AssertionError(f"a nested overlap in ubatch {ubatch_id} did not run inline")
        rec.yield_(ubatch_id)
        return torch.remainder(part * 2 + 5, MODULUS)

    if rec.serial:
        return inner(x)
    return dbo.overlap(inner, num_ubatches=2 + op.arg % 2, timeout_s=WATCHDOG_S)(x)


def _check_stream(rec: Record, ubatch_id: int, on_comm: bool) -> None:
    if dbo.on_comm_stream() != (on_comm and not rec.serial):
        raise AssertionError(f"ubatch {ubatch_id}: on_comm_stream() is not {on_comm}")


def _switch(x: torch.Tensor, ubatch_id: int, op: Op, rec: Record) -> torch.Tensor:
    """A switch_to_comm / switch_to_compute pair: plain, with yields, or mixed."""
    variant = op.arg % 3
    if variant == 1:
        dbo.yield_and_switch_to_comm()
        rec.turn(ubatch_id)
    else:
        dbo.switch_to_comm()
    _check_stream(rec, ubatch_id, on_comm=True)
    if variant == 2:
        rec.yield_(ubatch_id)
    x = _compute(x, op.arg)
    if variant == 0:
        dbo.switch_to_compute()
    else:
        dbo.yield_and_switch_to_compute()
        rec.turn(ubatch_id)
    _check_stream(rec, ubatch_id, on_comm=False)
    return x


def _register_hook(ubatch_id: int, rec: Record) -> None:
    seq = rec.num_hooks
    rec.num_hooks += 1
    rec.events.append(("reg", ubatch_id, seq))
    dbo.register_recv_hook(lambda: rec.events.append(("hook", ubatch_id, seq,
                                                      dbo.current_ubatch_id())))


def ubatch_body(x: torch.Tensor, ubatch_id: int, program: Program, rec: Record) -> torch.Tensor:
    """Run `program` on ubatch `ubatch_id`'s part `x`; the output depends on every op."""
    if not rec.serial:
        rec.threads[ubatch_id] = threading.get_ident()
    rec.turn(ubatch_id)
    for step, op in enumerate(program):
        kind = op.kind
        if kind == "yield":
            rec.yield_(ubatch_id)
        elif kind == "compute":
            x = _compute(x, op.arg)
        elif kind == "sleep":
            time.sleep(SLEEP_US[op.arg] * 1e-6)
        elif kind == "workspace":
            x = _workspace(x, ubatch_id, op, step, rec)
        elif kind == "link":
            handle = LINK.transfer(x)
            if op.arg % 2:
                rec.yield_(ubatch_id)
            x = torch.remainder(handle.wait() + 1, MODULUS)
        elif kind == "hook":
            _register_hook(ubatch_id, rec)
        elif kind == "run_hooks":
            ran = dbo.maybe_run_recv_hook()
            if not rec.serial:
                rec.events.append(("ran", ubatch_id, ran))
        elif kind == "nested":
            x = _nested(x, ubatch_id, op, rec)
        elif kind == "switch":
            x = _switch(x, ubatch_id, op, rec)
        else:
            raise AssertionError(f"unknown op {op!r}")
    if not rec.serial:
        rec.events.append(("end", ubatch_id))
    return x


class OverlappedCaller:
    """One overlapped function for schedules of `num_ubatches` ubatches, reused across
    calls: each call runs the programs of the schedule it is given."""

    def __init__(self, num_ubatches: int) -> None:
        self.num_ubatches = num_ubatches
        self._current: tuple[Schedule, Record] | None = None
        self._overlapped = dbo.overlap(self._ubatch, num_ubatches=num_ubatches,
                                       timeout_s=WATCHDOG_S)

    def _ubatch(self, part: torch.Tensor) -> torch.Tensor:
        assert self._current is not None, "a ubatch runs only inside a call"
        schedule, rec = self._current
        ubatch_id = dbo.current_ubatch_id()
        return ubatch_body(part, ubatch_id, schedule.programs[ubatch_id], rec)

    def __call__(self, schedule: Schedule, rec: Record) -> torch.Tensor:
        assert schedule.num_ubatches == self.num_ubatches, "a schedule for this caller"
        self._current = (schedule, rec)
        try:
            return self._overlapped(schedule.input())
        finally:
            self._current = None


def run_serial(schedule: Schedule, manager: WorkspaceManager) -> torch.Tensor:
    """The reference: the same ubatch parts one after another, in this thread."""
    rec = Record(manager, serial=True)
    parts = torch.tensor_split(schedule.input(), schedule.num_ubatches)
    return torch.cat([
        ubatch_body(part, i, program, rec)
        for i, (part, program) in enumerate(zip(parts, schedule.programs, strict=True))
    ])


def expected_turns(yields: list[int]) -> list[tuple[int, int]]:
    """The (ubatch id, step) turns the baton ring gives ubatches with these yield counts:
    0, 1, ..., n-1, 0, ..., skipping finished ones; a ubatch left alone keeps the turn."""
    num = len(yields)
    left, counts, live = list(yields), [1] + [0] * (num - 1), [True] * num
    turns, holder = [(0, 0)], 0
    while True:
        if left[holder] > 0:
            left[holder] -= 1
        else:
            live[holder] = False
        if not any(live):
            return turns
        holder = next(i % num for i in range(holder + 1, holder + num + 1) if live[i % num])
        turns.append((holder, counts[holder]))
        counts[holder] += 1


def check_events(schedule: Schedule, rec: Record) -> None:
    """The turns went round the ring; every recv hook ran once, in its owner's order, in
    the next ubatch's thread (or its owner's, registered after that one ended), before
    `maybe_run_recv_hook` returned in that ubatch; the ubatches had threads of their own."""
    num = schedule.num_ubatches
    turns = [(e[1], e[2]) for e in rec.events if e[0] == "turn"]
    expected = expected_turns([num_yields(p) for p in schedule.programs])
    if turns != expected:
        raise AssertionError(f"turns out of ring order:\n got {turns}\nwant {expected}")
    caller = threading.get_ident()
    if len(set(rec.threads.values())) != num or caller in rec.threads.values():
        raise AssertionError(f"ubatch threads {rec.threads} (caller {caller}) are not distinct")
    pending: list[list[int]] = [[] for _ in range(num)]
    ended = [False] * num
    registered_after_end: set[int] = set()
    for index, event in enumerate(rec.events):
        kind = event[0]
        if kind == "reg":
            owner, seq = event[1], event[2]
            target = (owner + 1) % num
            pending[target].append(seq)
            if ended[target]:
                registered_after_end.add(seq)
        elif kind == "hook":
            owner, seq, running = event[1], event[2], event[3]
            target = (owner + 1) % num
            if not pending[target] or pending[target][0] != seq:
                raise AssertionError(f"hook {seq} of ubatch {owner} ran out of order ({event})")
            pending[target].pop(0)
            want = owner if seq in registered_after_end else target
            if running != want:
                raise AssertionError(f"hook {seq} of ubatch {owner} ran in ubatch {running}, "
                                     f"not {want}")
        elif kind == "ran":
            ubatch_id, ran = event[1], event[2]
            ran_now = index > 0 and rec.events[index - 1][0] == "hook" and (
                rec.events[index - 1][3] == ubatch_id
            )
            if pending[ubatch_id] or ran != ran_now:
                raise AssertionError(f"maybe_run_recv_hook() in ubatch {ubatch_id} returned "
                                     f"{ran} with hooks {pending[ubatch_id]} left")
        elif kind == "end":
            ended[event[1]] = True
    if any(pending):
        raise AssertionError(f"recv hooks never ran: {pending}")


def check_schedule(
    schedule: Schedule, manager: WorkspaceManager, caller: OverlappedCaller | None = None
) -> None:
    """Run `schedule` overlapped (through `caller`, else a new wrapper), then serially:
    the outputs are bitwise equal and the events in order (AssertionError if not)."""
    rec = Record(manager, serial=False)
    output = (caller or OverlappedCaller(schedule.num_ubatches))(schedule, rec)
    check_events(schedule, rec)
    reference = run_serial(schedule, manager)
    if not torch.equal(output, reference):
        rows = (output != reference).any(dim=1).nonzero().flatten().tolist()
        raise AssertionError(f"overlapped output differs from the serial one in rows {rows}")
