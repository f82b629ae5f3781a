"""`dbo.overlap`: wrap a callable so that each call runs as overlapped ubatches."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import types
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, TypeVar, overload

import torch

from dbo import fsdp, tracing
from dbo._checks import check_num_ubatches, check_timeout
from dbo._decide import decided_parts
from dbo._torch_private import private
from dbo.backward import attach, own_leaves
from dbo.runtime import thread_settings
from dbo.runtime.context import current_context
from dbo.runtime.pool import runner_pool
from dbo.split.batch import UBatchInputs, checked_ubatch_inputs, split_parts
from dbo.split.outputs import default_merge

F = TypeVar("F", bound=Callable[..., Any])

SplitFn = Callable[[tuple[Any, ...], dict[str, Any], int], UBatchInputs]  # -> [(args, kwargs)]
MergeFn = Callable[[Sequence[Any]], Any]  # merge([output_0, output_1, ...]) -> output
NoSplit = Sequence[str | int] | str | int  # argument names and positional indices


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
            (with two ubatches bitwise, unless autograd sums some terms in another order:
            a parameter used more than once per ubatch, as tied weights are, or under
            autocast, whose cache of weight casts the ubatch threads share: allclose).
            The function must then not modify its arguments in place, and return every
            tensor a loss uses; the backward takes no `create_graph=True`. False: the
            backward runs whole in the caller's thread, blocking at each exchange (use it
            for those cases). It does so anyway under saved-tensor hooks around the call
            (the call checkpointed with `torch.utils.checkpoint`, `save_on_cpu`).
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
    options = Options(
        num_ubatches=num_ubatches, split=split, merge=merge, min_batch_size=min_batch_size,
        timeout_s=timeout_s, device=None if device is None else torch.device(device),
        decision_group=decision_group, overlap_if=overlap_if, overlap_backward=overlap_backward,
    )
    if fn is None:
        return lambda fn: Overlapped(fn, no_split, options)
    return Overlapped(fn, no_split, options)


_NOT_PLAIN = (inspect.iscoroutinefunction, inspect.isasyncgenfunction, inspect.isgeneratorfunction)


@dataclasses.dataclass(frozen=True)
class Options:
    """`dbo.overlap`'s options, checked (see its docstring)."""

    num_ubatches: int
    split: SplitFn | None
    merge: MergeFn | None
    min_batch_size: int | None
    timeout_s: float | None
    device: torch.device | None
    decision_group: Any
    overlap_if: Callable[..., bool] | None
    overlap_backward: bool


class Overlapped:
    """What `dbo.overlap(fn)` returns: calls `fn` on overlapped ubatches of its batch.

    It has `fn`'s name, docstring and signature (`__wrapped__` is `fn`) and, stored on
    a class, binds as a method as a function does. `options` holds the checked options.
    """

    def __init__(self, fn: Any, no_split: tuple[Any, ...], options: Options) -> None:
        if not callable(fn):
            raise TypeError(f"dbo.overlap needs a callable, got {fn!r}")
        if any(is_kind(fn) for is_kind in _NOT_PLAIN):  # a call would not run the body
            raise TypeError(
                f"dbo.overlap needs a plain function; {fn!r} is a coroutine or generator "
                "function, whose body would run after the overlap, not in its ubatches"
            )
        plain = hasattr(fn, "__name__") and not isinstance(fn, (functools.partial, torch.nn.Module))
        functools.update_wrapper(self, fn, updated=functools.WRAPPER_UPDATES if plain else ())
        fsdp.refuse_fsdp1(fn)
        # Set after update_wrapper, which copies a plain function's __dict__ onto this one.
        self.dbo_target = fn
        self.dbo_whole = _whole_arguments(fn, no_split)
        self.options = options

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<dbo.overlap of {self.dbo_target!r}>"

    def _inline(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = self.dbo_target(*args, **kwargs)  # a custom merge still shapes the result
        merge = self.options.merge
        return output if merge is None else merge([output])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = self.options
        whole_indices, whole_names, last_index = self.dbo_whole
        if last_index >= len(args):
            raise ValueError(
                f"no_split names positional argument {last_index}, but the call passed "
                f"{len(args)} positional arguments"
            )
        if current_context() is not None:
            return self._inline(args, kwargs)  # nested: no ubatches inside a ubatch
        # The ubatch threads do not see a torch.func transform or a mode of this thread;
        # with a decision group this rank still votes, so that every rank runs inline.
        must_inline = (
            private.transform_on_stack() is not None  # grad, vmap, jvp, ...
            or thread_settings.unreplayed_mode_active()
        )
        if must_inline and options.decision_group is None:
            return self._inline(args, kwargs)
        recording = tracing.recording
        start = time.perf_counter() if recording is not None else 0.0
        name = "dbo.overlap"
        try:
            cut_args, cut_kwargs, held = hold_out(args, kwargs, whole_indices, whole_names)
            overlap_if = options.overlap_if
            leaves, parts = decided_parts(
                cut_args, cut_kwargs,
                smallest=max(options.num_ubatches, options.min_batch_size or 1),
                custom_split=options.split is not None, must_inline=must_inline,
                overlap_if=None if overlap_if is None else lambda: overlap_if(*args, **kwargs),
                make_parts=lambda leaves: self._parts(cut_args, cut_kwargs, leaves),
                group=options.decision_group,
            )
            if parts is None:
                name = "dbo.overlap inline"
                return self._inline(args, kwargs)
            return self._run(put_back(parts, held), leaves)
        finally:  # failed calls too: their turns are on the timeline
            if recording is not None:
                recording.add(name, tracing.CALLER, start, time.perf_counter())

    def _parts(
        self, args: tuple[Any, ...], kwargs: dict[str, Any],
        leaves: list[tuple[str, torch.Tensor]],
    ) -> UBatchInputs:
        """The ubatches' arguments. A caller in no_grad whose fn turns grad on: the parts
        keep their link to the inputs, as the inputs themselves would in a direct call."""
        split, num_ubatches = self.options.split, self.options.num_ubatches
        with torch.set_grad_enabled(
            torch.is_grad_enabled() or any(leaf.requires_grad for _, leaf in leaves)
        ):
            if split is None:  # the leaves were checked when sized
                local_size = leaves[0][1].size(0)  # every leaf has it (checked)
                return split_parts(args, kwargs, num_ubatches, local_size)
            parts = split(args, kwargs, num_ubatches)
            return checked_ubatch_inputs(parts, num_ubatches, "split(args, kwargs, num_ubatches)")

    def _run(self, inputs: UBatchInputs, leaves: list[tuple[str, torch.Tensor]]) -> Any:
        """Run the ubatches (their backward too, under grad mode) and merge."""
        options = self.options
        run_device = options.device or next(
            (leaf.device for _, leaf in leaves if leaf.is_cuda), torch.device("cpu")
        )
        # A recomputation (checkpointing around the call) reruns the whole call.
        grad = torch.is_grad_enabled() and not thread_settings.saved_tensors_hooks_active()
        backward = options.overlap_backward and grad
        # The FSDP2 units the forward runs share their backward (`dbo.fsdp`). In a process
        # that shards with FSDP2, overlap_backward=False runs the ubatches' backwards in
        # turn in the caller's thread: the caller's own backward would interleave the
        # ubatches' nodes inside a unit.
        sharded = fsdp.in_use()
        node = backward or (sharded and grad)  # dbo's node takes the backward
        if node:
            inputs, own, replaced = own_leaves(inputs)
        units = fsdp.SharedUnits(options.num_ubatches) if sharded else None
        with units or nullcontext(), runner_pool.lease(
            options.num_ubatches, options.device
        ) as runner:
            outputs = runner.run(
                self.dbo_target, inputs, timeout_s=options.timeout_s, device=run_device,
                backward_per_ubatch=node,
            )
        if node:
            run_backward = functools.partial(_run_backward, options, run_device)
            outputs = attach(outputs, own, replaced, run_backward, in_turn=not backward,
                             fsdp_units=units.units if units is not None else ())
        return (options.merge or default_merge)(outputs)


def _run_backward(
    options: Options, run_device: torch.device, fn: Callable[..., Any], jobs: UBatchInputs
) -> list[Any]:
    """Run one overlapped call's backward jobs (`dbo.backward`), each in its ubatch
    thread; in turn in this thread when it is a ubatch thread (nothing nests)."""
    if current_context() is not None:
        return [fn(*args, **kwargs) for args, kwargs in jobs]
    recording = tracing.recording
    start = time.perf_counter() if recording is not None else 0.0
    try:
        with runner_pool.lease(options.num_ubatches, options.device) as runner:
            return runner.run(fn, jobs, timeout_s=options.timeout_s, device=run_device)
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
