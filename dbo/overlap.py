"""`dbo.overlap`: wrap a callable so that each call runs as overlapped ubatches."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, overload

import torch

from dbo import _affinity, _context, _thread_settings, tracing
from dbo import runner as runner_module
from dbo._checks import check_num_ubatches
from dbo._context import current_context
from dbo.backward import attach, own_leaves
from dbo.runner import RunnerState, UBatchRunner, check_timeout
from dbo.split import (
    UBatchInputs,
    batch_size_of,
    check_objects,
    default_merge,
    split_parts,
    splittable_leaves,
)

F = TypeVar("F", bound=Callable[..., Any])

SplitFn = Callable[[tuple[Any, ...], dict[str, Any], int], UBatchInputs]  # -> [(args, kwargs)]
MergeFn = Callable[[Sequence[Any]], Any]  # merge([output_0, output_1, ...]) -> output
NoSplit = Sequence[str | int] | str | int  # argument names and positional indices


_MAX_IDLE_RUNNERS = 2  # per key; more exist only while callers overlap
_MAX_IDLE_RUNNERS_IN_ALL = 8  # over all keys (callers pinned to many different cores)
_PoolKey = tuple[int, "torch.device | None", "frozenset[int] | None"]  # the caller's CPUs last


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
        with self._lock:
            matches = [i for i, (idle_key, _) in enumerate(self._idle) if idle_key == key]
            runner = self._idle.pop(matches[-1])[1] if matches else None  # the most recent
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
    """In a forked child (only the forking thread survives): drop the runners,
    registrations and locks it inherited; new runners are built on first use."""
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
    fn: F, *, num_ubatches: int = 2, split: SplitFn | None = None, merge: MergeFn | None = None,
    no_split: NoSplit = (), min_batch_size: int | None = None, timeout_s: float | None = None,
    device: torch.device | str | int | None = None, decision_group: Any = None,
    overlap_if: Callable[..., bool] | None = None, overlap_backward: bool = True,
) -> F: ...


@overload
def overlap(
    fn: None = None, *, num_ubatches: int = 2, split: SplitFn | None = None,
    merge: MergeFn | None = None, no_split: NoSplit = (), min_batch_size: int | None = None,
    timeout_s: float | None = None, device: torch.device | str | int | None = None,
    decision_group: Any = None, overlap_if: Callable[..., bool] | None = None,
    overlap_backward: bool = True,
) -> Callable[[F], F]: ...


def overlap(
    fn: Callable[..., Any] | None = None, *, num_ubatches: int = 2,
    split: SplitFn | None = None, merge: MergeFn | None = None, no_split: NoSplit = (),
    min_batch_size: int | None = None, timeout_s: float | None = None,
    device: torch.device | str | int | None = None, decision_group: Any = None,
    overlap_if: Callable[..., bool] | None = None, overlap_backward: bool = True,
) -> Any:
    """Wrap `fn` so that each call splits its batch into ubatches and overlaps them.

    `dbo.overlap(model)`, `dbo.overlap(fn, num_ubatches=3)`, `@dbo.overlap`, `@dbo.overlap(...)`;
    the wrapper has `fn`'s signature. A call splits the arguments (`split`, default
    `dbo.default_split`: tensor leaves along dim 0), runs `fn` on part i in ubatch thread
    i, passing the baton at yield points (threads, streams, errors: `UBatchRunner.run`),
    and merges the outputs (`merge`, default `dbo.default_merge`: along dim 0; HF: see it).

    `fn` runs once on the whole input in the calling thread instead (`dbo.enabled()`
    False; a custom `merge` gets `[output]`) when the batch is smaller than `num_ubatches`
    or `min_batch_size` or has no tensor, inside a ubatch, and under a `torch.func`
    transform or a torch function or dispatch mode, which ubatch threads do not see.
    `fn` runs under the caller's grad mode; wrap a bound method, not the function (its
    `self` would be split).

    Args:
        num_ubatches: ubatches per call, an int in [1, 1024].
        split: `split(args, kwargs, num_ubatches) -> [(args_i, kwargs_i), ...]`; the batch
            size is then the largest dim 0 (ragged inputs).
        merge: `merge([out_0, out_1, ...]) -> out`.
        no_split: names and indices of positional arguments passed whole to every ubatch
            (`position_ids` of shape [1, S], a rotary cache); ValueError for a name `fn`
            does not take (here) or an index past the call's arguments.
        min_batch_size: below this batch size, run inline (overlap loses on small batches).
        timeout_s: watchdog: a ubatch holding the baton longer than this raises
            `OverlapTimeoutError` naming it, with its stack. None: no watchdog.
        device: where the ubatch streams live; None: the first CUDA input's, else CPU.
        decision_group: a process group whose ranks decide together (a MIN all-reduce of
            the batch sizes per call): all overlap or none. Needed when ranks may see
            different batch sizes (or a mode on one rank only) and `fn` communicates, or
            their collectives mismatch and hang; a rank whose input cannot be sized or
            split (each rank splits before it votes) makes every rank raise. Build the
            wrapper after `comm.init_distributed()`.
        overlap_if: `overlap_if(*args, **kwargs) -> bool`, called with the call's arguments
            once the batch passes the sizes above: False runs inline (a token count, a
            prefill or decode threshold). With `decision_group` it is this rank's vote.
        overlap_backward: under grad mode, autograd runs each ubatch's backward in its
            ubatch thread, overlapped as the forward (`dbo.backward`): the gradients of the
            outputs reach the arguments and parameters as if the ubatches had run in turn
            (with two ubatches, bitwise). The function must then take every tensor that
            requires grad and is computed before the call as an argument (ValueError
            otherwise), not modify its arguments in place, and return every tensor a loss
            uses; the backward takes no `create_graph=True`. False: the backward runs whole
            in the caller's thread, blocking at each exchange (use it for those cases). It
            does so anyway under saved-tensor hooks around the call (the call checkpointed
            with `torch.utils.checkpoint`, `save_on_cpu`).
    """
    num_ubatches = check_num_ubatches(num_ubatches)
    timeout_s = check_timeout(timeout_s)
    if min_batch_size is not None and (type(min_batch_size) is not int or min_batch_size < 1):
        raise (ValueError if type(min_batch_size) is int else TypeError)(
            f"min_batch_size must be >= 1 (an int, or None: no minimum), got {min_batch_size!r}"
        )
    if not isinstance(overlap_backward, bool):
        raise TypeError(f"overlap_backward must be True or False, got {overlap_backward!r}")
    for name, value in (("split", split), ("merge", merge), ("overlap_if", overlap_if)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {value!r}")
    no_split = (no_split,) if isinstance(no_split, (str, int)) else tuple(no_split)
    if no_split and split is not None:
        raise ValueError("pass no_split= or split=, not both: a custom split decides itself")
    options: dict[str, Any] = dict(
        num_ubatches=num_ubatches, split=split, merge=merge, min_batch_size=min_batch_size,
        timeout_s=timeout_s, device=None if device is None else torch.device(device),
        decision_group=decision_group, overlap_if=overlap_if, overlap_backward=overlap_backward,
    )
    if fn is None:
        return functools.partial(overlap, no_split=no_split, **options)
    if not callable(fn):
        raise TypeError(f"dbo.overlap needs a callable, got {fn!r}")
    if any(is_kind(fn) for is_kind in _NOT_PLAIN):  # a call would not run the body
        raise TypeError(
            f"dbo.overlap needs a plain function; {fn!r} is a coroutine or generator "
            "function, whose body would run after the overlap, not in its ubatches"
        )
    overlapped = _wrapper(fn, _whole_arguments(fn, no_split), **options)
    plain = not isinstance(fn, (functools.partial, torch.nn.Module)) and hasattr(fn, "__name__")
    functools.update_wrapper(overlapped, fn, updated=functools.WRAPPER_UPDATES if plain else ())
    overlapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return overlapped


_NOT_PLAIN = (inspect.iscoroutinefunction, inspect.isasyncgenfunction, inspect.isgeneratorfunction)


def _wrapper(
    target: Callable[..., Any], whole: tuple[frozenset[int], frozenset[str], int], *,
    num_ubatches: int, split: SplitFn | None, merge: MergeFn | None,
    min_batch_size: int | None, timeout_s: float | None, device: torch.device | None,
    decision_group: Any, overlap_if: Callable[..., bool] | None, overlap_backward: bool,
) -> Callable[..., Any]:
    """The function `overlap` returns (its options checked)."""

    def inline(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = target(*args, **kwargs)  # a custom merge still shapes the result
        return output if merge is None else merge([output])

    whole_indices, whole_names, last_index = whole

    def overlapped(*args: Any, **kwargs: Any) -> Any:
        if last_index >= len(args):
            raise ValueError(
                f"no_split names positional argument {last_index}, but the call passed "
                f"{len(args)} positional arguments"
            )
        if current_context() is not None:
            return inline(args, kwargs)  # nested: no ubatches inside a ubatch
        # The ubatch threads do not see a torch.func transform or a mode of this thread;
        # with a decision group this rank still votes, so that every rank runs inline.
        must_inline = _under_functorch_transform() or _thread_settings.unreplayed_mode_active()
        if must_inline and decision_group is None:
            return inline(args, kwargs)
        recording = tracing._active
        start = time.perf_counter() if recording is not None else 0.0
        name = "dbo.overlap"
        try:
            cut_args, cut_kwargs, held = hold_out(args, kwargs, whole_indices, whole_names)

            def make_parts(leaves: list[tuple[str, torch.Tensor]]) -> UBatchInputs:
                # A caller in no_grad whose fn turns grad on: the parts keep their link to
                # the inputs, as the inputs themselves would in a direct call.
                with torch.set_grad_enabled(
                    torch.is_grad_enabled() or any(leaf.requires_grad for _, leaf in leaves)
                ):
                    if split is None:  # the leaves were checked when sized
                        local_size = leaves[0][1].size(0)  # every leaf has it (checked)
                        return split_parts(cut_args, cut_kwargs, num_ubatches, local_size)
                    parts = split(cut_args, cut_kwargs, num_ubatches)
                    return _checked_split(parts, num_ubatches)

            leaves, parts = _decided_parts(
                cut_args, cut_kwargs, split is not None, decision_group, must_inline,
                max(num_ubatches, min_batch_size or 1),
                None if overlap_if is None else lambda: overlap_if(*args, **kwargs),
                make_parts,
            )
            if parts is None:
                name = "dbo.overlap inline"
                return inline(args, kwargs)
            run_device = device or next(
                (leaf.device for _, leaf in leaves if leaf.is_cuda), torch.device("cpu")
            )
            inputs = put_back(parts, held)
            # A recomputation (checkpointing around the call) reruns the whole call.
            backward = (
                overlap_backward and torch.is_grad_enabled()
                and not _thread_settings.saved_tensors_hooks_active()
            )
            if backward:
                inputs, own, replaced = own_leaves(inputs)
            with _runner_pool.lease(num_ubatches, device) as runner:
                outputs = runner.run(
                    target, inputs, timeout_s=timeout_s, device=run_device,
                    backward_per_ubatch=backward,
                )
            if backward:
                run_backward = functools.partial(
                    _run_backward, num_ubatches, device, run_device, timeout_s
                )
                outputs = attach(outputs, own, replaced, run_backward)
            return (merge or default_merge)(outputs)
        finally:  # failed calls too: their turns are on the timeline
            if recording is not None:
                recording.add(name, tracing.CALLER, start, time.perf_counter())

    return overlapped


def _run_backward(
    num_ubatches: int, device: torch.device | None, run_device: torch.device,
    timeout_s: float | None, fn: Callable[..., Any], jobs: UBatchInputs,
) -> list[Any]:
    """Run one overlapped call's backward jobs (`dbo.backward`), each in its ubatch
    thread; in turn in this thread when it is a ubatch thread (nothing nests)."""
    if current_context() is not None:
        return [fn(*args, **kwargs) for args, kwargs in jobs]
    recording = tracing._active
    start = time.perf_counter() if recording is not None else 0.0
    try:
        with _runner_pool.lease(num_ubatches, device) as runner:
            return runner.run(fn, jobs, timeout_s=timeout_s, device=run_device)
    finally:
        if recording is not None:
            recording.add("dbo.overlap backward", tracing.CALLER, start, time.perf_counter())


def _whole_arguments(
    fn: Callable[..., Any], no_split: Sequence[Any]
) -> tuple[frozenset[int], frozenset[str], int]:
    """`no_split`'s positions (named parameters' too), names (checked), largest index."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        params = []
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for item in no_split:
        if not isinstance(item, str) and (type(item) is not int or item < 0):
            raise TypeError(f"no_split takes argument names and indices >= 0, got {item!r}")
        if isinstance(item, str) and named and item not in named:
            name = getattr(target, "__qualname__", type(target).__name__)
            raise ValueError(
                f"no_split names {item!r}, which is not a named parameter of {name} (those "
                f"are {', '.join(named)}); for one it takes through **kwargs, wrap it in a "
                "function that names it"
            )
    indices = {item for item in no_split if isinstance(item, int)}
    names = frozenset(item for item in no_split if isinstance(item, str))
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named_at = {i for i, p in enumerate(params) if p.name in names and p.kind in positional}
    return frozenset(indices | named_at), names, max(indices, default=-1)


def hold_out(
    args: tuple[Any, ...], kwargs: dict[str, Any], indices: frozenset[int], names: frozenset[str]
) -> tuple[tuple[Any, ...], dict[str, Any], dict[int | str, Any]]:
    """The arguments without the `no_split` ones (None in their places), and those."""
    held: dict[int | str, Any] = {i: args[i] for i in indices if i < len(args)}
    held.update((name, kwargs[name]) for name in names if name in kwargs)
    if not held:
        return args, kwargs, held
    rest = {key: value for key, value in kwargs.items() if key not in held}
    return tuple(None if i in held else arg for i, arg in enumerate(args)), rest, held


def put_back(parts: UBatchInputs, held: dict[int | str, Any]) -> UBatchInputs:
    """Each ubatch's arguments with the `hold_out` ones back in their places."""
    if not held:
        return parts
    named = {key: value for key, value in held.items() if isinstance(key, str)}
    return [
        (tuple(held.get(i, arg) for i, arg in enumerate(args)), {**kwargs, **named})
        for args, kwargs in parts
    ]


def _checked_split(parts: Any, num_ubatches: int) -> list[Any]:
    """What a custom `split=` returned, checked here so that the error names `split=`."""
    if not isinstance(parts, Iterable):
        raise TypeError(
            f"split= must return a list of {num_ubatches} (args_tuple, kwargs_dict) pairs, "
            f"got {type(parts).__name__}"
        )
    parts = list(parts)
    if len(parts) != num_ubatches:
        raise ValueError(
            f"split= returned {len(parts)} parts for num_ubatches={num_ubatches}; it must "
            "return one (args_tuple, kwargs_dict) pair per ubatch"
        )
    for index, part in enumerate(parts):
        if not runner_module.is_ubatch_input(part):
            described = runner_module.describe_ubatch_input(part)
            raise TypeError(
                f"split= returned {described} as part {index}; each part must be an "
                "(args_tuple, kwargs_dict) pair, e.g. ((x_i,), {})"
            )
    return parts


def _decided_parts(
    args: tuple[Any, ...], kwargs: dict[str, Any], custom_split: bool, group: Any,
    must_inline: bool, smallest: int, overlap_if: Callable[[], bool] | None,
    make_parts: Callable[[list[tuple[str, torch.Tensor]]], UBatchInputs],
) -> tuple[list[tuple[str, torch.Tensor]], UBatchInputs | None]:
    """The (path, tensor) leaves to split and the ubatches' parts, None to run inline:
    this rank's decision (a batch of at least `smallest`, no mode, `overlap_if()`; then
    `make_parts`), or with `group` every rank's together (a MIN all-reduce of the batch
    sizes, 0 from a rank that runs inline). A rank whose input cannot be sized, whose
    `overlap_if` raises or whose split raises (a custom `split=`, a split rule) votes
    before it raises, and every other rank then raises too instead of waiting."""
    parts = None
    try:
        leaves = splittable_leaves(args, kwargs, check_leaves=not custom_split)
        size = _largest_size(leaves) if custom_split else batch_size_of(leaves)
        wanted = size is not None and size >= smallest and not must_inline
        if wanted and not custom_split:
            check_objects(args, kwargs, size)  # type: ignore[arg-type]
        if wanted and overlap_if is not None:
            wanted = bool(overlap_if())
        if wanted:
            parts = make_parts(leaves)
    except Exception:
        if group is not None:
            with contextlib.suppress(Exception):  # this rank's own error says more
                _smallest_batch_across_ranks(_FAILED_RANK, group)
        raise
    if group is not None:
        size = _smallest_batch_across_ranks(size if wanted and size else 0, group, leaves)
        if size == _FAILED_RANK:
            raise RuntimeError(
                "dbo.overlap: another rank of decision_group could not size or split its "
                "input (its own error says why), so no rank runs the function: they would "
                "wait for that rank's collectives"
            )
        wanted = size >= smallest
    return leaves, parts if wanted else None


_FAILED_RANK = -1  # the vote of a rank that cannot size or split its input: the MIN tells all


def _smallest_batch_across_ranks(
    local_size: int, group: Any, leaves: Sequence[tuple[str, torch.Tensor]] = ()
) -> int:
    """MIN of every rank's batch size over `group` (blocking; same call on every rank)."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        # The group's own GPU (init_distributed binds it), else the inputs': the current
        # device is per thread, and another caller thread would name cuda:0 everywhere.
        device = getattr(group, "bound_device_id", None) or next(
            (leaf.device for _, leaf in leaves if leaf.is_cuda),
            torch.device("cuda", torch.cuda.current_device()),
        )
    # torch.full: a copy from host memory would sync the host once more than .item().
    # Outside the caller's modes (a FakeTensorMode would make the vote a fake tensor).
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        size = torch.full((1,), local_size, dtype=torch.int64, device=device)
        dist.all_reduce(size, op=dist.ReduceOp.MIN, group=group)
        return int(size.item())


def _largest_size(leaves: list[tuple[str, torch.Tensor]]) -> int | None:
    """A custom split's batch size: the largest dim 0 (the tokens, in ragged inputs)."""
    return max((int(leaf.size(0)) for _, leaf in leaves), default=None)


def _under_functorch_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is active in this thread."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
