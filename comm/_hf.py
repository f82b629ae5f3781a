"""`comm.moe.shard_experts`: make a Hugging Face MoE model expert-parallel in place."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from comm._checks import resolve_group
from comm.moe import combine, dispatch


def shard_experts(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Keep only this rank's experts in every sparse MoE block of `model`, in place, and
    route the tokens to the ranks that own them through `comm.moe.dispatch`/`combine`.

    A block is recognised by its structure (the `transformers` >= 5 layout of Mixtral,
    Qwen2-MoE, Qwen3-MoE and their kin): a child `experts` whose own parameters are
    stacked `[num_experts, ...]`, next to a router child whose `weight` is
    `[num_experts, hidden]`. Rank r of `group` (None: the default group) keeps experts
    `[r * E_local, (r + 1) * E_local)`; the block's own forward still runs (router,
    shared experts, reshapes), and its experts module, called with the routing of
    every token, dispatches the rows, runs its own computation on the local experts
    with unit weights (`combine` applies the routing weights) and combines them back.
    Every rank must then run the same forward calls (collectives); the output equals
    the unsharded model's for the same input (allclose), gradients too.

    Shard after loading a checkpoint (`from_pretrained`, `load_state_dict` of the full
    model) and before building an optimizer: the dropped experts' memory is freed.
    Returns the qualified names of the blocks changed. Raises ValueError naming the
    model's class when it has no such block (or all are sharded already), and
    ValueError when a block's expert count is not divisible by the group's size.
    """
    base = resolve_group(group)
    blocks = [(name, module) for name, module in model.named_modules() if _num_experts(module)]
    if not blocks:
        raise ValueError(
            f"shard_experts found no sparse MoE block in {type(model).__name__}: it looks "
            "for a module with an `experts` child holding stacked [num_experts, ...] "
            "parameters and a router child with a [num_experts, hidden] weight "
            "(blocks sharded already are skipped)"
        )
    world_size = base.size()
    for name, block in blocks:
        num_experts = _num_experts(block)
        if num_experts % world_size != 0:
            raise ValueError(
                f"{name} has {num_experts} experts, which do not split evenly over the "
                f"{world_size} ranks of the group; use a group whose size divides {num_experts}"
            )
    for _, block in blocks:
        _shard(block.experts, _num_experts(block), base)
    return [name for name, _ in blocks]


def _num_experts(module: torch.nn.Module) -> int:
    """The expert count of a sparse MoE block not sharded yet; 0 for any other module."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, torch.nn.Module) or hasattr(experts, "_expert_parallel_group"):
        return 0
    counts = {int(p.shape[0]) if p.ndim >= 2 else 0 for p in experts.parameters(recurse=False)}
    if len(counts) != 1 or 0 in counts:
        return 0
    (num_experts,) = counts
    for child_name, child in module.named_children():
        weight = getattr(child, "weight", None)
        if child_name != "experts" and isinstance(weight, torch.Tensor) and (
            weight.ndim == 2 and weight.shape[0] == num_experts
        ):
            return num_experts
    return 0


def _shard(experts: torch.nn.Module, num_experts: int, group: dist.ProcessGroup) -> None:
    """Slice `experts`' stacked parameters to this rank's share and route its forward."""
    num_local = num_experts // group.size()
    local = slice(dist.get_rank(group) * num_local, (dist.get_rank(group) + 1) * num_local)
    with torch.no_grad():
        for name, param in list(experts.named_parameters(recurse=False)):
            # A copy, so that the other experts' storage is freed.
            shard = torch.nn.Parameter(param[local].clone(), requires_grad=param.requires_grad)
            setattr(experts, name, shard)
    if hasattr(experts, "num_experts"):  # the expert loop and its one_hot count local ones
        experts.num_experts = num_local  # type: ignore[assignment]
    experts._expert_parallel_group = group  # type: ignore[assignment]
    compute = type(experts).forward  # the model's own expert computation

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        recv_x, recv_ids, handle = dispatch(hidden_states, top_k_index, num_experts, group)
        unit = torch.ones(recv_x.shape[0], 1, dtype=top_k_weights.dtype, device=recv_x.device)
        out = compute(experts, recv_x, recv_ids.unsqueeze(1), unit, *args, **kwargs)
        return combine(out, handle, top_k_weights)

    experts.forward = forward  # an instance attribute: nn.Module.__call__ runs it
