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
carries it upstream) and each parameter's, summed over the ubatches in ubatch order:
with two ubatches the bits of autograd's own sum over the same ubatches in turn.

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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from dbo._torch_private import private
from dbo.split.batch import UBatchInputs, flat_arguments, flatten

RunUBatches = Callable[[Callable[..., Any], UBatchInputs], list[Any]]
"""`run_ubatches(fn, [(args_i, kwargs_i), ...]) -> [fn(*args_i, **kwargs_i), ...]`, each in
its ubatch thread, or in turn in this thread (inside a ubatch, where nothing nests)."""

_leaf_user = torch.empty(1, requires_grad=True).expand(1).grad_fn
assert _leaf_user is not None, "an op on a leaf that requires grad records a node"
_AccumulateGrad = type(_leaf_user.next_functions[0][0])
"""The autograd node of a leaf (its `variable`)."""
del _leaf_user

_ReentrantCheckpoint = type(checkpoint(
    torch.neg, torch.empty(1, requires_grad=True), use_reentrant=True
).grad_fn)
"""The autograd node of `torch.utils.checkpoint(..., use_reentrant=True)`, whose backward
refuses to run inside `torch.autograd.grad`."""


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
        own: dict[int, torch.Tensor] = {}
        originals: list[torch.Tensor] = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                if id(leaf) not in own:
                    own[id(leaf)] = leaf.detach().requires_grad_()
                    originals.append(leaf)
                leaves[index] = own[id(leaf)]
        mine_parts.append(pytree.tree_unflatten(leaves, spec) if own else part)
        mine.append(list(own.values()))
        replaced.append(originals)
    return mine_parts, mine, replaced


def _any_requires_grad(part: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether a tensor in `part` requires grad; no tree walk for flat tensor arguments."""
    leaves = flat_arguments([part])
    if leaves is None:
        leaves = flatten(part)[0]
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)


Edge = tuple[Any, int]
"""An autograd edge: (node, input slot), as in `Node.next_functions`."""


class _Plan:
    """What the node needs for its backward. Per ubatch: its differentiable outputs and
    what to differentiate them by: its own leaves, `leaves[k]` for each k in
    `leaves_at` (the leaves its graph reaches alone), and `edges[e]` for each e in
    `edges_at` (where its graph enters a part that several ubatches' graphs share).
    `region_at`: the leaves (indices into `leaves`) only that shared part reaches."""

    def __init__(self, run_ubatches: RunUBatches) -> None:
        self.run_ubatches = run_ubatches
        self.outputs: list[list[torch.Tensor]] = []
        self.own: list[list[torch.Tensor]] = []
        self.leaves: list[torch.Tensor] = []
        self._index_of: dict[int, int] = {}
        """`id(leaf)` -> its index in `leaves`."""
        self.leaves_at: list[list[int]] = []
        self.edges: list[GradientEdge] = []
        self.edges_at: list[list[int]] = []
        self.region_at: list[int] = []
        self.keep_ubatch_graphs = False
        """Whether every ubatch's backward keeps the graph: when a leaf is reached both
        through a shared part and apart from it, each ubatch's backward runs the shared
        part itself, and the next one runs it again."""

    def add_leaves(self, leaves: list[torch.Tensor]) -> list[int]:
        """The indices of `leaves` in `self.leaves`, added where new."""
        at = []
        for leaf in leaves:
            if id(leaf) not in self._index_of:
                self._index_of[id(leaf)] = len(self.leaves)
                self.leaves.append(leaf)
            at.append(self._index_of[id(leaf)])
        return at


def attach(
    outputs: list[Any], own: list[list[torch.Tensor]], replaced: list[list[torch.Tensor]],
    run_ubatches: RunUBatches,
) -> list[Any]:
    """The ubatches' outputs, each tensor that requires grad replaced by an alias whose
    gradient runs the ubatches' backward through `run_ubatches`; `outputs` as they are
    when none requires grad. `own[i]`: ubatch i's leaves from `own_leaves`, `replaced[i]`
    the tensors they replaced."""
    plan = _Plan(run_ubatches)
    flat = [  # a plain tensor output (the usual case): no tree walk
        ([output], None) if type(output) is torch.Tensor else flatten(output)
        for output in outputs
    ]
    for leaves, _ in flat:
        plan.outputs.append([
            leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ])
    if not any(plan.outputs):
        return outputs
    plan.own = own
    _plan_graphs(plan)
    inputs = [tensor for tensors in replaced for tensor in tensors]
    aliases = iter(_UBatchesBackward.apply(plan, *inputs, *plan.leaves))
    merged = []
    for leaves, spec in flat:
        leaves = [
            next(aliases) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf
            for leaf in leaves
        ]
        merged.append(leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec))
    return merged


def _plan_graphs(plan: _Plan) -> None:
    """Walk each ubatch's graph; where graphs meet (a tensor made before the call and used
    in it, autocast's cached weight casts), each ubatch's stops at the shared part, whose
    backward runs once, on the ubatches' gradients summed (`_UBatchesBackward`), as
    autograd's own would; unless a leaf is also reached apart from the shared part."""
    walks = [
        _walk(_starts(outputs), own, frozenset())
        for outputs, own in zip(plan.outputs, plan.own)
    ]
    walked: set[Any] = set()
    met: set[Any] = set()  # the inner nodes more than one ubatch's walk reached
    for _, _, nodes in walks:
        met |= walked & nodes
        walked |= nodes
    if any(type(node) is _ReentrantCheckpoint for node in walked):
        raise ValueError(
            "fn's graph holds torch.utils.checkpoint(..., use_reentrant=True), whose backward "
            "refuses torch.autograd.grad, and each ubatch's backward is one: checkpoint "
            "with use_reentrant=False (transformers: gradient_checkpointing_kwargs="
            "{'use_reentrant': False}), or pass overlap_backward=False to dbo.overlap (the "
            "backward then runs whole in the caller's thread)"
        )
    if met:
        shared = frozenset(met)
        cut = [
            _walk(_starts(outputs), own, shared)
            for outputs, own in zip(plan.outputs, plan.own)
        ]
        entry_of = {edge: e for e, edge in enumerate(
            dict.fromkeys(edge for _, edges, _ in cut for edge in edges)
        )}
        entries = list(entry_of)
        region, _, _ = _walk(entries, [], frozenset())
        apart = {id(leaf) for leaves, _, _ in cut for leaf in leaves}
        if not any(id(leaf) in apart for leaf in region):
            for leaves, edges, _ in cut:
                plan.leaves_at.append(plan.add_leaves(leaves))
                plan.edges_at.append([entry_of[edge] for edge in edges])
            plan.edges = [GradientEdge(node, slot) for node, slot in entries]
            plan.region_at = plan.add_leaves(region)
            return
        plan.keep_ubatch_graphs = True
    for leaves, _, _ in walks:
        plan.leaves_at.append(plan.add_leaves(leaves))
        plan.edges_at.append([])


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
        if type(node) is _AccumulateGrad:
            reach(node.variable)  # type: ignore[union-attr]
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
        return tuple(output.detach() for outputs in plan.outputs for output in outputs)

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
        keep_graph = _keep_graph()
        if not keep_graph:
            ctx.plan = None  # the ubatches' graphs go with their backward, as autograd's do
        jobs: UBatchInputs = []
        position = 0
        for ubatch_id, outputs in enumerate(plan.outputs):
            roots = [
                (output, grad)
                for output, grad in zip(outputs, grads[position:position + len(outputs)])
                if grad is not None
            ]
            position += len(outputs)
            wrt = [
                *plan.own[ubatch_id], *(plan.leaves[k] for k in plan.leaves_at[ubatch_id]),
                *(plan.edges[e] for e in plan.edges_at[ubatch_id]),
            ]
            jobs.append(((roots, wrt, keep_graph or plan.keep_ubatch_graphs), {}))
        # Lists, emptied as they are summed: a leaf's gradients go once added, so at most
        # two copies of the parameters' gradients live, not three.
        results = [list(result) for result in plan.run_ubatches(_ubatch_backward, jobs)]
        own_grads: list[torch.Tensor | None] = []
        leaf_grads: list[torch.Tensor | None] = [None] * len(plan.leaves)
        edge_grads: list[torch.Tensor | None] = [None] * len(plan.edges)
        for ubatch_id, ubatch_grads in enumerate(results):
            num_own = len(plan.own[ubatch_id])
            own_grads.extend(ubatch_grads[:num_own])
            places = [
                *((leaf_grads, k) for k in plan.leaves_at[ubatch_id]),
                *((edge_grads, e) for e in plan.edges_at[ubatch_id]),
            ]
            for index, (sums, k) in enumerate(places, start=num_own):
                grad, ubatch_grads[index] = ubatch_grads[index], None
                if grad is not None:
                    total = sums[k]
                    sums[k] = grad if total is None else total + grad
        entered = [(edge, grad) for edge, grad in zip(plan.edges, edge_grads) if grad is not None]
        if entered and plan.region_at:
            # The shared part's backward, once, on the ubatches' gradients summed. It keeps
            # the graph: autograd may reach that part again from outside the call.
            edges, summed = zip(*entered)
            region = [plan.leaves[k] for k in plan.region_at]
            for k, grad in zip(plan.region_at, torch.autograd.grad(
                edges, region, summed, retain_graph=True, allow_unused=True
            )):
                total = leaf_grads[k]
                leaf_grads[k] = grad if total is None or grad is None else total + grad
        return (None, *own_grads, *leaf_grads)


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


def _keep_graph() -> bool:
    """Whether the running backward keeps the graph (`retain_graph=True`)."""
    return bool(private.backward_keeps_graph())
