"""FSDP2 (`torch.distributed.fsdp.fully_shard`) units inside an overlapped call.

Forward: FSDP2 gathers a unit's parameters in its forward pre-hook and, with
`reshard_after_forward`, frees them in its post-hook. The ubatches of one call are inside
a unit together (one waits at an exchange while the other computes), so the first to
leave would free what the other still computes with. `SharedUnits` keeps a unit's
parameters gathered until no ubatch is inside it and each has left it as often (a unit
may run several times per forward): one all-gather and one reshard per unit run per
overlapped forward, however many ubatches. And the ubatches take turns per
unit: a yield as each enters one (a global forward pre-hook, before FSDP2's own), so the
first cannot gather every unit before the other has left the first (measured, 16 units
and no other yield: the forward's peak 4.7x the whole batch's, the backward's 3.3x;
`benchmarks/backward_memory.py --wrapper fsdp`). FSDP2 has no public way to
hold a unit's post-forward work back, so `_Held` reads and sets its internals (each
exists in torch 2.11 and 2.13; the distributed tests check the behaviour): a unit's
`_get_fsdp_state()`, the state's `_fsdp_param_groups` (2.13; `_fsdp_param_group`
before) and `_state_ctx.iter_forward_root`, and each group's `post_forward_mesh_info`
and `_training_state`. The last exit puts them back, so FSDP2's own post-hook then
reshards as configured (True, or an int: to a smaller mesh).

Backward: FSDP2 unshards a unit in a hook on its outputs' gradients, and reduce-scatters
its parameters' `.grad` (then reshards) in an autograd node on its inputs
(`RegisterPostBackwardFunction`), which only the first ubatch into a unit gets when
another is inside it. Each ubatch's backward (`torch.autograd.grad`, in its thread)
captures the parameters' gradients, and dbo's node would hand them to autograd only
after every ubatch's. `SharedBackward` makes one backward through each unit of the
units the forward ran (`SharedUnits.units`): each ubatch enters a unit's pre-backward
after a yield, as in the forward, and the first unshards (FSDP2 does not unshard
twice); FSDP2's post-backward nodes do nothing while the ubatches run; the node sums
every leaf's gradients as they come (`dbo.gradient_sums`), and when the last gradient a
unit expects has come (one per parameter per ubatch whose graph reaches it) this hands
FSDP2 the sums as `.grad` and runs its post-backward: one reduce-scatter per unit, as
soon as every ubatch's backward has left it, while the other units' backwards go on.
FSDP2's end-of-backward callback, which a ubatch's backward would run at its own end,
runs once, at the end of the caller's backward. Internals again: a group's
`pre_backward` and `post_backward` (shadowed on the instance while the ubatches run),
`fsdp_params` and `unsharded_param`, the state context's `all_states` and
`post_backward_final_callback_queued`, and the root's `_root_post_backward_final_callback`.

In a process that shards with FSDP2, `overlap_backward=False` runs the ubatches'
backwards in turn in the caller's thread through dbo's node, sharing the units the same
way: the caller's own backward would interleave the ubatches' nodes inside a unit.

With FSDP2 not imported, or no module sharded, nothing here runs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any

import torch

from dbo._torch_private import private
from dbo.gradient_sums import GradientSums
from dbo.runtime.context import current_context
from dbo.ubatch import yield_


def in_use() -> bool:
    """Whether this process has sharded a module with FSDP2's `fully_shard` (it makes a
    subclass of `FSDPModule` for each class it shards)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and bool(fsdp.FSDPModule.__subclasses__())


def refuse_fsdp1(target: Any) -> None:
    """ValueError if `target` (what `dbo.overlap` wraps: a module, or a module's bound
    method) holds a `FullyShardedDataParallel` module (FSDP1): dbo is not checked with it
    (it needs an accelerator, and it shards by its own hooks, not FSDP2's)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module = getattr(target, "__self__", target)
    if fsdp is None or not isinstance(module, torch.nn.Module):
        return
    for inner in module.modules():
        if isinstance(inner, fsdp.FullyShardedDataParallel):
            raise ValueError(
                f"dbo.overlap's function holds {type(inner.module).__name__} wrapped in "
                "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1), which dbo is not "
                "checked with; shard with FSDP2's torch.distributed.fsdp.fully_shard, "
                "which dbo supports"
            )


class SharedUnits:
    """`with SharedUnits(num_ubatches):` around one overlapped forward (see the module's
    docstring). A module forward hook of the whole process, for the call's duration; it
    acts only in ubatch threads. Calls overlapped in several threads at once over FSDP2
    units are not supported (FSDP2 runs one forward of a unit at a time)."""

    def __init__(self, num_ubatches: int) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_module = FSDPModule
        self._num_ubatches = num_ubatches
        self._runs: dict[torch.nn.Module, list[int]] = {}
        """Unit -> how many times each ubatch has left it."""
        self._inside: dict[torch.nn.Module, int] = {}
        """Unit -> how many ubatches are inside it now."""
        self._held: dict[torch.nn.Module, _Held] = {}
        """Unit -> what an exit held back, until every ubatch has left it as often."""
        self.units: list[torch.nn.Module] = []
        """The units the ubatches ran, in the order they first left them."""

    def __enter__(self) -> SharedUnits:
        module = torch.nn.modules.module
        self._hooks = (module.register_module_forward_pre_hook(self._enter),
                       module.register_module_forward_hook(self._leave))
        return self

    def __exit__(self, *exc: object) -> None:
        """Units some ubatch never left (a ubatch that took another branch, or failed)
        get their setting back and are resharded now."""
        for hook in self._hooks:
            hook.remove()
        for unit, held in self._held.items():
            held.put_back(last=False)
            if any(mesh is not None for _, mesh in held.meshes):
                unit.reshard()  # type: ignore[operator]
        self._held.clear()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        """Before FSDP2's own pre-hook (global hooks run first): the ubatches take turns
        per unit, so that each leaves a unit soon after the other instead of gathering
        every unit before the other has left the first."""
        if isinstance(module, self._fsdp_module) and current_context() is not None:
            yield_()
            self._inside[module] = self._inside.get(module, 0) + 1

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Runs before the unit's own post-hooks (global hooks run first). The exit that
        leaves no ubatch inside the unit and every ubatch having left it as often (a
        unit may run several times in one forward) lets FSDP2 reshard it; any other
        holds the reshard back."""
        context = current_context()
        if not isinstance(module, self._fsdp_module) or context is None:
            return
        runs = self._runs.get(module)
        if runs is None:
            runs = self._runs[module] = [0] * self._num_ubatches
            self.units.append(module)
        runs[context.ubatch_id] += 1
        self._inside[module] -= 1
        if self._inside[module] or min(runs) < max(runs):
            if module not in self._held:
                self._held[module] = _Held(module)
        elif module in self._held:
            self._held.pop(module).put_back(last=True)


class _Held:
    """What a unit's first exit holds back from FSDP2's post-hook until its last: the
    reshard (its param groups' `post_forward_mesh_info`, None meanwhile), the groups'
    state inside a forward (which the post-hook ends: the last exit's post-hook reads
    it to choose how to reshard), and for the root of the forward its end-of-forward
    work (the state's `iter_forward_root`, None meanwhile)."""

    def __init__(self, unit: Any) -> None:
        self.state = unit._get_fsdp_state()
        groups = _param_groups(self.state)
        self.meshes = [(group, group.post_forward_mesh_info) for group in groups]
        self.in_forward = [(group, group._training_state) for group in groups]
        for group in groups:
            group.post_forward_mesh_info = None
        context = self.state._state_ctx
        self.root = context.iter_forward_root is self.state
        if self.root:
            context.iter_forward_root = None

    def put_back(self, last: bool) -> None:
        """The reshard setting back; at the unit's `last` exit the forward state and the
        root mark too (a call that ends with a ubatch still inside keeps them ended)."""
        for group, mesh in self.meshes:
            group.post_forward_mesh_info = mesh
        if not last:
            return
        for group, training_state in self.in_forward:
            group._training_state = training_state
        if self.root:
            self.state._state_ctx.iter_forward_root = self.state


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's param groups: a list from torch 2.13 (`fully_shard([a, b])` may
    make several), one or none before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


class SharedBackward:
    """The backward of the FSDP2 `units` one overlapped forward ran, shared by its
    ubatches (see the module's docstring): `with shared.summing(sums):` around the
    ubatches' backwards, where `sums` (`dbo.gradient_sums`) sums every leaf's gradients;
    the units' parameters' sums go to FSDP2 here, not through dbo's node."""

    def __init__(self, units: Iterable[Any]) -> None:
        states = [unit._get_fsdp_state() for unit in units]
        self._context = states[0]._state_ctx
        self._groups = list(dict.fromkeys(g for state in states for g in _param_groups(state)))
        self._params_of = {group: [param.unsharded_param for param in group.fsdp_params
                                   if hasattr(param, "_unsharded_param")]
                           for group in self._groups}
        """Param group -> its unsharded parameters (the leaves the ubatches' graphs reach)."""
        self._group_of = {id(param): group
                          for group, params in self._params_of.items() for param in params}

    def summing(self, sums: GradientSums) -> SharedBackward:
        """Release each unit from `sums` when the last gradient of its parameters that the
        ubatches' backwards give has come."""
        self._sums = sums
        self._pending = {group: sum(1 for param in params if sums.expected[id(param)])
                         for group, params in self._params_of.items()}
        """Param group -> its parameters with gradients still to come."""
        return self

    def __enter__(self) -> SharedBackward:
        # FSDP2's end-of-backward work runs once, after the ubatches (`__exit__`).
        self._queued = self._context.post_backward_final_callback_queued
        self._context.post_backward_final_callback_queued = True
        self._sums.on_last = self._param_done
        self._released: set[Any] = set()
        for group in self._groups:  # the units' post-backward nodes: released here instead
            group.post_backward = _not_yet
            group.pre_backward = functools.partial(_in_turns, group)
        return self

    def __exit__(self, *exc: object) -> None:
        self._sums.on_last = None
        for group in self._groups:
            del group.post_backward, group.pre_backward  # FSDP2's own methods again
        if exc[0] is not None:  # the backward fails: FSDP2's own end-of-backward does not run
            self._context.post_backward_final_callback_queued = self._queued
            return
        for group in self._groups:
            if group not in self._released:  # gradients that did not come, or not reached
                self._release(group)
        if not self._queued:
            root = next(state for state in self._context.all_states if state._is_root)
            private.backward_engine.queue_callback(root._root_post_backward_final_callback)

    def _param_done(self, key: int) -> None:
        group = self._group_of.get(key)
        if group is not None:
            self._pending[group] -= 1
            if not self._pending[group]:
                self._release(group)

    def _release(self, group: Any) -> None:
        """The unit's summed gradients to its parameters' `.grad` (added, as autograd
        accumulates), then FSDP2's post-backward: one reduce-scatter, the reshard."""
        self._released.add(group)
        for param in self._params_of[group]:
            grad = self._sums.pop(param)
            if grad is not None:
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad
        type(group).post_backward(group)


def _in_turns(group: Any, *args: Any, **kwargs: Any) -> None:
    """A unit's pre-backward (its unshard) while the ubatches' backwards run: after a
    yield, as `SharedUnits._enter`, so each ubatch's backward leaves a unit soon after
    the other and the unit's sums go to FSDP2 before the next units are gathered."""
    yield_()
    type(group).pre_backward(group, *args, **kwargs)


def _not_yet(*unused: Any) -> None:
    """A unit's post-backward node, while the ubatches' backwards run: `SharedBackward`
    releases the unit when every gradient of it has come, instead."""
