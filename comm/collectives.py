"""DBO-aware collectives with the torch.distributed signatures.

Outside an overlap each is the plain torch.distributed op (with `async_op=True`, a
`CollectiveWork` wrapping torch's `Work`). Inside an overlap a blocking call moves to the
ubatch's comm stream (CUDA only), launches asynchronously on the ubatch's duplicate group
(`comm.groups`; else the base group), `record_stream`s its CUDA tensors, yields once,
waits (CUDA: the stream, not the host) and moves back (a caller already on its comm stream
stays there). With `async_op=True` the launch returns at once, and the handle's first
`wait()` yields, then waits. The yields never depend on timing (do not branch on
`is_completed()` inside an overlap): the launch order depends only on the program.

Arguments are checked on the host before anything is launched (TypeError / ValueError
naming the values): a refused call launches nothing, and its peers wait until the group's
timeout. Split sizes agreeing between ranks cannot be checked locally.

A call on a side stream follows that stream's work, and it follows the call, as in
torch.distributed. A collective an aborted ubatch never waited is joined into its streams
on NCCL, left to `comm._abandoned` on gloo. Compiled: one node each (`comm.compiled`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm import compiled
from comm._abandoned import abandon, is_over
from comm._checks import (
    check_all_to_all,
    check_async_op,
    check_pair,
    require_backend_device,
    require_contiguous,
    require_reduce_op,
    require_tensor,
    require_world_chunks,
    resolve_group_and_facts,
    runs_on_nccl,
)
from comm.groups import group_registry

ReduceOp = dist.ReduceOp
_registry = group_registry()

# `all_gather_single` / `reduce_scatter_single`: the names since torch 2.13 (older: the old).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveWork:
    """An in-flight collective launched with `async_op=True`.

    `wait()` returns True, as torch's `Work.wait`; inside the launching overlap its first
    call yields once first. CUDA: the *current* stream waits (not the host); gloo: the
    host blocks (GIL released). The tensors stay referenced until a wait has ended. A
    failed wait (a peer's failure, the group's timeout, an abort at the yield) raises the
    original error, every later wait a RuntimeError (chained to the collective's error; an
    abort keeps only its message, since its traceback holds the ubatch's tensors); only a
    wait's own `timeout` passing leaves the handle in flight. `get_future()` and `result()`
    are the `Work`'s (no yield, not a wait). A handle still in flight when its ubatch's
    function returns is waited then (no yield).
    """

    __slots__ = ("_work", "_tensors", "_yields", "_nccl", "_waited", "_done", "_error",
                 "_exit_cell", "_name")

    def __init__(
        self, work: Any, tensors: Sequence[torch.Tensor], yields: bool,
        name: str = "collective", nccl: bool = False,
    ) -> None:
        self._work = work
        self._tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self._yields = yields
        self._nccl = nccl  # NCCL runs it: its wait is a stream wait, not a host one
        self._waited = False  # a wait() began: later ones never yield
        self._done = False
        self._error: BaseException | str | None = None
        self._exit_cell: weakref.ref[_ExitCell] | None = None
        self._name = name

    @property
    def work(self) -> Any:
        """The underlying `torch.distributed.Work`."""
        return self._work

    def is_completed(self) -> bool:
        """Whether the collective has finished (diagnostics only inside an overlap)."""
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        """The underlying `Work.get_future()`: a `torch.futures.Future`."""
        return self._work.get_future()

    def result(self) -> Any:
        """The underlying `Work.result()` (the collective's output tensors)."""
        return self._work.result()

    def wait(self, timeout: timedelta | None = None, *, yield_first: bool = True) -> bool:
        """Yield (first call only, inside the launching overlap, if `yield_first`), wait,
        return True. `timeout`: a `datetime.timedelta` for torch's `Work.wait` (None: the
        group's timeout). `yield_first=False` waits without letting the other ubatches run
        first; choose it in the program, never from timing."""
        if isinstance(self._error, str):
            raise RuntimeError(f"the collective {self._name} was abandoned: {self._error}")
        if self._error is not None:
            raise RuntimeError(
                f"the collective {self._name} failed: {_described(self._error)}"
            ) from self._error
        if self._done:
            return True
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(
                f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}"
            )
        yields = self._yields and yield_first and not self._waited
        self._waited = True  # only the first wait may yield, whatever it was asked
        if yields and dbo.enabled():
            try:
                dbo.yield_()
            except BaseException as error:
                _leave_in_flight(self._work, self._nccl)  # aborted
                self._fail(_described(error))
                raise
        timeout_args = () if timeout is None else (timeout,)  # Work.wait takes no None
        try:
            dbo.blocking_wait(self._work.wait, self._name, *timeout_args)
        except BaseException as error:
            if timeout is not None and not is_over(self._work):
                raise  # only the caller's timeout passed: still in flight, as torch's Work
            self._fail(error)
            raise
        self._done = True
        self._release()
        return True

    def _fail(self, error: BaseException | str) -> None:
        self._error = error
        self._release()

    def _release(self) -> None:
        self._tensors = ()
        cell = self._exit_cell() if self._exit_cell is not None else None
        if cell is not None:
            cell.handle = None

    def __del__(self) -> None:
        # Dropped before any wait finished: the collective may still run, so the
        # process must not end before it does (comm._abandoned).
        try:
            if not self._done and self._error is None and not self._nccl:
                abandon(self._work)  # no stream to join it into here
        except Exception:  # noqa: BLE001, S110 - at interpreter exit anything may be gone
            pass

    def __repr__(self) -> str:
        if self._error is not None:
            state = "abandoned" if isinstance(self._error, str) else (
                f"failed: {type(self._error).__name__}"
            )
        else:
            state = "waited" if self._done else "in flight"
        return f"CollectiveWork({state}, yields={self._yields})"


def _on_nccl(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether it runs on NCCL: asked for a handle or an abort, not on a blocking call."""
    return any(runs_on_nccl(group, tensor) for tensor in tensors)


def _leave_in_flight(work: Any, nccl: bool) -> None:
    """An aborted ubatch leaves `work` unwaited. NCCL: the current stream (and so the
    caller's) waits for it, not the host. Others (gloo's wait blocks the host): abandoned."""
    if nccl:
        with contextlib.suppress(Exception):  # a failed collective is over: nothing to join
            work.wait()
    else:
        abandon(work)


class _ExitCell:
    """Holds an async handle for the wait at its ubatch's end until the handle's own wait
    empties it; the handle refers to it weakly (an aborted ubatch's handle is freed at once)."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle: CollectiveWork) -> None:
        self.handle: CollectiveWork | None = handle

    def __call__(self) -> None:
        """At the ubatch's end: wait the handle unless its own wait emptied the cell."""
        if self.handle is not None:
            self.handle.wait(yield_first=False)

    def leave(self) -> None:
        """At the end of a ubatch that failed: leave the handle in flight, joined into the
        ubatch's streams on CUDA (`_leave_in_flight`); its waits then raise."""
        handle = self.handle
        if handle is not None:
            _leave_in_flight(handle._work, handle._nccl)
            handle._fail("its ubatch failed before waiting it")


def _run(
    name: str,
    launch: Callable[..., Any],
    args: tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    async_op: bool,
) -> CollectiveWork | None:
    """Launch a checked collective, `launch(*args, group, async_op)`, DBO-aware inside an
    overlap (module docstring). `launch` is torch.distributed's public function (its last
    two parameters are `group` and `async_op`), which checks the arguments again."""
    stream = dbo.current_stream()  # None outside an overlap
    if stream is None and not async_op:
        dbo.blocking_wait(launch, name, *args, group, False)  # the plain blocking op
        return None
    if stream is None:
        work = launch(*args, group, True)
        return CollectiveWork(work, tensors, False, name, _on_nccl(group, tensors))
    ubatch_group = _registry.lookup(group, dbo.current_ubatch_id(), dbo.num_ubatches())
    on_cuda = isinstance(stream, torch.cuda.Stream)  # CPU: nothing to move or protect
    switched = on_cuda and not dbo.on_comm_stream()
    if switched:
        dbo.switch_to_comm()
    try:
        work = launch(*args, ubatch_group, True)
        if on_cuda:  # keep the caching allocator from reusing them before the comm stream
            comm_stream = dbo.current_stream()
            for tensor in tensors:
                if tensor.is_cuda:
                    tensor.record_stream(comm_stream)
        if async_op:
            handle = CollectiveWork(work, tensors, True, name, _on_nccl(group, tensors))
            # Waited at the ubatch's end if never waited, so the overlap's end covers it.
            cell = _ExitCell(handle)
            handle._exit_cell = weakref.ref(cell)
            dbo.at_ubatch_exit(cell, on_failure=cell.leave)
            return handle
        try:
            dbo.yield_()  # the other ubatches run while this transfer is in flight
        except BaseException:
            _leave_in_flight(work, _on_nccl(group, tensors))  # aborted, on the comm stream
            raise
        dbo.blocking_wait(work.wait, name)
        return None
    finally:
        if switched:
            dbo.switch_to_compute()


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Scatter rows of `input` to the ranks of `group`; gather theirs into `output`.

    `input` [sum(input_split_sizes), *row] and `output` [sum(output_split_sizes), *row]:
    same dtype, device and row shape, contiguous, no byte in common (ValueError). Rank r
    gets the r-th part of `input` (by `input_split_sizes`), and the r-th part of `output`
    (by `output_split_sizes`) is rank r's. Split sizes: one int >= 0 per rank; None means
    equal parts. `output` is written when the call returns (blocking) or once `wait()`
    returns (`async_op=True`).

    Outside an overlap: `torch.distributed.all_to_all_single`; inside: module docstring.
    """
    if compiled.traced(async_op):
        return compiled.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group)
    base, facts = resolve_group_and_facts(group)
    async_op = check_async_op(async_op)
    output, input = check_pair(output, input, facts.is_nccl)
    output_splits, input_splits = check_all_to_all(
        output, input, output_split_sizes, input_split_sizes, facts.size
    )
    return _run(
        "all_to_all_single", dist.all_to_all_single,
        (output, input, output_splits, input_splits), (output, input), base, async_op,
    )


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Reduce `tensor` over the ranks of `group` with `op`, in place.

    Any shape, contiguous (row-major, or channels_last); every rank passes the same shape
    and dtype. `ReduceOp.AVG` of an integer tensor is refused (TypeError) except on NCCL.

    Outside an overlap: `torch.distributed.all_reduce`; inside: module docstring.
    """
    if compiled.traced(async_op):
        return compiled.all_reduce(tensor, op, group)
    base, facts = resolve_group_and_facts(group)
    async_op = check_async_op(async_op)
    tensor = require_tensor("tensor", tensor)
    require_reduce_op(op, tensor.dtype, facts.is_nccl)
    require_contiguous("tensor", tensor, any_memory_format=True)
    require_backend_device("tensor", tensor, facts.is_nccl)
    return _run("all_reduce", dist.all_reduce, (tensor, op), (tensor,), base, async_op)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Gather every rank's `input` into `output`: rank r's is the r-th chunk.

    `output` holds `world_size * input.numel()` elements, same dtype and device, both
    contiguous. Every backend takes `input` [n, *rest] with `output` [world_size * n,
    *rest]; NCCL also other shapes with those element counts (the stack, a 0-dim
    `input`), which raise ValueError here on other backends.

    Outside an overlap: `torch.distributed.all_gather_into_tensor`; inside: module docstring.
    """
    if compiled.traced(async_op):
        return compiled.all_gather_into_tensor(output, input, group)
    base, facts = resolve_group_and_facts(group)
    async_op = check_async_op(async_op)
    output, input = check_pair(output, input, facts.is_nccl)
    require_world_chunks(
        "all_gather_into_tensor", "output", output, "input", input, base, facts.size
    )
    return _run(
        "all_gather_into_tensor", _all_gather, (output, input), (output, input), base, async_op
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Reduce `input` over the ranks with `op`; rank r keeps the r-th chunk in `output`.

    `input` holds `world_size * output.numel()` elements, same dtype and device, both
    contiguous. Every backend takes `output` [n, *rest] with `input` [world_size * n,
    *rest]; NCCL also any shapes with those element counts (the stack, a 0-dim
    `output`), which raise ValueError here on other backends.

    Outside an overlap: `torch.distributed.reduce_scatter_tensor`; inside: module docstring.
    """
    if compiled.traced(async_op):
        return compiled.reduce_scatter_tensor(output, input, op, group)
    base, facts = resolve_group_and_facts(group)
    async_op = check_async_op(async_op)
    output, input = check_pair(output, input, facts.is_nccl)
    require_reduce_op(op, input.dtype, facts.is_nccl)
    require_world_chunks(
        "reduce_scatter_tensor", "input", input, "output", output, base, facts.size
    )
    return _run(
        "reduce_scatter_tensor", _reduce_scatter,
        (output, input, op), (output, input), base, async_op,
    )


def unchecked_all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None, group: dist.ProcessGroup, async_op: bool,
) -> CollectiveWork | None:
    """`all_to_all_single` for `comm`'s own callers (`comm.moe`), which made the tensors
    and the split lists themselves and resolved `group` (a ProcessGroup): no checks."""
    return _run(
        "all_to_all_single", dist.all_to_all_single,
        (output, input, output_split_sizes, input_split_sizes), (output, input), group, async_op,
    )


def unchecked_all_reduce(
    tensor: torch.Tensor, op: Any, group: dist.ProcessGroup, async_op: bool = False
) -> CollectiveWork | None:
    """`all_reduce` for `comm`'s own callers, as `unchecked_all_to_all_single`."""
    return _run("all_reduce", dist.all_reduce, (tensor, op), (tensor,), group, async_op)


def _described(error: BaseException) -> str:
    """`"Type: message"`, even when the error's `__str__` fails."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001 - a user's failing __str__
        return type(error).__name__
