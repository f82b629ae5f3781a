"""`comm.moe.shard_experts`: make a Hugging Face MoE model expert-parallel in place."""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.distributed as dist

from comm._checks import resolve_group
from comm.moe.dynamic import combine, dispatch
from comm.moe.fixed import check_capacity, combine_fixed, dispatch_fixed


def shard_experts(
    model: torch.nn.Module, group: dist.ProcessGroup | None = None, *,
    capacity: int | None = None,
) -> list[str]:
    """Keep only this rank's experts in every sparse MoE block of `model`, in place, and
    route the tokens to them through `comm.moe.dispatch`/`combine`.

    A block (`transformers` >= 5: Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS, ...) is a module
    with an `experts` child whose own parameters are stacked `[num_experts, ...]` and a
    router weight `[num_experts, hidden]` outside it (a child's, or deeper as HunYuan's and
    AfMoE's). Rank r of `group` (None: the default group) keeps experts
    `[r * E_local, (r + 1) * E_local)`. The block's forward runs as before (router, shared
    experts); its experts module dispatches the rows, runs the model's own expert
    computation with unit weights (`combine` applies the routing weights) and combines.
    Every rank then runs the same forward calls (collectives); the output equals the
    unsharded model's (allclose), gradients too. Shard after loading a checkpoint, before
    building an optimizer.

    `capacity` switches to the fixed-shape path (`dispatch_fixed`, `check_ids=False`: the
    router's ids are in range) with that many rows per (rank, expert), the same on every
    rank: pairs past it are dropped (zero contribution), so give at least the most tokens
    one rank has in one call to drop none (times top-k if a router may pick one expert twice
    for a token: DeepSeek-V4's hash routing reads a table that allows it). The experts also
    run on the padding rows; the forward is free of host reads only if the model's expert
    computation is too (in transformers, `experts_implementation="batched_mm"` or
    `"grouped_mm"`).

    Returns the names of the blocks changed; ValueError naming the model's class when it
    has none (or only sharded ones), when an expert count is not divisible by the group's
    size, and naming the block when its experts' forward takes no routing (Llama 4's).
    """
    base = resolve_group(group)
    blocks = [(name, module) for name, module in model.named_modules() if _num_experts(module)]
    if not blocks:
        raise ValueError(
            f"shard_experts found no sparse MoE block in {type(model).__name__}: a module "
            "with an `experts` child holding stacked [num_experts, ...] parameters and a "
            "router weight [num_experts, hidden] outside it, not sharded already"
        )
    for name, block in blocks:
        if _num_experts(block) % base.size() != 0:
            raise ValueError(
                f"{name} has {_num_experts(block)} experts, which do not split evenly over "
                f"the {base.size()} ranks of the group; use a group whose size divides it"
            )
        try:  # the sharded forward calls it with the rows and their routing
            inspect.signature(type(block.experts).forward).bind(
                block.experts, "hidden_states", "top_k_index", "top_k_weights"
            )
        except TypeError:
            raise ValueError(
                f"shard_experts cannot route {name}.experts ({type(block.experts).__name__}): "
                "its forward does not take (hidden_states, top_k_index, top_k_weights); a "
                "block that weights every token for every expert before its experts (Llama "
                "4's) has no routing to send tokens by, and is not supported"
            ) from None
    if capacity is not None:
        check_capacity(capacity)
    for _, block in blocks:
        _shard(block.experts, _Routing(base, _num_experts(block), capacity))
    return [name for name, _ in blocks]


def _num_experts(module: torch.nn.Module) -> int:
    """The expert count of a sparse MoE block not sharded yet; 0 for any other module."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, torch.nn.Module) or hasattr(experts, "_routing"):
        return 0
    counts = {int(p.shape[0]) if p.ndim >= 2 else 0 for p in experts.parameters(recurse=False)}
    if len(counts) != 1 or 0 in counts:
        return 0
    (num_experts,) = counts
    # a router's [num_experts, hidden] weight, as a child's or deeper (AfMoE's router.gate,
    # HunYuan's gate.wg)
    routed = any(name.endswith("weight") and not name.startswith("experts.")
                 and weight.ndim == 2 and weight.shape[0] == num_experts
                 for name, weight in module.named_parameters())
    return num_experts if routed else 0


class _Routing:
    """Where a sharded experts module sends its rows; deep copies share it (groups do not copy)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, capacity: int | None) -> None:
        self.group, self.num_experts, self.capacity = group, num_experts, capacity

    def __deepcopy__(self, memo: dict[int, Any]) -> _Routing:
        return self


def _shard(experts: torch.nn.Module, routing: _Routing) -> None:
    """Slice `experts`' stacked parameters to this rank's share and route its forward."""
    group = routing.group
    num_local, rank = routing.num_experts // group.size(), dist.get_rank(group)
    local = slice(rank * num_local, (rank + 1) * num_local)
    with torch.no_grad():
        for name, param in list(experts.named_parameters(recurse=False)):
            # A copy, so that the other experts' storage is freed.
            shard = torch.nn.Parameter(param[local].clone(), requires_grad=param.requires_grad)
            setattr(experts, name, shard)
    if hasattr(experts, "num_experts"):  # the expert loop and its one_hot count local ones
        experts.num_experts = num_local  # type: ignore[assignment]
    experts._routing = routing  # type: ignore[assignment]
    experts.forward = types.MethodType(_routed_forward, experts)  # nn.Module.__call__ runs it


def _routed_forward(
    experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, *args: Any, **kwargs: Any,
) -> torch.Tensor:
    """A sharded experts module's forward: [T, H] tokens, [T, K] routing -> [T, H]."""
    routing = experts._routing

    def run_experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The model's own expert code on this rank's rows, each with one expert, weight 1."""
        unit = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        return type(experts).forward(experts, rows, local_ids.unsqueeze(1), unit, *args, **kwargs)

    if routing.capacity is not None:
        blocks, _, fixed = dispatch_fixed(
            hidden_states, top_k_index, routing.num_experts, routing.capacity, routing.group,
            check_ids=False,
        )
        rows = blocks.reshape(-1, blocks.shape[-1])  # sorted by local expert, padding included
        ids = torch.arange(blocks.shape[0], device=rows.device).repeat_interleave(blocks.shape[1])
        out = run_experts(rows, ids).view(*blocks.shape[:2], -1)
        return combine_fixed(out, fixed, top_k_weights)
    recv_x, recv_ids, handle = dispatch(
        hidden_states, top_k_index, routing.num_experts, routing.group
    )
    return combine(run_experts(recv_x, recv_ids), handle, top_k_weights)
