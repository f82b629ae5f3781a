"""The backward of an overlapped call, each ubatch's in its own ubatch thread.

Before the forward, `own_leaves` gives every ubatch leaves of its own: each tensor
argument that requires grad is detached (`requires_grad` kept), so that a ubatch's
autograd graph ends at its arguments instead of running on into the caller's. After it,
`attach` puts one autograd node between the ubatches' outputs and the caller: its inputs
are the arguments as split (they lead upstream) and the other leaves the ubatches'
graphs reach (parameters); its outputs alias the ubatches' outputs. When autograd
reaches the node it runs `torch.autograd.grad` of each ubatch's outputs in that
ubatch's thread (`run_ubatches`: the baton passes at the yield points of the backward,
such as `comm.moe`'s exchanges), then returns each argument's gradient (autograd
carries it upstream) and each parameter's, summed over the ubatches as their backwards
compute them (`dbo.gradient_sums`): with two ubatches the bits of autograd's own sum
over the same ubatches in turn.

Each ubatch's backward runs wholly in its thread (`set_multithreading_enabled(False)`:
on CUDA autograd would otherwise run every ubatch's kernels on its one device thread),
on the streams its forward ran on (autograd runs an op's backward on its forward's
stream). Where the ubatches' graphs meet (a tensor made before the call and used in
it, autocast's cached weight casts), each ubatch's backward stops at the shared part and
returns the gradient entering it; the shared part's backward then runs once, on their
sum, as autograd's own would. Only what comes out of the call's outputs is overlapped:
a loss that reaches a ubatch's graph another way (a tensor kept aside in `fn`) runs that
part in the caller's thread, and its gradient stops at the ubatch's own argument leaves
(`overlap_backward=False` is for such functions).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from dbo import fsdp
from dbo._torch_private import private
from dbo.gradient_sums import GradientSums
from dbo.split.batch import UBatchInputs, flat_arguments, flatten

RunUBatches = Callable[[Callable[..., Any], UBatchInputs], list[Any]]
"""`run_ubatches(fn, [(args_i, kwargs_i), ...]) -> [fn(*args_i, **kwargs_i), ...]`, each in
its ubatch thread, or in turn in this thread (inside a ubatch, where nothing nests)."""


def own_leaves(
    parts: UBatchInputs,
) -> tuple[UBatchInputs, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each ubatch's arguments with every tensor that requires grad replaced by a detached
    leaf of its own (one per tensor, however often it is passed); per ubatch its leaves
    and the tensors they replaced, in the same order."""
    if not any(_any_requires_grad(part) for part in parts):
        return parts, [[] for _ in parts], [[] for _ in parts]
    mine_parts: UBatchInputs = []
    mine: list[list[torch.Tensor]] = []
    replaced: list[list[torch.Tensor]] = []
    for part in parts:
        leaves, spec = flatten(part)
        own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its leaf)
        for index, leaf in enumerate(leaves):
            if _requires_grad(leaf):
                if id(leaf) not in own:
                    own[id(leaf)] = (leaf, leaf.detach().requires_grad_())
                leaves[index] = own[id(leaf)][1]
        mine_parts.append(pytree.tree_unflatten(leaves, spec) if own else part)
        mine.append([leaf for _, leaf in own.values()])
        replaced.append([tensor for tensor, _ in own.values()])
    return mine_parts, mine, replaced


def _any_requires_grad(part: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether a tensor in `part` requires grad; no tree walk for flat tensor arguments."""
    leaves = flat_arguments([part])
    if leaves is None:
        leaves = flatten(part)[0]
    return any(_requires_grad(leaf) for leaf in leaves)


Edge = tuple[Any, int]
"""An autograd edge: (node, input slot), as in `Node.next_functions`."""


@functools.cache
def _leaf_node_type() -> type[Any]:
    """The autograd node of a leaf (its `variable`), learned from a graph of its own at
    first use."""
    with torch.enable_grad():
        leaf_user = torch.empty(1, device="cpu", requires_grad=True).expand(1).grad_fn
    assert leaf_user is not None, "an op on a leaf that requires grad records a node"
    return type(leaf_user.next_functions[0][0])


@functools.cache
def _reentrant_checkpoint_type() -> type[Any]:
    """The autograd node of `torch.utils.checkpoint(..., use_reentrant=True)`, whose backward
    refuses to run inside `torch.autograd.grad`; learned from a checkpoint of its own at
    first use."""
    with torch.enable_grad():
        leaf = torch.empty(1, device="cpu", requires_grad=True)
        return type(checkpoint(torch.neg, leaf, use_reentrant=True).grad_fn)


@dataclass
class _UBatchPlan:
    """One ubatch's part of the plan: its differentiable outputs, and what its backward
    differentiates them by: its own leaves, the plan's `leaves` at `leaf_at` (the leaves
    its graph reaches alone), then the plan's `edges` at `edge_at` (where its graph enters
    a part that several ubatches' graphs share)."""

    outputs: list[torch.Tensor]
    own: list[torch.Tensor]
    leaf_at: list[int] = field(default_factory=list)
    edge_at: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _Plan:
    """What the node needs for its backward: a `_UBatchPlan` per ubatch, the leaves and
    edges they differentiate by, and `region_at`: the leaves (indices into `leaves`) only
    the shared part reaches."""

    run_ubatches: RunUBatches
    ubatches: list[_UBatchPlan]
    leaves: list[torch.Tensor] = field(default_factory=list)
    edges: list[GradientEdge] = field(default_factory=list)
    region_at: list[int] = field(default_factory=list)
    in_turn: bool = False
    """Whether the backwards run in turn in the caller's thread (`attach`)."""
    units: fsdp.SharedBackward | None = None
    """The backward of the FSDP2 units the forwards ran, shared by the ubatches."""
    keep_ubatch_graphs: bool = False
    """Whether every ubatch's backward keeps the graph: when a leaf is reached both
    through a shared part and apart from it, each ubatch's backward runs the shared part
    itself, and the next one runs it again."""
    _index_of: dict[int, int] = field(default_factory=dict)
    """`id(leaf)` -> its index in `leaves`."""

    def add_leaves(self, leaves: list[torch.Tensor]) -> list[int]:
        """The indices of `leaves` in `self.leaves`, added where new."""
        at = []
        for leaf in leaves:
            if id(leaf) not in self._index_of:
                self._index_of[id(leaf)] = len(self.leaves)
                self.leaves.append(leaf)
            at.append(self._index_of[id(leaf)])
        return at

    def jobs(self, grads: Sequence[torch.Tensor | None], keep_graph: bool) -> UBatchInputs:
        """Each ubatch's `_ubatch_backward` arguments: its outputs with their `grads` (the
        node's, ubatch by ubatch; None: unused), what to differentiate them by, in order."""
        jobs: UBatchInputs = []
        grads_left = iter(grads)
        for ubatch in self.ubatches:
            paired = zip(ubatch.outputs, itertools.islice(grads_left, len(ubatch.outputs)))
            roots = [(output, grad) for output, grad in paired if grad is not None]
            wrt = [*ubatch.own, *(self.leaves[k] for k in ubatch.leaf_at),
                   *(self.edges[e] for e in ubatch.edge_at)]
            jobs.append(((roots, wrt, keep_graph), {}))
        return jobs

    def leaf_sums(self) -> GradientSums:
        """The sums of the leaves' gradients, which each ubatch's backward adds into."""
        return GradientSums([self.leaves[k] for k in ubatch.leaf_at] for ubatch in self.ubatches)

    def summed(
        self, results: list[list[Any]], sums: GradientSums
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """From the ubatches' gradients: the own leaves' (ubatch by ubatch), per leaf its
        sum from `sums` (FSDP2 units' parameters: taken already), per edge the sum over
        the ubatches, in ubatch order (None: no gradient)."""
        own_grads: list[torch.Tensor | None] = []
        edge_grads: list[torch.Tensor | None] = [None] * len(self.edges)
        for ubatch, ubatch_grads in zip(self.ubatches, results):
            num_own = len(ubatch.own)
            own_grads.extend(ubatch_grads[:num_own])
            for e, grad in zip(ubatch.edge_at, ubatch_grads[num_own + len(ubatch.leaf_at):]):
                _add(edge_grads, e, grad)
        return own_grads, [sums.pop(leaf) for leaf in self.leaves], edge_grads

    def shared_part_backward(self, edge_grads: list[Any], leaf_grads: list[Any]) -> None:
        """The shared part's backward, once, on the gradients summed at its edges; adds
        into `leaf_grads`. It keeps the graph: autograd may reach that part again from
        outside the call."""
        entered = [(edge, grad) for edge, grad in zip(self.edges, edge_grads) if grad is not None]
        if not entered or not self.region_at:
            return
        edges, summed = zip(*entered)
        region = [self.leaves[k] for k in self.region_at]
        grads = torch.autograd.grad(edges, region, summed, retain_graph=True, allow_unused=True)
        for k, grad in zip(self.region_at, grads):
            _add(leaf_grads, k, grad)


def _add(sums: list[Any], k: int, grad: torch.Tensor | None) -> None:
    """Add `grad` into `sums[k]` (None: nothing to add, or nothing there yet)."""
    if grad is not None:
        total = sums[k]
        sums[k] = grad if total is None else total + grad


def attach(
    outputs: list[Any], own: list[list[torch.Tensor]], replaced: list[list[torch.Tensor]],
    run_ubatches: RunUBatches, in_turn: bool = False, fsdp_units: Sequence[Any] = (),
) -> list[Any]:
    """The ubatches' outputs, each tensor that requires grad replaced by an alias whose
    gradient runs the ubatches' backward through `run_ubatches`; `outputs` as they are
    when none requires grad. `own[i]`: ubatch i's leaves from `own_leaves`, `replaced[i]`
    the tensors they replaced. `in_turn`: the ubatches' backwards run one after the
    other in the caller's thread instead. `fsdp_units`: the FSDP2 units the forwards
    ran, whose backward the ubatches share (`dbo.fsdp.SharedBackward`)."""
    flat = [  # a plain tensor output (the usual case): no tree walk
        ([output], None) if type(output) is torch.Tensor else flatten(output)
        for output in outputs
    ]
    ubatches = [
        _UBatchPlan([leaf for leaf in leaves if _requires_grad(leaf)], own_leaves_i)
        for (leaves, _), own_leaves_i in zip(flat, own)
    ]
    if not any(ubatch.outputs for ubatch in ubatches):
        return outputs
    plan = _Plan(run_ubatches, ubatches, in_turn=in_turn)
    inputs = [tensor for tensors in replaced for tensor in tensors]
    _plan_graphs(plan, fsdp_units)
    aliases = iter(_UBatchesBackward.apply(plan, *inputs, *plan.leaves))
    merged = []
    for leaves, spec in flat:
        leaves = [next(aliases) if _requires_grad(leaf) else leaf for leaf in leaves]
        merged.append(leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec))
    return merged


def _requires_grad(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.requires_grad


def _plan_graphs(plan: _Plan, fsdp_units: Sequence[Any]) -> None:
    """Walk each ubatch's graph; where graphs meet (a tensor made before the call and used
    in it, autocast's cached weight casts), each ubatch's stops at the shared part, whose
    backward runs once, on the ubatches' gradients summed (`_UBatchesBackward`), as
    autograd's own would; unless a leaf is also reached apart from the shared part. The
    `fsdp_units` the forwards ran get their shared backward (`plan.units`)."""
    walks = [_walk(_starts(ubatch.outputs), ubatch.own, frozenset()) for ubatch in plan.ubatches]
    walked: set[Any] = set()
    met: set[Any] = set()  # the inner nodes more than one ubatch's walk reached
    for _, _, nodes in walks:
        met |= walked & nodes
        walked |= nodes
    if fsdp_units:
        plan.units = fsdp.SharedBackward(fsdp_units)
    reentrant = _reentrant_checkpoint_type()
    if any(type(node) is reentrant for node in walked):
        raise ValueError(
            "fn's graph holds torch.utils.checkpoint(..., use_reentrant=True), whose backward "
            "refuses torch.autograd.grad, and each ubatch's backward is one: checkpoint "
            "with use_reentrant=False (transformers: gradient_checkpointing_kwargs="
            "{'use_reentrant': False}), or pass overlap_backward=False to dbo.overlap (the "
            "backward then runs whole in the caller's thread)"
        )
    if met:
        shared = frozenset(met)
        cut = [_walk(_starts(ubatch.outputs), ubatch.own, shared) for ubatch in plan.ubatches]
        entry_of = {edge: e for e, edge in enumerate(
            dict.fromkeys(edge for _, edges, _ in cut for edge in edges)
        )}
        region, _, _ = _walk(list(entry_of), [], frozenset())
        apart = {id(leaf) for leaves, _, _ in cut for leaf in leaves}
        if not any(id(leaf) in apart for leaf in region):
            for ubatch, (leaves, edges, _) in zip(plan.ubatches, cut):
                ubatch.leaf_at = plan.add_leaves(leaves)
                ubatch.edge_at = [entry_of[edge] for edge in edges]
            plan.edges = [GradientEdge(node, slot) for node, slot in entry_of]
            plan.region_at = plan.add_leaves(region)
            return
        plan.keep_ubatch_graphs = True
    for ubatch, (leaves, _, _) in zip(plan.ubatches, walks):
        ubatch.leaf_at = plan.add_leaves(leaves)


def _starts(outputs: list[torch.Tensor]) -> list[Edge | torch.Tensor]:
    """Where a walk of `outputs`' graph starts: their edges, or themselves for leaves."""
    return [
        output if output.grad_fn is None else (output.grad_fn, output.output_nr)
        for output in outputs
    ]


def _walk(
    starts: Sequence[Edge | torch.Tensor], own: list[torch.Tensor], stop: frozenset[Any]
) -> tuple[list[torch.Tensor], list[Edge], set[Any]]:
    """From `starts` (edges, or leaves): the leaves that require grad reached, other than
    `own`; the edges into `stop` nodes (not walked past); the inner nodes walked."""
    leaf_node = _leaf_node_type()
    skip = {id(tensor) for tensor in own}
    leaves: list[torch.Tensor] = []
    edges: dict[Edge, None] = {}  # ordered, each edge once
    nodes: set[Any] = set()
    stack: list[Any] = []

    def reach(item: Edge | torch.Tensor) -> None:
        if isinstance(item, torch.Tensor):
            if id(item) not in skip:
                skip.add(id(item))
                leaves.append(item)
            return
        node = item[0]
        if type(node) is leaf_node:
            reach(node.variable)
        elif node in stop:
            edges[item] = None
        elif node not in nodes:
            nodes.add(node)
            stack.append(node)

    for start in starts:
        reach(start)
    while stack:
        for edge in stack.pop().next_functions:
            if edge[0] is not None:
                reach(edge)
    return leaves, list(edges), nodes


class _UBatchesBackward(torch.autograd.Function):
    """Inputs: the plan, the split arguments that require grad (ubatch by ubatch), then
    the plan's leaves. Outputs: aliases of the ubatches' differentiable outputs."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an unused output: no backward for it
        return tuple(output.detach() for ubatch in plan.ubatches for output in ubatch.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        plan: _Plan | None = ctx.plan
        if plan is None:
            raise RuntimeError(
                "Trying to backward through the graph of a dbo.overlap call a second time; "
                "its buffers were freed. Specify retain_graph=True the first time"
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "dbo.overlap runs each ubatch's backward in its ubatch thread, which does "
                "not record a graph of the backward: create_graph=True (double backward, "
                "a gradient penalty) is not supported there. Pass overlap_backward=False "
                "to dbo.overlap: the backward then runs whole in the caller's thread"
            )
        _refuse_hooks(plan.leaves)
        keep_graph = bool(private.backward_keeps_graph())  # the caller's retain_graph
        if not keep_graph:
            ctx.plan = None  # the ubatches' graphs go with their backward, as autograd's do
        jobs = plan.jobs(grads, keep_graph or plan.keep_ubatch_graphs)
        # The leaves' gradients are summed as they come: one copy of them at the peak.
        sums = plan.leaf_sums()
        with sums, plan.units.summing(sums) if plan.units else nullcontext():
            if plan.in_turn:
                results = [list(_ubatch_backward(*args)) for args, _ in jobs]
            else:
                results = [list(result) for result in plan.run_ubatches(_ubatch_backward, jobs)]
        own_grads, leaf_grads, edge_grads = plan.summed(results, sums)
        plan.shared_part_backward(edge_grads, leaf_grads)
        return (None, *own_grads, *leaf_grads)


def _refuse_hooks(leaves: list[torch.Tensor]) -> None:
    """autograd runs a leaf's `register_hook` hooks once, on the gradient summed over the
    ubatches; each ubatch's backward would run them on its share first."""
    for leaf in leaves:
        if private.tensor_hooks.__get__(leaf):
            raise ValueError(
                f"a tensor of shape {leaf.shape} that fn's graph reaches (a parameter) has a "
                "hook (Tensor.register_hook), which autograd runs once on the gradient "
                "summed over the ubatches; each ubatch's backward would run it on its share "
                "as well. Pass overlap_backward=False to dbo.overlap (the backward then runs "
                "whole in the caller's thread), or use register_post_accumulate_grad_hook, "
                "which runs once"
            )


def _ubatch_backward(
    roots: list[tuple[torch.Tensor, torch.Tensor]], wrt: list[torch.Tensor], keep_graph: bool
) -> Sequence[torch.Tensor | None]:
    """One ubatch's gradients of `wrt`, in this thread (its ubatch thread)."""
    if not roots or not wrt:
        return [None] * len(wrt)
    outputs, grads = zip(*roots)
    with torch.autograd.set_multithreading_enabled(False):
        return torch.autograd.grad(
            outputs, wrt, grads, retain_graph=keep_graph, allow_unused=True
        )

