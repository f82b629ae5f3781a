"""FSDP2 (`torch.distributed.fsdp.fully_shard`) units inside an overlapped call.

Forward: FSDP2 gathers a unit's parameters in its forward pre-hook and, with
`reshard_after_forward`, frees them in its post-hook. The ubatches of one call are inside
a unit together (one waits at an exchange while the other computes), so the first to
leave would free what the other still computes with. `SharedUnits` keeps a unit's
parameters gathered until its last ubatch has left it: one all-gather and one reshard
per unit per overlapped forward, however many ubatches. FSDP2 has no public way to
hold a unit's post-forward work back, so `_Held` reads and sets its internals (each
exists in torch 2.11 and 2.13; the distributed tests check the behaviour): a unit's
`_get_fsdp_state()`, the state's `_fsdp_param_groups` (2.13; `_fsdp_param_group`
before) and `_state_ctx.iter_forward_root`, and each group's `post_forward_mesh_info`
and `_training_state`. The last exit puts them back, so FSDP2's own post-hook then
reshards as configured (True, or an int: to a smaller mesh).

Backward: FSDP2 reduce-scatters a unit's gradients from an autograd node of its own
(`RegisterPostBackwardFunction`), inside the backward that ran the unit, from the
parameters' `.grad`. dbo's overlapped backward computes the ubatches' gradients with
`torch.autograd.grad` and hands them to autograd after that node has run, so they would
never reach the sharded parameters: `refuse_overlapped_backward` raises for such a graph,
naming `overlap_backward=False`. In a process that shards with FSDP2, that option runs
each ubatch's backward in turn in the caller's thread (`dbo.backward`'s `in_turn`), so
that FSDP2 sees one backward through a unit at a time, as it expects.

With FSDP2 not imported, or no module sharded, nothing here runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from dbo.runtime.context import current_context

_POST_BACKWARD_NODE = "RegisterPostBackwardFunctionBackward"
"""The name of FSDP2's post-backward node (`Node.name()`)."""


def in_use() -> bool:
    """Whether this process has sharded a module with FSDP2's `fully_shard` (it makes a
    subclass of `FSDPModule` for each class it shards)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and bool(fsdp.FSDPModule.__subclasses__())


class SharedUnits:
    """`with SharedUnits(num_ubatches):` around one overlapped forward (see the module's
    docstring). A module forward hook of the whole process, for the call's duration; it
    acts only in ubatch threads. Calls overlapped in several threads at once over FSDP2
    units are not supported (FSDP2 runs one forward of a unit at a time)."""

    def __init__(self, num_ubatches: int) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_module = FSDPModule
        self._num_ubatches = num_ubatches
        self._left: dict[torch.nn.Module, int] = {}
        """Unit -> how many ubatches have left it."""
        self._held: dict[torch.nn.Module, _Held] = {}
        """Unit -> what its first exit held back, until its last."""

    def __enter__(self) -> SharedUnits:
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._leave)
        return self

    def __exit__(self, *exc: object) -> None:
        """Units some ubatch never left (a ubatch that took another branch, or failed)
        get their setting back and are resharded now."""
        self._hook.remove()
        for unit, held in self._held.items():
            held.put_back(last=False)
            if any(mesh is not None for _, mesh in held.meshes):
                unit.reshard()  # type: ignore[operator]
        self._held.clear()

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Runs before the unit's own post-hooks (global hooks run first)."""
        if not isinstance(module, self._fsdp_module) or current_context() is None:
            return
        left = self._left.get(module, 0) + 1
        self._left[module] = left
        if left == 1 and left < self._num_ubatches:
            self._held[module] = _Held(module)
        elif left == self._num_ubatches and module in self._held:
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


def refuse_overlapped_backward(nodes: Iterable[Any]) -> None:
    """ValueError if the ubatches' graphs (their `nodes`) hold an FSDP2 unit."""
    if any(node.name() == _POST_BACKWARD_NODE for node in nodes):
        raise ValueError(
            "fn runs a module sharded by FSDP2 (torch.distributed.fsdp.fully_shard), whose "
            "gradients reach its sharded parameters only inside the backward that runs "
            "its unit; dbo's overlapped backward hands the parameters' gradients to "
            "autograd after the ubatches' backward, where FSDP2 would drop them. Pass "
            "overlap_backward=False to dbo.overlap: the forward still overlaps, and each "
            "ubatch's backward then runs in turn in the caller's thread, as FSDP2 expects"
        )
