"""One overlap run: the baton, each ubatch's streams, and the recv hooks.

A `UBatchRunner` creates an `OverlapRun` per call; ubatch threads reach it through
their registered `UBatchContext.run`, which is how the module-level functions
(`dbo.yield_()`, `dbo.switch_to_comm()`, ...) find the run they belong to.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dbo._wakeup import Wakeup
from dbo.baton import Baton
from dbo.device import DeviceBackend
from dbo.errors import add_note


@dataclass
class UBatchStreams:
    """The two streams of one ubatch; the runner keeps them across runs."""

    compute: Any
    comm: Any


_HOOK_POLL_LIMIT_S = 30.0
"""How long hooks for a ubatch that has returned may keep registering new ones (polling
for a receive) before the run fails."""


class OverlapRun:
    """Per-call state shared by the ubatch threads of one run."""

    def __init__(
        self,
        num_ubatches: int,
        backend: DeviceBackend,
        streams: list[UBatchStreams],
        owner: object | None,
        wakeups: Sequence[Wakeup] | None = None,
        parent: OverlapRun | None = None,
    ) -> None:
        self.num_ubatches = num_ubatches
        self.backend = backend
        self.streams = streams
        self._owner = weakref.ref(owner) if owner is not None else None
        """The runner that started this run, weakly: a broken runner keeps its aborted
        run, and a cycle would keep a dropped runner's threads until a gc pass."""
        self._parent = weakref.ref(parent) if parent is not None else None
        """The run whose ubatch thread started this one, weakly (its state is not this
        run's to keep): a run of any runner up this chain would wait for itself."""
        self.baton = Baton(num_ubatches, wakeups)
        self.on_comm = [False] * num_ubatches
        self._return_to: list[Any] = [None] * num_ubatches
        """The side stream each ubatch's `switch_to_comm` left (None: its compute stream),
        which its `switch_to_compute` returns to."""
        self.stream_lease: object = None
        """What holds the streams for the runner (a run still running keeps them held)."""
        self.caller_stream: Any = None
        """The stream current in the caller's thread; it joins the ubatch streams at the end."""
        self.fork_event: Any = None
        """Recorded on `caller_stream` at the start; every ubatch stream waits for it."""
        self.join_events: list[list[Any]] = [[] for _ in range(num_ubatches)]
        self._hooks_for: list[list[tuple[int, Callable[[], Any]]]] = [
            [] for _ in range(num_ubatches)
        ]
        """(owner, hook) pairs waiting for ubatch k, registered by the ubatch before it."""
        self._running_hook_owner: list[int | None] = [None] * num_ubatches
        """While ubatch k's thread runs a hook: the ubatch that hook belongs to, which
        also owns a stage the hook registers (a two-stage receive)."""
        self._finished = [False] * num_ubatches
        self._ended_normally = [False] * num_ubatches
        self._exit_callbacks: list[list[tuple[Callable[[], Any], Callable[[], Any] | None]]] = [
            [] for _ in range(num_ubatches)
        ]
        """(at a normal end, on failure) pairs; a pair is dropped once either runs."""
        self.first_failure: tuple[int, BaseException] | None = None
        """The ubatch that failed first and its exception (what the caller re-raises)."""
        self.state: dict[str, Any] = {}
        """`dbo.run_state()`, dropped with the run."""
        self.backward_states: list[dict[str, Any]] | None = None
        """Per ubatch `dbo.backward_state()` when each ubatch's backward runs in its own
        thread; None: the run's backward runs whole in one thread (`state`)."""

    @property
    def owner(self) -> object | None:
        """The runner that started this run (None once it is gone)."""
        return self._owner() if self._owner is not None else None

    @property
    def parent(self) -> OverlapRun | None:
        """The run whose ubatch thread started this one, if any (and still alive)."""
        return self._parent() if self._parent is not None else None

    # ------------------------------------------------------------------ thread lifetime
    def enter(self, ubatch_id: int) -> None:
        """In ubatch `ubatch_id`'s thread, before `fn`: fork its streams from the caller's."""
        streams = self.streams[ubatch_id]
        self.backend.enter_thread()
        self.backend.wait_event(streams.compute, self.fork_event)
        self.backend.wait_event(streams.comm, self.fork_event)
        self.backend.set_current_stream(streams.compute)
        self.on_comm[ubatch_id] = False
        self._return_to[ubatch_id] = None

    def exit(self, ubatch_id: int, previous_stream: Any) -> None:
        """After `fn`: after a failure, the failure callbacks (on the comm stream); record
        the events the caller's stream joins on; restore the stream, always. After a
        failure the join is best effort: a failed capture's events raise on every use,
        and the ubatch's own error is what the caller gets."""
        streams, failed = self.streams[ubatch_id], not self._ended_normally[ubatch_id]
        try:
            if failed:
                self.backend.set_current_stream(streams.comm)
                callbacks, self._exit_callbacks[ubatch_id] = self._exit_callbacks[ubatch_id], []
                for _, on_failure in callbacks:
                    if on_failure is not None:
                        with contextlib.suppress(Exception):  # the ubatch's error is reported
                            on_failure()
            with contextlib.suppress(Exception) if failed else contextlib.nullcontext():
                record = self.backend.record_event
                self.join_events[ubatch_id] = [record(streams.compute), record(streams.comm)]
        finally:
            self.backend.set_current_stream(previous_stream)

    def add_exit_callback(
        self, ubatch_id: int, callback: Callable[[], Any],
        on_failure: Callable[[], Any] | None = None,
    ) -> None:
        self._exit_callbacks[ubatch_id].append((callback, on_failure))

    def drop_leftovers(self) -> None:
        """After every ubatch has ended: forget the exit callbacks and recv hooks that an
        aborted ubatch left (they never run). The failed call's traceback holds this
        run, and they must not keep what they hold (an async comm handle) alive with it."""
        for callbacks in self._exit_callbacks:
            callbacks.clear()
        for hooks in self._hooks_for:
            hooks.clear()

    def finish_normally(self, ubatch_id: int) -> None:
        """At a ubatch's normal end, in its thread: its exit callbacks, in order, then the
        recv hooks still pending (`run_remaining_hooks`), again until neither registers
        more (a hook may start a collective whose handle registers a callback)."""
        callbacks = self._exit_callbacks[ubatch_id]
        while True:
            while callbacks:
                callbacks.pop(0)[0]()
            self.run_remaining_hooks(ubatch_id)
            if not callbacks:
                self._ended_normally[ubatch_id] = True
                return

    def run_remaining_hooks(self, ubatch_id: int) -> None:
        """At a ubatch's normal end: run the hooks pending for it until none is left (a
        hook that yields lets the previous ubatch register another), count it finished,
        then run the hooks it registered for a ubatch that has already finished (nobody
        else would), for at most `_HOOK_POLL_LIMIT_S` while they keep registering more."""
        while self.maybe_run_recv_hook(ubatch_id):
            pass  # no time limit: each new hook comes from the previous ubatch's progress
        self._finished[ubatch_id] = True
        target = (ubatch_id + 1) % self.num_ubatches
        deadline = None
        while self._finished[target] and self.maybe_run_recv_hook(target, running=ubatch_id):
            now = time.monotonic()
            if deadline is None:
                deadline = now + _HOOK_POLL_LIMIT_S
            elif now > deadline:
                raise RuntimeError(
                    f"recv hooks for ubatch {target}, which has returned, kept registering "
                    f"new hooks for {_HOOK_POLL_LIMIT_S:g} s; a hook that polls must finish "
                    "once its ubatch has returned"
                )
            time.sleep(0)  # let other threads run between polls

    # ------------------------------------------------------------------ ubatch-side API
    def current_stream(self, ubatch_id: int) -> Any:
        streams = self.streams[ubatch_id]
        return streams.comm if self.on_comm[ubatch_id] else streams.compute

    def switch_stream(self, ubatch_id: int, to_comm: bool, yield_first: bool) -> None:
        """Move `ubatch_id` to its comm (or compute) stream, ordered after the stream it
        leaves by an event recorded *before* any yield: it covers only this ubatch's work
        (after the yield it would cover the other's kernels and serialize the two).

        The stream left is the thread's real current stream: inside `with
        torch.cuda.stream(side)` it is `side`, and the switch back returns to `side`.
        """
        if self.on_comm[ubatch_id] == to_comm:
            where = "comm" if to_comm else "compute"
            raise RuntimeError(
                f"ubatch {ubatch_id} is already on its {where} stream; each switch_to_comm() "
                "must be matched by one switch_to_compute()"
            )
        streams, backend = self.streams[ubatch_id], self.backend
        leaving = backend.current_stream()
        if to_comm:
            entering = streams.comm
            on_compute = backend.stream_key(leaving) == backend.stream_key(streams.compute)
            self._return_to[ubatch_id] = None if on_compute else leaving
        else:
            entering = self._return_to[ubatch_id] or streams.compute
            self._return_to[ubatch_id] = None
        event = backend.record_event(leaving)
        if yield_first:
            self.baton.yield_(ubatch_id)
        backend.set_current_stream(entering)
        backend.wait_event(entering, event)
        self.on_comm[ubatch_id] = to_comm

    def register_recv_hook(self, ubatch_id: int, hook: Callable[[], Any]) -> None:
        """Queue `hook` for the next ubatch; registered from inside a hook, it belongs to
        that hook's owner."""
        owner = self._running_hook_owner[ubatch_id]
        owner = ubatch_id if owner is None else owner
        self._hooks_for[(ubatch_id + 1) % self.num_ubatches].append((owner, hook))

    def maybe_run_recv_hook(self, ubatch_id: int, running: int | None = None) -> bool:
        """Run (once each, in order) the hooks pending for `ubatch_id`; True if any ran.

        `running` is the ubatch whose thread runs them (default: `ubatch_id`). A hook of
        another ubatch runs on its owner's comm stream, ordered after the owner's compute
        or comm stream (not a side stream it parked on: unsupported), and the owner's
        compute stream then waits for it: neither ubatch's queue holds the other's work.
        A hook of the running ubatch, or of one that has ended (after its join events:
        the caller joins the owner's streams already), runs on the running thread's stream.
        """
        pending = self._hooks_for[ubatch_id]
        if not pending:
            return False
        self._hooks_for[ubatch_id] = []
        running = ubatch_id if running is None else running
        outer_owner = self._running_hook_owner[running]  # a hook may run hooks
        previous = self.backend.current_stream()
        try:
            for index, (owner, hook) in enumerate(pending):
                self._running_hook_owner[running] = owner
                foreign = owner != running and not self.join_events[owner]
                if foreign:
                    self._enter_comm_of(owner)
                elif owner != running:
                    for event in self.join_events[owner]:
                        self.backend.wait_event(previous, event)
                try:
                    hook()
                except BaseException as error:  # noqa: B036 - re-raised, with where it came from
                    # The ones after it stay queued (`fn` may catch the error and run them).
                    self._hooks_for[ubatch_id][:0] = pending[index + 1 :]
                    add_note(error, f"in a recv hook registered by ubatch {owner}")
                    raise
                finally:
                    self._running_hook_owner[running] = outer_owner
                    if foreign:
                        owner_streams = self.streams[owner]
                        done = self.backend.record_event(owner_streams.comm)
                        self.backend.wait_event(owner_streams.compute, done)
                        self.backend.set_current_stream(previous)  # for the next hook
        finally:
            self.backend.set_current_stream(previous)
        return True

    def _enter_comm_of(self, owner: int) -> None:
        """Make `owner`'s comm stream current, ordered after `owner`'s compute stream if
        that is where it is (it is parked: only its own work is there)."""
        streams = self.streams[owner]
        if not self.on_comm[owner]:
            self.backend.wait_event(streams.comm, self.backend.record_event(streams.compute))
        self.backend.set_current_stream(streams.comm)
