"""DBO-aware collectives with the torch.distributed signatures.

    comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)
    comm.all_reduce(tensor, op, group)
    comm.all_gather_into_tensor(output, input, group)
    comm.reduce_scatter_tensor(output, input, op, group)

Outside an overlap each is the plain torch.distributed op (blocking; with
`async_op=True`, a `CollectiveWork` wrapping torch's `Work`).

Inside an overlap (a ubatch thread of `dbo.overlap`), a blocking call:
  1. moves the ubatch to its comm stream, ordered after its compute stream by an event
     (`dbo.switch_to_comm`; skipped on CPU, where streams are bookkeeping only);
  2. launches the collective asynchronously on the ubatch's duplicate group (see
     `comm.groups`; the base group if there is none) and protects the tensors from the
     CUDA caching allocator on the comm stream (`Tensor.record_stream`);
  3. `dbo.yield_()`: the other ubatches run while the transfer is in flight (on CPU, gloo
     moves the data in its own threads while they compute);
  4. waits for the collective (CUDA: the comm stream waits, the host does not; gloo: the
     host blocks, with the GIL released) and moves back to the compute stream.
The caller already on its comm stream stays there (steps 1 and 4 skip the moves).

With `async_op=True` inside an overlap, steps 1-2 happen, the ubatch moves back to its
compute stream at once, and the returned `CollectiveWork.wait()` does steps 3-4 (yield,
then wait), so the caller can place its own compute between launch and wait.

A blocking call yields exactly once; an async one yields once, at its first `wait()`
(none with `wait(yield_first=False)`), whatever the timing: the yield points, and so the
order in which ranks launch collectives, depend only on the program. Do not branch on
`is_completed()` inside an overlap: that would make the order depend on timing and
mismatch collectives across ranks.

Arguments are checked on the host before anything is launched (TypeError / ValueError
naming the values): a bad call raises on the calling rank before it launches anything.
The other ranks, which did launch, wait for it until the group's timeout.
Consistency *between* ranks (rank a's input split for b equal to b's output split from
a) cannot be checked locally; `comm.moe.dispatch` exchanges counts so it always holds.
"""

from __future__ import annotations

import copy
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm import _abandoned, _launch
from comm._checks import (
    GroupFacts,
    backend_is_nccl,
    check_split_sizes,
    require_backend_device,
    require_contiguous,
    require_reduce_op,
    require_same_device,
    require_same_dtype,
    require_tensor,
    resolve_group_and_facts,
)
from comm.groups import group_registry
from dbo import tracing
from dbo.errors import describe

ReduceOp = dist.ReduceOp
_registry = group_registry()
_CudaStream = torch.cuda.Stream

_Launch = Callable[..., Any]
"""`launch(group, *args, async_op) -> Work | None`: the collective itself, one of
`comm._launch`'s functions (the process group's method for a plain call, else
torch.distributed's function)."""


class CollectiveWork:
    """An in-flight collective launched with `async_op=True`.

    `wait()` completes it: inside the overlap that launched it, its first call yields to
    the other ubatches (once), then it waits. CUDA: the *current* stream waits for the
    collective (the host does not block). gloo: the host blocks until the data arrived
    (GIL released) and raises a peer's failure or the group's timeout. Like torch's
    `Work.wait`, it returns True. The tensors passed to the collective stay referenced
    until `wait()` returned or failed for good.

    Once a wait succeeded, later waits return True at once. Once one failed (a peer's
    failure, the group's timeout, an error raised at the yield), the handle is failed:
    every later wait raises that exception again (an equal copy without its traceback,
    which would keep the failed call's frames alive), as torch's `Work` does, never
    returning as if the data had arrived. The exception is a wait's own `timeout`
    passing while the collective is still in flight: that wait raises torch's error and
    the handle stays in flight (a later wait waits again, without yielding).

    `get_future()` and `result()` are the underlying `Work`'s (AttributeError if it has
    none). They neither yield nor count as a wait: inside an overlap, use `wait()`.

    Inside an overlap, a handle still in flight when the ubatch's function returns is
    waited then (without a yield), so the end of the overlap covers it: the caller's
    stream is ordered after the ubatch's streams, and NCCL runs the collective on a
    stream of its own that only a wait connects to them.
    """

    __slots__ = (
        "_work", "_tensors", "_yields", "_waited", "_done", "_error", "_exit_cell", "_name"
    )

    def __init__(
        self, work: Any, tensors: Sequence[torch.Tensor], yields: bool, name: str = "collective"
    ) -> None:
        self._work = work
        self._tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self._yields = yields
        self._waited = False  # a wait() began: later ones never yield
        self._done = False
        self._error: BaseException | None = None
        self._exit_cell: weakref.ref[_ExitCell] | None = None
        self._name = name

    @property
    def work(self) -> Any:
        """The underlying `torch.distributed.Work`."""
        return self._work

    def is_completed(self) -> bool:
        """Whether the collective has finished (for diagnostics; never branch on it
        inside an overlap, see the module docstring)."""
        return bool(self._work.is_completed())

    def get_future(self) -> Any:
        """The underlying `Work.get_future()`: a `torch.futures.Future` completed with the
        collective (it does not yield and does not count as this handle's wait)."""
        return self._work.get_future()

    def result(self) -> Any:
        """The underlying `Work.result()` (the collective's output tensors, per torch)."""
        return self._work.result()

    def wait(self, timeout: timedelta | None = None, *, yield_first: bool = True) -> bool:
        """Yield (at the first call, inside the launching overlap, if `yield_first`), then
        wait; return True. A second call after success returns True at once, without
        yielding; after a failure it raises that exception again (an equal copy).

        `timeout`: as torch's `Work.wait(timeout)`, a `datetime.timedelta` passed to the
        underlying wait (`timedelta(0)`, torch's default, or None: no limit but the
        group's timeout). If it passes while the collective is still in flight, the error
        propagates and the handle stays in flight.

        `yield_first=False` waits without letting the other ubatches run first; choose it
        in the program, never from timing.
        """
        if self._error is not None:
            raise _unlinked_copy(self._error)
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
                self._abandon()  # aborted: settled before the process ends
                self._fail(error)
                raise
        try:
            if timeout is None:
                _blocking(self._work.wait, self._name, None)
            else:
                _blocking(self._work.wait, self._name, None, timeout)
        except BaseException as error:
            if timeout is not None and not self._finished():
                raise  # only the caller's timeout passed: still in flight, as torch's Work
            self._fail(error)
            raise
        self._done = True
        self._release()
        return True

    def _finished(self) -> bool:
        """After a wait raised: whether the collective is over (failed), not still in
        flight. A Work that cannot say counts as over."""
        try:
            return bool(self._work.is_completed())
        except Exception:
            return True

    def _fail(self, error: BaseException) -> None:
        # A copy without traceback: the error's traceback holds this wait's frame (and the
        # ubatch function's, which holds this handle), so keeping the error itself would
        # be a reference cycle keeping the failed call's tensors until the garbage
        # collector runs. Each later wait raises a fresh copy, for the same reason.
        self._error = _unlinked_copy(error)
        self._release()

    def _release(self) -> None:
        self._tensors = ()
        cell = self._exit_cell() if self._exit_cell is not None else None
        if cell is not None:
            cell.handle = None

    def _abandon(self) -> None:
        _abandon(self._work, self._tensors)

    def __del__(self) -> None:
        # Dropped before any wait finished (its ubatch was aborted at a later yield, where
        # exit callbacks do not run, or the caller let it go): the collective may still
        # run, so the process must not end before it does (comm._abandoned).
        try:
            if not self._done and self._error is None:
                self._abandon()
        except Exception:  # noqa: BLE001, S110 - at interpreter exit anything may be gone
            pass

    def __repr__(self) -> str:
        if self._error is not None:
            state = f"failed: {type(self._error).__name__}"
        else:
            state = "waited" if self._done else "in flight"
        return f"CollectiveWork({state}, yields={self._yields})"


def _unlinked_copy(error: BaseException) -> BaseException:
    """`error` again (same type, message, attributes and notes), without its traceback,
    cause or context; a RuntimeError naming it if it cannot be rebuilt.

    Rebuilt the way `copy` does (its `__reduce__`: right for OSError's filename, say),
    else with `__new__`, skipping a constructor that formats its message (which would
    then be formatted twice) or takes other parameters than `args`."""
    kind, message = type(error), _message(error)
    fallback = None
    for rebuild in (copy.copy, _rebuilt_without_init):
        try:
            copied = rebuild(error)
        except Exception:  # noqa: BLE001 - any failure to rebuild: try the next way
            continue
        if type(copied) is kind:
            if _message(copied) == message:
                fallback = copied
                break
            fallback = fallback or copied
    if fallback is None:
        fallback = RuntimeError(f"the collective failed earlier: {describe(error)}")
    fallback.__traceback__ = None
    fallback.__cause__ = fallback.__context__ = None
    return fallback


def _message(error: BaseException) -> str | None:
    """`str(error)`, or None where the exception's `__str__` fails."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - any failure of its __str__
        return None


def _rebuilt_without_init(error: BaseException) -> BaseException:
    kind = type(error)
    copied = kind.__new__(kind, *error.args)
    copied.args = error.args
    state = dict(getattr(error, "__dict__", {}))
    if "__notes__" in state:
        state["__notes__"] = list(state["__notes__"])
    copied.__dict__.update(state)
    return copied


def _abandon(work: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Hand `work`, never waited, to `comm._abandoned`: host-backend collectives only (no
    CUDA tensor; see that module for why NCCL's are left to NCCL)."""
    if not any(tensor.is_cuda for tensor in tensors):
        _abandoned.abandon(work)


class _ExitCell:
    """Holds an async handle for the wait at its ubatch's end (`_wait_left_over`) until
    the handle's own wait empties it. The handle refers to its cell weakly: a strong
    reference both ways was a cycle, so a handle dropped by an aborted ubatch (whose
    exit callbacks never run) lived on until the garbage collector ran, and was not
    handed to `comm._abandoned` before the process could end."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle: CollectiveWork) -> None:
        self.handle: CollectiveWork | None = handle


def _wait_left_over(cell: _ExitCell) -> None:
    """At a ubatch's end: wait the handle in `cell` unless its wait() emptied it."""
    if cell.handle is not None:
        cell.handle.wait(yield_first=False)


def _blocking(wait: Callable[..., Any], name: str, track: int | None, *args: Any) -> None:
    """`wait(*args)` (the host blocks until the collective is done), recorded on the
    timeline as "wait <name>" when a `dbo.trace()` is active, on `track`; None: the
    calling thread's ubatch (a recv hook may wait another ubatch's handle: the wait
    belongs to the thread that blocks in it), or the caller's track outside an overlap."""
    recording = tracing.active()
    if recording is None:
        wait(*args)
        return
    if track is None:
        track = dbo.current_ubatch_id() if dbo.enabled() else tracing.CALLER
    start = time.perf_counter()
    try:
        wait(*args)
    finally:
        label = _WAIT_LABELS.get(name)
        if label is None:  # one string per collective kind, shared by all its spans
            label = _WAIT_LABELS.setdefault(name, f"wait {name}")
        recording.add(label, track, start, time.perf_counter())


_STORAGE_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose `data_ptr()` is their own storage's (the aliasing check)."""

_WAIT_LABELS: dict[str, str] = {}
""""wait <name>" per collective name: built once, not per span (a trace keeps up to a
million spans)."""


def _protect(tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """Keep the CUDA caching allocator from reusing `tensors` before the ubatch's current
    (comm) `stream` is past them. CPU tensors need nothing."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(stream)


def _run(
    name: str,
    launch: _Launch,
    args: tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    async_op: bool,
) -> CollectiveWork | None:
    """Launch a checked collective, `launch(group, *args, async_op)`, DBO-aware inside an
    overlap (module docstring). No closure per call: this is every collective's path."""
    stream = dbo.current_stream()  # None outside an overlap
    if stream is None:
        if async_op:
            return CollectiveWork(launch(group, *args, True), tensors, yields=False, name=name)
        _blocking(launch, name, tracing.CALLER, group, *args, False)  # the plain blocking op
        return None
    ubatch_id = dbo.current_ubatch_id()
    ubatch_group = _registry.lookup(group, ubatch_id)
    # On the CPU backend streams are bookkeeping only and the collective completes on
    # the host: no stream to move to, nothing to protect (the same yields either way).
    on_cuda = isinstance(stream, _CudaStream)
    switched = on_cuda and not dbo.on_comm_stream()
    if switched:
        dbo.switch_to_comm()
    try:
        work = launch(ubatch_group, *args, True)
        if on_cuda:
            _protect(tensors, dbo.current_stream())  # comm's, after the switch
        if async_op:
            handle = CollectiveWork(work, tensors, yields=True, name=name)
            # A handle the ubatch never waits is waited when it returns (no yield), so
            # that the end of the overlap covers the collective. The callback holds the
            # handle through a cell that wait() empties: a waited handle (its Work and
            # tensors) is not kept alive until the ubatch ends.
            cell = _ExitCell(handle)
            handle._exit_cell = weakref.ref(cell)
            dbo.at_ubatch_exit(functools.partial(_wait_left_over, cell))
            return handle
        try:
            dbo.yield_()  # the other ubatches run while this transfer is in flight
        except BaseException:
            _abandon(work, tensors)  # aborted: settled before the process ends
            raise
        _blocking(work.wait, name, ubatch_id)
        return None
    finally:
        if switched:
            dbo.switch_to_compute()


def _check_pair(
    output: Any, input: Any, group: dist.ProcessGroup, facts: GroupFacts
) -> tuple[torch.Tensor, torch.Tensor]:
    # The common case, answered in a few attribute reads: these checks run on every
    # collective, and on a host that must stay ahead of the GPU each microsecond counts
    # (dtypes are singletons, so `is` compares them; two CPU tensors need no device
    # objects). Anything else goes through the detailed checks below, which say what is
    # wrong.
    try:
        if (
            isinstance(output, torch.Tensor)
            and isinstance(input, torch.Tensor)
            and output.dtype is input.dtype
            and ((output.is_cpu and input.is_cpu) or output.device == input.device)
            and output.is_contiguous()
            and input.is_contiguous()
            and (input.is_cuda or not facts.is_nccl)
        ):
            return output, input
    except RuntimeError:  # a layout without strides (sparse CSR) refuses is_contiguous()
        pass
    output = require_tensor("output", output)
    input = require_tensor("input", input)
    require_same_dtype("output", output, "input", input)
    require_same_device("output", output, "input", input)
    require_contiguous("output", output)
    require_contiguous("input", input)
    require_backend_device(group, "input", input)
    return output, input


def _check_rows(output: torch.Tensor, input: torch.Tensor) -> None:
    """`all_to_all_single` moves rows: both tensors need a dim 0 and one row shape."""
    if output.ndim == 0 or input.ndim == 0:
        raise ValueError(
            "all_to_all_single needs tensors with a dim 0 (not 0-dim), got shapes "
            f"{tuple(output.shape)} (output) and {tuple(input.shape)} (input)"
        )
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"output and input must have the same row shape (all dims but 0), got "
            f"{tuple(output.shape)} and {tuple(input.shape)}"
        )


def _require_world_chunks(
    op: str,
    whole_name: str,
    whole: torch.Tensor,
    chunk_name: str,
    chunk: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
) -> None:
    """`whole` must hold one `chunk` per rank (all-gather output, reduce-scatter input),
    in a layout the backend takes. NCCL checks only the element counts, so any shapes do
    (e.g. the stack [world_size, *chunk.shape]). gloo takes only the concatenation along
    dim 0, [world_size * chunk.shape[0], *chunk.shape[1:]], and rejects the rest inside
    the launch (a 0-dim reduce-scatter output crashes the process), so on every non-NCCL
    backend other layouts are refused here, before any launch. `world_size`: `group`'s size."""
    if whole.numel() != world_size * chunk.numel():
        raise ValueError(
            f"{whole_name} must hold world_size * {chunk_name}.numel() = {world_size} * "
            f"{chunk.numel()} = {world_size * chunk.numel()} elements, got shape "
            f"{tuple(whole.shape)} ({whole.numel()} elements)"
        )
    if _runs_on_nccl(group, chunk):  # first: the cheapest answer on the GPU's hot path
        return
    whole_shape, chunk_shape = whole.shape, chunk.shape
    if (
        chunk_shape
        and len(whole_shape) == len(chunk_shape)
        and whole_shape[0] == world_size * chunk_shape[0]
        and whole_shape[1:] == chunk_shape[1:]
    ):
        return
    if chunk_shape:
        accepted = (world_size * chunk_shape[0], *chunk_shape[1:])
        fix = f"pass {whole_name}.view({', '.join(map(str, accepted))}) (the same memory)"
    else:
        accepted = (world_size,)
        fix = f"pass {chunk_name}.view(1) and {whole_name}.view({world_size})"
    raise ValueError(
        f"{op} on a {group.name()} group takes only {whole_name} of shape "
        f"[world_size * {chunk_name}.shape[0], *{chunk_name}.shape[1:]] (the "
        f"concatenation along dim 0; {chunk_name} needs at least one dim), here "
        f"{accepted}; got {whole_name} {tuple(whole_shape)} for {chunk_name} "
        f"{tuple(chunk_shape)} with world_size {world_size}. Other layouts with the same "
        f"number of elements (e.g. the stack [world_size, *{chunk_name}.shape]) are NCCL's "
        f"only; {fix}"
    )


def _runs_on_nccl(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether NCCL runs `group`'s collectives on `tensor`: CUDA tensors on a group whose
    backend is NCCL (also a "cpu:gloo,cuda:nccl" group, which torch names nccl)."""
    return tensor.is_cuda and backend_is_nccl(group)


def _check_async_op(async_op: Any) -> bool:
    if async_op is False or async_op is True:  # the only two bools
        return async_op
    raise TypeError(f"async_op must be a bool, got {async_op!r}")


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Scatter rows of `input` to the ranks of `group`; gather theirs into `output`.

    Tensor contract: `input` [sum(input_split_sizes), *row] and `output`
    [sum(output_split_sizes), *row], same dtype, device and row shape, contiguous, and
    no byte in common (ValueError: received rows would overwrite rows not yet sent).
    Rows `input[offset_r : offset_r + input_split_sizes[r]]` go to rank r; `output` gets
    rank r's rows at `offset_r` of `output_split_sizes`, in rank order. Split sizes:
    one int >= 0 per rank (zero is fine); None means equal parts. `output` is written
    when the call returns (blocking) or once `wait()` returns (`async_op=True`).

    Outside an overlap: `torch.distributed.all_to_all_single`. Inside: on the ubatch's
    comm stream and group, yielding while in flight (module docstring).
    """
    base, facts = resolve_group_and_facts(group)
    async_op = _check_async_op(async_op)
    output, input = _check_pair(output, input, base, facts)
    # Other subclasses' data_ptr may be 0, warn or dispatch; 0: no storage (meta),
    # nothing to overwrite. About 1 us, on every call. Both are contiguous (checked
    # above): their bytes are [data_ptr, data_ptr + nbytes).
    if type(output) in _STORAGE_TYPES and type(input) in _STORAGE_TYPES:
        out_start, in_start = output.data_ptr(), input.data_ptr()
        out_end, in_end = out_start + output.nbytes, in_start + input.nbytes
        # (An empty tensor has no bytes to share, whatever its pointer says.)
        if out_start and in_start and out_start < in_end and in_start < out_end and (
            out_start != out_end and in_start != in_end
        ):
            # Rows would be overwritten before they are sent (torch races the same way).
            raise ValueError(
                "all_to_all_single: output and input share memory; the rows received "
                "would overwrite rows not yet sent. Use a separate output "
                "(torch.empty_like(input))"
            )
    shape = output.shape
    same_shape = shape == input.shape
    if not same_shape or not shape:  # equal shapes with a dim 0: the rows agree
        _check_rows(output, input)
    world_size = facts.size
    if (  # even splits of equal shapes: nothing more to check (the common call)
        same_shape
        and output_split_sizes is None
        and input_split_sizes is None
        and shape[0] % world_size == 0
    ):
        output_splits = input_splits = None
    else:
        # Even splits on both sides: every rank sends and receives as many rows.
        if output_split_sizes is None and input_split_sizes is None and (
            shape[0] != input.shape[0]
        ):
            raise ValueError(
                f"without split sizes, output and input must have the same dim 0 (even "
                f"parts of it go to and come from each rank), got {shape[0]} (output) "
                f"and {input.shape[0]} (input); pass output_split_sizes and "
                "input_split_sizes"
            )
        output_splits = check_split_sizes(
            "output_split_sizes", output_split_sizes, "output", output, world_size
        )
        input_splits = check_split_sizes(
            "input_split_sizes", input_split_sizes, "input", input, world_size
        )
    return _run(
        "all_to_all_single", _launch.all_to_all_single,
        (output, input, output_splits, input_splits), (output, input), base, async_op,
    )


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Reduce `tensor` over the ranks of `group` with `op`, in place.

    Tensor contract: any shape, contiguous (row-major, or channels_last as torch
    accepts); every rank passes the same shape and dtype; `tensor` holds the result
    when the call returns (or after `wait()`). `ReduceOp.AVG` of an integer tensor is
    refused (TypeError, before the launch) except on NCCL, which averages integers.

    Outside an overlap: `torch.distributed.all_reduce`. Inside: on the ubatch's comm
    stream and group, yielding while in flight (module docstring).
    """
    base, facts = resolve_group_and_facts(group)
    async_op = _check_async_op(async_op)
    tensor = require_tensor("tensor", tensor)
    require_reduce_op(op, tensor.dtype, facts.is_nccl)
    require_contiguous("tensor", tensor, any_memory_format=True)  # NCCL refuses at launch
    if facts.is_nccl:
        require_backend_device(base, "tensor", tensor)
    return _run("all_reduce", _launch.all_reduce, (tensor, op), (tensor,), base, async_op)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Gather every rank's `input` into `output`, in rank order.

    Tensor contract: `output` holds `world_size * input.numel()` elements, same dtype
    and device as `input`, both contiguous; rank r's input lands in the r-th chunk of
    `output` (elements `[r * input.numel(), (r + 1) * input.numel())`). Layouts:
      - every backend: the concatenation along dim 0, `input` [n, *rest] (at least one
        dim) and `output` [world_size * n, *rest];
      - NCCL only (the backend that runs the tensors' device): any shapes with those
        element counts, e.g. the stack `output` [world_size, n, *rest] or a 0-dim
        `input`. gloo rejects those inside the launch; on gloo and every other non-NCCL
        backend they raise ValueError here (naming the shapes), before any launch.

    Outside an overlap: `torch.distributed.all_gather_into_tensor`. Inside: on the
    ubatch's comm stream and group, yielding while in flight (module docstring).
    """
    base, facts = resolve_group_and_facts(group)
    async_op = _check_async_op(async_op)
    output, input = _check_pair(output, input, base, facts)
    _require_world_chunks(
        "all_gather_into_tensor", "output", output, "input", input, base, facts.size
    )
    return _run(
        "all_gather_into_tensor", _launch.all_gather_into_tensor,
        (output, input), (output, input), base, async_op,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Reduce `input` over the ranks with `op`; rank r keeps the r-th chunk in `output`.

    Tensor contract: `input` holds `world_size * output.numel()` elements, same dtype
    and device as `output`, both contiguous; chunk r is `input.flatten()` elements
    `[r * output.numel(), (r + 1) * output.numel())`. Layouts:
      - every backend: the concatenation along dim 0, `output` [n, *rest] (at least one
        dim) and `input` [world_size * n, *rest];
      - NCCL only (the backend that runs the tensors' device): any shapes with those
        element counts, e.g. the stack `input` [world_size, n, *rest] or a 0-dim
        `output`. gloo rejects those inside the launch (a 0-dim `output` crashes the
        process); on gloo and every other non-NCCL backend they raise ValueError here
        (naming the shapes), before any launch.

    Outside an overlap: `torch.distributed.reduce_scatter_tensor`. Inside: on the
    ubatch's comm stream and group, yielding while in flight (module docstring).
    """
    base, facts = resolve_group_and_facts(group)
    async_op = _check_async_op(async_op)
    output, input = _check_pair(output, input, base, facts)
    require_reduce_op(op, input.dtype, facts.is_nccl)
    _require_world_chunks(
        "reduce_scatter_tensor", "input", input, "output", output, base, facts.size
    )
    return _run(
        "reduce_scatter_tensor", _launch.reduce_scatter_tensor,
        (output, input, op), (output, input), base, async_op,
    )
