"""The calls made inside `fn` (all cheap no-ops outside an overlap): yields, stream
switches, receive hooks, exit callbacks, the run's shared state, `capturing()`, and
`yield_between`'s yield points between modules.

Each function looks up the calling thread's registered ubatch; a thread that is not a
ubatch thread of a running overlap (the caller, a helper thread) is "outside", so the
same model code runs with or without DBO.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dbo import tracing
from dbo._torch_private import profiling as profiler_records
from dbo.runtime.context import thread_state

if TYPE_CHECKING:
    from dbo.runtime.run import OverlapRun


def _run_and_id() -> tuple[OverlapRun | None, int]:
    context = thread_state.context
    return (None, 0) if context is None else (context.run, context.ubatch_id)


def _switch(to_comm: bool, yield_first: bool) -> None:
    if torch.compiler.is_compiling():  # run it outside the graph: a graph break
        return torch.compiler.disable(_switch)(to_comm, yield_first)
    run, ubatch_id = _run_and_id()
    if run is not None:
        run.switch_stream(ubatch_id, to_comm=to_comm, yield_first=yield_first)


def current_ubatch_id() -> int:
    """The calling thread's ubatch id: i in ubatch i's thread, 0 outside an overlap
    (the caller and helper threads get 0 even while an overlap runs)."""
    context = thread_state.context
    return 0 if context is None else context.ubatch_id


def enabled() -> bool:
    """True in a ubatch thread of a running overlap; False everywhere else."""
    return thread_state.context is not None


def num_ubatches() -> int:
    """The number of ubatches of the running overlap; 1 outside an overlap."""
    context = thread_state.context
    return 1 if context is None else context.num_ubatches


def run_state() -> dict[str, Any] | None:
    """A dict shared by the ubatch threads of the running overlap; None outside one
    (the caller, helper threads).

    One fresh dict per run (`dbo.overlap` call or `UBatchRunner.run`), dropped when it
    ends, for library code whose ubatches must agree on something within one run. Only
    the baton holder runs Python, so a read-modify-write without a yield in between is
    atomic with respect to the other ubatches. Use keys named after your package.
    """
    context = thread_state.context
    return None if context is None or context.run is None else context.run.state


def backward_state() -> dict[str, Any] | None:
    """A dict shared by the ubatch code whose autograd backward runs as one sequence in
    one thread; None outside an overlap.

    For library code that must run its backward collectives in one order on every rank
    (`comm.moe` chains its exchanges through it): this ubatch's own dict when each
    ubatch's backward runs as its own sequence (`dbo.overlap` under grad mode, in its
    thread, or in turn under FSDP2), else the run's (`run_state()`:
    `overlap_backward=False`, a `UBatchRunner`).
    """
    run, ubatch_id = _run_and_id()
    if run is None:
        return None
    return run.state if run.backward_states is None else run.backward_states[ubatch_id]


def yield_() -> None:
    """Pass the baton to the next live ubatch; return when it comes back.

    Returns at once when this is the only live ubatch. Raises `UBatchAbortedError` if the
    overlap is being aborted (another ubatch failed). Outside an overlap: no-op.
    """
    if torch.compiler.is_compiling():  # run it outside the graph: a graph break
        return torch.compiler.disable(yield_)()
    context = thread_state.context
    if context is not None and context.run is not None:
        context.run.baton.yield_(context.ubatch_id)
    return None


def switch_to_comm() -> None:
    """Make this ubatch's comm stream current, ordered by an event (CUDA) after the work
    of the thread's current stream: its compute stream, or a side stream entered with
    `torch.cuda.stream(side)`. No yield. RuntimeError if the ubatch is already on its
    comm stream. Outside an overlap: no-op."""
    _switch(to_comm=True, yield_first=False)


def switch_to_compute() -> None:
    """Return from the comm stream to the stream `switch_to_comm` left (the compute
    stream, or that side stream), ordered after the comm stream's work. Pair the two
    inside one `with torch.cuda.stream(...)` block. RuntimeError if the ubatch is already
    on its compute stream. Outside an overlap: no-op."""
    _switch(to_comm=False, yield_first=False)


def yield_and_switch_to_comm() -> None:
    """Record an event on the compute stream, yield, then switch to the comm stream.

    The usual step before a collective: the other ubatch computes meanwhile, and the
    event (recorded before the yield) covers only this ubatch's compute. Outside an
    overlap: no-op.
    """
    _switch(to_comm=True, yield_first=True)


def yield_and_switch_to_compute() -> None:
    """Record an event on the comm stream, yield, then switch to the compute stream.

    The usual step after launching a collective: the other ubatch runs while this one's
    communication is in flight. Outside an overlap: no-op.
    """
    _switch(to_comm=False, yield_first=True)


def current_stream() -> Any:
    """The ubatch stream this ubatch is on, compute or comm (a `torch.cuda.Stream`, or a
    `CpuStream` on CPU), not a side stream it entered; None outside an overlap."""
    run, ubatch_id = _run_and_id()
    return None if run is None else run.current_stream(ubatch_id)


def on_comm_stream() -> bool:
    """True if this ubatch is on its comm stream; False on compute or outside an overlap."""
    run, ubatch_id = _run_and_id()
    return False if run is None else bool(run.on_comm[ubatch_id])


def at_ubatch_exit(
    callback: Callable[[], Any], *, on_failure: Callable[[], Any] | None = None
) -> bool:
    """Run `callback` in this ubatch's thread when its function returns normally, before
    the caller's stream joins this ubatch's streams; True if registered, False (nothing
    registered) outside an overlap. TypeError if either is not callable.

    For library code that leaves work in flight (an async collective's handle), so that
    the end of the overlap covers it. Callbacks run in registration order; an exception
    in one fails the overlap. When the ubatch raised or was aborted, `on_failure` runs
    instead, on the ubatch's comm stream, to join device work left in flight into the
    ubatch's streams without blocking; its exceptions are dropped.
    """
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {callback!r}")
    if on_failure is not None and not callable(on_failure):
        raise TypeError(f"on_failure must be callable or None, got {on_failure!r}")
    run, ubatch_id = _run_and_id()
    if run is None:
        return False
    run.add_exit_callback(ubatch_id, callback, on_failure)
    return True


def wait_for_every_ubatch() -> None:
    """Order this ubatch's current stream after all that every ubatch of the overlap has
    queued so far; nothing outside one. For library code that reads or writes what other
    ubatches wrote (`dbo`'s KV-cache rule: a shared buffer, the caller's cache at the end)."""
    run, ubatch_id = _run_and_id()
    if run is not None:
        run.wait_for_every_ubatch(ubatch_id)


def stream_mark() -> Any:
    """An event recorded now on this ubatch's current stream: what it has queued so far
    (None outside an overlap). For library code whose device work another ubatch must
    follow (`follow_mark`): `dbo`'s KV-cache rule marks the zero fill of a cache layer
    one ubatch makes for every row."""
    run, _ = _run_and_id()
    return None if run is None else run.backend.record_event(run.backend.current_stream())


def follow_mark(mark: Any) -> None:
    """Order this ubatch's current stream after `mark` (from `stream_mark`; None: nothing)."""
    run, _ = _run_and_id()
    if run is not None and mark is not None:
        run.backend.wait_event(run.backend.current_stream(), mark)


def register_recv_hook(hook: Callable[[], Any]) -> None:
    """Hand `hook` to the next ubatch in the ring, to run at its `maybe_run_recv_hook()`.

    The pattern of low-latency all-to-all kernels that split send and receive: ubatch i
    sends, registers the receive, yields; ubatch i+1 runs it in its own thread at its
    next `maybe_run_recv_hook()`. Streams: the hook runs after an event recorded now on
    this thread's current stream (it sees the send), on this ubatch's comm stream (not
    behind the running ubatch's work), and this ubatch's compute stream then waits for
    it (inside `with torch.cuda.stream(side):`, `side` does not); a hook must not switch
    streams. Once this ubatch has returned, its hooks run on the running ubatch's stream.

    A hook registered from inside a hook belongs to that hook's ubatch (a receive in
    stages). Hooks still pending at the end run before the overlap returns (those for a
    ubatch that has returned, at the end of the ubatch that registered them), with the
    ones they register, for at most 100 rounds (RuntimeError: a hook that keeps
    registering itself to poll). An exception in a hook fails the overlap, with a note
    naming the ubatch that registered it.
    Outside an overlap the hook runs at once (dropping it would lose the receive).
    TypeError if `hook` is not callable.
    """
    if not callable(hook):
        raise TypeError(f"hook must be callable, got {hook!r}")
    run, ubatch_id = _run_and_id()
    if run is None:
        hook()
    else:
        run.register_recv_hook(ubatch_id, hook)


def maybe_run_recv_hook() -> bool:
    """Run, in this thread and in the order they were registered, the recv hooks the
    previous ubatch registered for this one, once each; True if any ran.

    An exception propagates with a note naming the ubatch that registered the hook; the
    hooks after it stay pending (a later call runs them). Outside an overlap: False.
    """
    run, ubatch_id = _run_and_id()
    return False if run is None else run.maybe_run_recv_hook(ubatch_id)


def blocking_wait(wait: Callable[..., Any], name: str, *args: Any) -> Any:
    """`wait(*args)`, recorded as a span "wait <name>" (time blocked: communication not
    hidden) on the calling thread's ubatch track, the caller's outside an overlap, when a
    `dbo.trace()` records, and as a `torch.profiler` range when one profiles; nothing
    more otherwise. For library code that waits for communication (`comm` does)."""
    recording, profiling = tracing.recording, profiler_records()
    if recording is None and not profiling:
        return wait(*args)
    context = thread_state.context
    track = context.ubatch_id if context is not None else tracing.CALLER
    start = time.perf_counter()
    profile_range = tracing.begin_range(track, f"wait {name}") if profiling else None
    try:
        return wait(*args)
    finally:
        tracing.end_range(profile_range)
        if recording is not None:  # interned: up to a million spans share one label
            recording.add(sys.intern(f"wait {name}"), track, start, time.perf_counter())


IN_CAPTURE = "dbo.capture_graph"
"""The `run_state()` key that marks the runs of `dbo.capture_graph`, warmup included."""


def capturing() -> bool:
    """Whether this call is part of a CUDA-graph capture: from a ubatch of a
    `capture_graph` run (its warmup included, so that a refusal comes before anything is
    captured) or on a capturing CUDA stream. For library code that cannot be captured
    (host reads, shapes that depend on the data) to refuse with its own message."""
    state = run_state()
    return bool(state is not None and state.get(IN_CAPTURE)) or (
        torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    )


@dataclass(eq=False)  # hashable, compared by identity like the handles
class YieldHooks:
    """The forward pre-hooks `yield_between` registered (`handles`); `remove()` them all."""

    handles: list[torch.utils.hooks.RemovableHandle]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def yield_between(modules: Iterable[torch.nn.Module]) -> YieldHooks:
    """Make every module but the first call `dbo.yield_()` before its forward (a forward
    pre-hook): inside an overlap the baton passes between consecutive modules (the
    layers of `model.model.layers`); outside one the hooks do nothing."""
    hook = lambda module, args: yield_()  # noqa: E731 - one hook object for every module
    return YieldHooks([m.register_forward_pre_hook(hook) for m in list(modules)[1:]])
