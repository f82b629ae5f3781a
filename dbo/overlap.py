"""`dbo.overlap`: wrap a callable so that each call runs as overlapped ubatches."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, overload

import torch

from dbo import _affinity, _context, _thread_settings, tracing
from dbo import runner as runner_module
from dbo._checks import check_num_ubatches
from dbo._context import current_context
from dbo.runner import (
    RunnerState,
    UBatchRunner,
    check_timeout,
    describe_ubatch_input,
    is_ubatch_input,
)
from dbo.split import (
    UBatchInputs,
    batch_size_of,
    default_merge,
    split_parts,
    splittable_leaves,
)

F = TypeVar("F", bound=Callable[..., Any])

SplitFn = Callable[[tuple[Any, ...], dict[str, Any], int], UBatchInputs]
"""`split(args, kwargs, num_ubatches) -> [(args_i, kwargs_i), ...]`"""
MergeFn = Callable[[Sequence[Any]], Any]
"""`merge([output_0, output_1, ...]) -> output`"""


_MAX_IDLE_RUNNERS = 2
"""Idle runners kept per key; more exist only while callers overlap."""
_MAX_IDLE_RUNNERS_IN_ALL = 8
"""Idle runners kept over all keys (callers pinned to many different cores)."""

_PoolKey = tuple[int, "torch.device | None", "frozenset[int] | None"]
"""(num_ubatches, device, the caller's CPUs)."""


class _RunnerPool:
    """The runners `dbo.overlap` uses, per (num_ubatches, device, caller's CPUs: workers
    keep the CPUs they were created with); closed at exit. Each call leases a runner of
    its own, so concurrent callers (a helper thread inside a ubatch among them) never
    wait for each other's runs; a runner not idle after its run (broken) is closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[_PoolKey, UBatchRunner]] = []
        """Idle runners, least recently returned first (at most 8: a linear scan)."""
        self._generation = 0
        self._atexit_registered = False

    @contextmanager
    def lease(self, num_ubatches: int, device: torch.device | None) -> Iterator[UBatchRunner]:
        key = (num_ubatches, device, _affinity.cpus_of_this_thread())
        runner = None
        with self._lock:
            for index in range(len(self._idle) - 1, -1, -1):  # the most recent first
                if self._idle[index][0] == key:
                    runner = self._idle.pop(index)[1]
                    break
            generation = self._generation
            if not self._atexit_registered:
                atexit.register(self.close_all)
                self._atexit_registered = True
        if runner is None:
            runner = UBatchRunner(num_ubatches, device)
        try:
            yield runner
        finally:
            to_close = [runner]
            with self._lock:
                if (
                    runner.state is RunnerState.IDLE
                    and generation == self._generation
                    and sum(1 for idle_key, _ in self._idle if idle_key == key)
                    < _MAX_IDLE_RUNNERS
                ):
                    self._idle.append((key, runner))
                    to_close = []
                    if len(self._idle) > _MAX_IDLE_RUNNERS_IN_ALL:  # the least recently used
                        to_close = [self._idle.pop(0)[1]]
            for closing in to_close:
                closing.close(timeout_s=0)  # a broken one's workers end with their ubatch

    def reset_after_fork(self) -> None:
        """In a forked child: drop the pooled runners (their threads are the parent's)."""
        self._lock = threading.Lock()
        self._idle = []
        self._generation += 1

    def close_all(self) -> None:
        """Close the idle runners; runners leased now are closed when their run ends."""
        with self._lock:
            runners = [runner for _, runner in self._idle]
            self._idle = []
            self._generation += 1
        for runner in runners:
            runner.close(timeout_s=1.0)


_runner_pool = _RunnerPool()


def _after_fork_in_child() -> None:
    """A forked child has only the thread that forked: drop the runners, registrations
    and locks it inherited; `dbo.overlap` builds new runners there on first use."""
    _runner_pool.reset_after_fork()
    _context.reset_after_fork()
    runner_module.reset_after_fork()
    tracing.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_default_runners() -> None:
    """Close the worker threads `dbo.overlap` created (they are recreated on next use)."""
    _runner_pool.close_all()


@overload
def overlap(
    fn: F,
    *,
    num_ubatches: int = 2,
    split: SplitFn | None = None,
    merge: MergeFn | None = None,
    min_batch_size: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    decision_group: Any = None,
) -> F: ...


@overload
def overlap(
    fn: None = None,
    *,
    num_ubatches: int = 2,
    split: SplitFn | None = None,
    merge: MergeFn | None = None,
    min_batch_size: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    decision_group: Any = None,
) -> Callable[[F], F]: ...


def overlap(
    fn: Callable[..., Any] | None = None,
    *,
    num_ubatches: int = 2,
    split: SplitFn | None = None,
    merge: MergeFn | None = None,
    min_batch_size: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    decision_group: Any = None,
) -> Any:
    """Wrap `fn` so that each call splits its batch into ubatches and overlaps them.

    Usable as `dbo.overlap(model)`, `dbo.overlap(model.forward, num_ubatches=3)`,
    `@dbo.overlap` and `@dbo.overlap(num_ubatches=2)`. The wrapper has `fn`'s signature.

    A call:
      1. splits the arguments with `split` (default: every tensor leaf with ndim >= 1 of
         args/kwargs along dim 0, like `torch.tensor_split`; other leaves go to every
         ubatch unchanged; dim-0 sizes that differ raise ValueError naming the paths);
      2. runs `fn` on part i in ubatch thread i, passing the baton at yield points (see
         `UBatchRunner.run` for threading, stream and error semantics);
      3. merges the outputs with `merge` (default: tensor leaves concatenated along dim
         0 in ubatch order; `dbo.merge_parts` returns the parts without copying).

    Runs `fn` once on the whole input in the calling thread, with no threads
    (`dbo.enabled()` False), when the batch is smaller than `num_ubatches` or than
    `min_batch_size`, or has no tensor to split. Called inside a ubatch (a nested
    overlap), under a `torch.func` transform (grad, vmap: ubatch threads cannot see
    it), or under a torch-function or dispatch mode (FakeTensorMode, a FLOP counter,
    `allow_mutation_on_saved_tensors`; not `with torch.device(...)`, which the workers
    replay), it also runs `fn` inline on its whole input. With a custom `merge`, an inline
    call returns `merge([output])`, so the result has one type whatever the path.
    The batch size is the common dim 0 of the tensor leaves; with a custom `split`,
    the largest dim 0 (ragged inputs: metadata per request next to the tokens).

    Merging (the default): outputs must have the same structure in every ubatch (dicts
    may list their keys in another order). Non-tensor leaves must be equal and are
    returned once: an int or `torch.Size` computed from the ubatch's rows comes back as
    ubatch 0's value, so return such values as tensors, or pass `merge=`. Containers
    are those `torch.utils._pytree` knows (`dbo.split`); a dataclass is one once
    registered with `torch.utils._pytree.register_dataclass`. A method decorated with
    `@dbo.overlap` receives `self` as its first argument, split like any argument; wrap
    the bound method instead (`dbo.overlap(obj.method)`).

    Grad mode: `fn` runs under the caller's grad mode. A caller in `no_grad` whose `fn`
    turns grad on gets what a direct call gives: the split (default or custom) then
    runs with grad on when an input requires grad, and the default merge keeps the
    graph of outputs that have one. A custom `merge` runs under the caller's mode.

    Args:
        num_ubatches: ubatches per call, an int in [1, 1024].
        split: `split(args, kwargs, num_ubatches) -> [(args_i, kwargs_i), ...]`.
        merge: `merge([out_0, out_1, ...]) -> out`.
        min_batch_size: below this batch size, run inline (overlap loses on small
            batches). In a distributed job every rank must take the same decision, or
            their collectives mismatch and the job hangs: pass `decision_group`, or give
            every rank the same batch size.
        timeout_s: watchdog; a ubatch running longer than this between two yield
            points (holding the baton) raises `OverlapTimeoutError` naming it and
            showing its stack. None: no watchdog.
        device: where the ubatch streams live; None: the device of the first CUDA tensor
            in the inputs (CPU when there is none).
        decision_group: a `torch.distributed` process group (or
            `torch.distributed.group.WORLD`) whose ranks decide together: the local batch
            sizes are all-reduced (MIN) on it, one small collective per call, and every
            rank overlaps only if every rank's batch passes the thresholds above. Required
            when ranks may see different batch sizes and `fn` communicates. A rank whose
            input cannot be sized (tensors whose dim 0 differ) still takes part before it
            raises, and every other rank then raises RuntimeError instead of waiting. A
            rank that must run inline (under a mode or a `torch.func` transform, such
            as a FLOP counter on rank 0 only) votes inline, so every rank does.
            Build the wrapper after `comm.init_distributed()`: before it,
            `torch.distributed.group.WORLD` is None, which means "no decision group".
    """
    num_ubatches = check_num_ubatches(num_ubatches)
    timeout_s = check_timeout(timeout_s)
    if min_batch_size is not None and (
        isinstance(min_batch_size, bool) or not isinstance(min_batch_size, int)
    ):
        raise TypeError(f"min_batch_size must be an int or None, got {min_batch_size!r}")
    if min_batch_size is not None and min_batch_size < 1:
        raise ValueError(
            f"min_batch_size must be >= 1 (or None: no minimum), got {min_batch_size}"
        )
    for name, value in (("split", split), ("merge", merge)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {value!r}")
    resolved_device = None if device is None else torch.device(device)
    if fn is None:
        return functools.partial(
            overlap,
            num_ubatches=num_ubatches,
            split=split,
            merge=merge,
            min_batch_size=min_batch_size,
            timeout_s=timeout_s,
            device=resolved_device,
            decision_group=decision_group,
        )
    if not callable(fn):
        raise TypeError(f"dbo.overlap needs a callable, got {fn!r}")
    if (
        inspect.iscoroutinefunction(fn)
        or inspect.isasyncgenfunction(fn)
        or inspect.isgeneratorfunction(fn)
    ):
        # Calling one returns a coroutine or generator without running its body: the
        # ubatches would end at once and the body would run later, outside the overlap.
        raise TypeError(
            f"dbo.overlap needs a plain function; {fn!r} is a coroutine or generator "
            "function, whose body would run after the overlap, not in its ubatches"
        )
    target = fn

    def inline(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # One part: a custom merge still shapes the result, so callers see one type.
        output = target(*args, **kwargs)
        return output if merge is None else merge([output])

    def split_into_parts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if split is None:  # its size check already ran (batch_size_of)
            return split_parts(args, kwargs, num_ubatches)
        return _checked_split_result(split(args, kwargs, num_ubatches), num_ubatches)

    def overlapped(*args: Any, **kwargs: Any) -> Any:
        if current_context() is not None:
            return inline(args, kwargs)  # nested: no ubatches inside a ubatch
        # A torch.func transform (grad, vmap) lives in this thread's interpreter stack,
        # which ubatch threads do not see; so do torch-function and dispatch modes.
        # With a decision group this rank still votes (for inline): a mode on some
        # ranks only (a FLOP counter on rank 0) must send every rank inline.
        must_inline = _under_functorch_transform() or _thread_settings.unreplayed_mode_active()
        if must_inline and decision_group is None:
            return inline(args, kwargs)
        recording = tracing._active
        start = time.perf_counter() if recording is not None else 0.0
        name = "dbo.overlap"
        try:
            try:
                leaves = splittable_leaves(args, kwargs, check_leaves=split is None)
                size = batch_size_of(leaves) if split is None else _largest_size(leaves)
            except Exception:
                if decision_group is not None:
                    _report_failure_to_ranks(decision_group)
                raise
            if decision_group is not None:
                vote = 0 if size is None or must_inline else size
                size = _smallest_batch_across_ranks(vote, decision_group, leaves)
                if size == _FAILED_RANK:
                    raise RuntimeError(
                        "dbo.overlap: another rank of decision_group could not size its "
                        "input (its own error says why), so no rank runs the function: "
                        "they would wait for that rank's collectives"
                    )
            if size is None or size < num_ubatches or (
                min_batch_size is not None and size < min_batch_size
            ):
                name = "dbo.overlap inline"
                return inline(args, kwargs)
            if not torch.is_grad_enabled() and any(leaf.requires_grad for _, leaf in leaves):
                # A caller in no_grad whose fn turns grad on: the parts must keep their
                # link to the inputs, as the inputs themselves would in a direct call.
                with torch.enable_grad():
                    parts = split_into_parts(args, kwargs)
            else:
                parts = split_into_parts(args, kwargs)
            run_device = resolved_device or next(
                (leaf.device for _, leaf in leaves if leaf.is_cuda), torch.device("cpu")
            )
            with _runner_pool.lease(num_ubatches, resolved_device) as runner:
                outputs = runner.run(target, parts, timeout_s=timeout_s, device=run_device)
            return (merge or default_merge)(outputs)
        finally:  # failed calls too: their turns are on the timeline
            if recording is not None:
                recording.add(name, tracing.CALLER, start, time.perf_counter())

    if isinstance(fn, (functools.partial, torch.nn.Module)) or not hasattr(fn, "__name__"):
        functools.update_wrapper(overlapped, fn, updated=())
    else:
        functools.update_wrapper(overlapped, fn)
    overlapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return overlapped


def _checked_split_result(parts: Any, num_ubatches: int) -> list[Any]:
    """What a custom `split=` returned, checked here so that the error names `split=`."""
    try:
        parts = list(parts)
    except TypeError:
        raise TypeError(
            f"split= must return a list of {num_ubatches} (args_tuple, kwargs_dict) pairs, "
            f"got {type(parts).__name__}"
        ) from None
    if len(parts) != num_ubatches:
        raise ValueError(
            f"split= returned {len(parts)} parts for num_ubatches={num_ubatches}; it must "
            "return one (args_tuple, kwargs_dict) pair per ubatch"
        )
    for index, part in enumerate(parts):
        if not is_ubatch_input(part):
            raise TypeError(
                f"split= returned {describe_ubatch_input(part)} as part {index}; each part must be "
                "an (args_tuple, kwargs_dict) pair, e.g. ((x_i,), {})"
            )
    return parts


_FAILED_RANK = -1
"""What a rank whose input cannot be sized contributes to the decision: the MIN tells
every rank, which then raises instead of running `fn` without it."""


def _report_failure_to_ranks(group: Any) -> None:
    """Take part in the decision of a call that is about to raise, so that the other
    ranks raise too instead of waiting in the decision (or in `fn`'s collectives)."""
    with contextlib.suppress(Exception):  # this rank's own error says more
        _smallest_batch_across_ranks(_FAILED_RANK, group)


def _smallest_batch_across_ranks(
    local_size: int, group: Any, leaves: Sequence[tuple[str, torch.Tensor]] = ()
) -> int:
    """MIN of every rank's batch size over `group` (blocking; same call on every rank)."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        # The group's own GPU when it has one (init_distributed binds it), else the
        # inputs': the current device is per thread, and a caller thread other than
        # the one that initialized would name cuda:0 on every rank.
        device = getattr(group, "bound_device_id", None) or next(
            (leaf.device for _, leaf in leaves if leaf.is_cuda),
            torch.device("cuda", torch.cuda.current_device()),
        )
    # torch.full, not torch.tensor: a copy from host memory would sync the host once
    # more than the .item() that the decision needs. Outside any mode the caller is
    # under (a FakeTensorMode would make the vote a fake tensor).
    with _no_torch_modes():
        size = torch.full((1,), local_size, dtype=torch.int64, device=device)
        dist.all_reduce(size, op=dist.ReduceOp.MIN, group=group)
        return int(size.item())


@contextlib.contextmanager
def _no_torch_modes() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _largest_size(leaves: list[tuple[str, torch.Tensor]]) -> int | None:
    """The largest dim 0 among the tensor leaves: the batch size a custom split works
    on. Inputs may be ragged (per-request metadata next to the tokens), so dim-0 sizes
    need not agree, and the tokens are the largest."""
    return max((int(leaf.size(0)) for _, leaf in leaves), default=None)



def _under_functorch_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is active in this thread."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
