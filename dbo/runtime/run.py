"""One overlap run: the baton, each ubatch's streams, and the recv hooks.

A `UBatchRunner` creates an `OverlapRun` per call; ubatch threads reach it through
their registered `UBatchContext.run`, which is how the module-level functions
(`dbo.yield_()`, `dbo.switch_to_comm()`, ...) find the run they belong to.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dbo.device.backends import DeviceBackend
from dbo.errors import add_note
from dbo.runtime.baton import Baton
from dbo.runtime.wakeup import Wakeup


@dataclass
class UBatchStreams:
    """The two streams of one ubatch; the runner keeps them across runs."""

    compute: Any
    comm: Any


class _RecvHook(NamedTuple):
    owner: int
    """The ubatch that registered it, or whose hook did (a receive in stages)."""
    hook: Callable[[], Any]
    sent: Any
    """Recorded at registration on the registering thread's stream: the hook runs after it."""


_MAX_RECV_HOOK_ROUNDS = 100
"""Rounds of recv hooks, at most, that a ubatch runs at its end for a ubatch that has
returned, each round the ones the round before registered (a receive in stages): a hook
that keeps registering itself (a poll) fails the run instead of hanging it."""


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
        self._recv_hooks: list[list[_RecvHook]] = [[] for _ in range(num_ubatches)]
        """The hooks pending for each ubatch, in the order they were registered."""
        self._hook_owner: list[int | None] = [None] * num_ubatches
        """While ubatch k's thread runs a hook: its owner, who owns a stage it registers."""
        self._returned = [False] * num_ubatches
        """Ubatch k has run the hooks pending for it at its end: the ubatch before it
        runs the ones it registers from then on, at its own end."""
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

    def join_caller_stream(self, best_effort: bool) -> None:
        """After every ubatch has ended: order the caller's stream after the join events
        of every ubatch's streams; `best_effort` after a failure (a failed capture's
        streams raise on every use)."""
        for events in self.join_events:
            for event in events:
                with contextlib.suppress(Exception) if best_effort else contextlib.nullcontext():
                    self.backend.wait_event(self.caller_stream, event)

    def wait_for_every_ubatch(self, ubatch_id: int) -> None:
        """Order `ubatch_id`'s current stream after all that every ubatch has queued so far
        (an event recorded now on each of their streams). For work that touches what other
        ubatches wrote: the KV-cache rule brings the caller's cache up to date in the last
        ubatch's exit callback, and grows buffers that hold every ubatch's rows."""
        self.order_after_every_ubatch(self.backend.current_stream())

    def order_after_every_ubatch(self, stream: Any) -> None:
        """Order `stream` after all that every ubatch has queued so far (an event recorded
        now on each ubatch stream other than `stream`)."""
        backend = self.backend
        for streams in self.streams:
            for ubatch_stream in (streams.compute, streams.comm):
                if ubatch_stream is not stream:
                    backend.wait_event(stream, backend.record_event(ubatch_stream))

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
        for hooks in self._recv_hooks:
            hooks.clear()

    def finish_normally(self, ubatch_id: int) -> None:
        """At a ubatch's normal end, in its thread, round after round until a round leaves
        no exit callback (a hook may start a collective whose handle registers one): its
        exit callbacks, in order; the recv hooks pending for it; then, if the next ubatch
        has returned, the hooks registered for that one (nobody else will run them)."""
        callbacks = self._exit_callbacks[ubatch_id]
        after = (ubatch_id + 1) % self.num_ubatches  # the ubatch its hooks are for
        after_rounds = 0  # rounds of `after`'s hooks run here, in all
        while True:
            while callbacks:
                callbacks.pop(0)[0]()
            # A lone ubatch is its own `after`: its hooks run below. No limit here: a new
            # hook comes from the previous ubatch, which a hook yielded to.
            while after != ubatch_id and self.maybe_run_recv_hook(ubatch_id):
                pass
            self._returned[ubatch_id] = True
            if self._returned[after]:
                after_rounds = self._run_hooks_of_returned(after, ubatch_id, after_rounds)
            if not callbacks:  # no hook registered an exit callback
                break
        self._ended_normally[ubatch_id] = True

    def _run_hooks_of_returned(self, returned: int, running: int, rounds: int) -> int:
        """In `running`'s thread, run the hooks pending for `returned` (which has returned),
        round after round while they register more (a receive in stages); return `rounds`
        (those run before) plus those run now. RuntimeError when hooks are still pending
        after `_MAX_RECV_HOOK_ROUNDS` rounds: a hook that keeps registering itself (a poll)
        fails the run instead of hanging it."""
        while self.maybe_run_recv_hook(returned, running=running):
            rounds += 1
            if rounds >= _MAX_RECV_HOOK_ROUNDS and self._recv_hooks[returned]:
                raise RuntimeError(
                    f"recv hooks for ubatch {returned}, which has returned, kept registering "
                    f"new ones for {rounds} rounds at the end of ubatch {running}; a hook "
                    "that runs after its target has returned must complete its receive "
                    "(wait for it), not register itself again to poll"
                )
        return rounds

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
        """Queue `hook` for the next ubatch, after an event on the thread's current stream;
        registered from inside a hook, it belongs to that hook's owner."""
        owner = self._hook_owner[ubatch_id]
        sent = self.backend.record_event(self.backend.current_stream())
        self._recv_hooks[(ubatch_id + 1) % self.num_ubatches].append(
            _RecvHook(ubatch_id if owner is None else owner, hook, sent)
        )

    def maybe_run_recv_hook(self, ubatch_id: int, running: int | None = None) -> bool:
        """Run (once each, in order) the hooks pending for `ubatch_id` in the thread of
        `running` (default: `ubatch_id`); True if any ran. A failing hook's error names
        its owner; the hooks after it stay pending (`fn` may catch the error)."""
        pending = self._recv_hooks[ubatch_id]
        if not pending:
            return False
        self._recv_hooks[ubatch_id] = []
        for index, recv in enumerate(pending):
            try:
                self._run_hook(recv, ubatch_id if running is None else running)
            except BaseException as error:  # noqa: B036 - re-raised, with where it came from
                self._recv_hooks[ubatch_id][:0] = pending[index + 1 :]
                add_note(error, f"in a recv hook registered by ubatch {recv.owner}")
                raise
        return True

    def _run_hook(self, recv: _RecvHook, running: int) -> None:
        """Run one hook in `running`'s thread, after the event recorded at its registration.

        Another live ubatch's hook runs on that owner's comm stream, and the owner's compute
        stream then waits for it: no stream of one ubatch waits for the other's. The
        running ubatch's own hook, or one whose owner has ended (the caller joins its
        streams already), runs on the running thread's current stream.
        """
        backend, owner = self.backend, recv.owner
        previous = backend.current_stream()
        foreign = owner != running and not self.join_events[owner]
        stream = self.streams[owner].comm if foreign else previous
        outer_owner, self._hook_owner[running] = self._hook_owner[running], owner
        try:
            if foreign:
                backend.set_current_stream(stream)
            backend.wait_event(stream, recv.sent)
            recv.hook()
        finally:
            self._hook_owner[running] = outer_owner
            if foreign:
                backend.wait_event(self.streams[owner].compute, backend.record_event(stream))
                backend.set_current_stream(previous)
