"""Expert-parallel token routing: `dispatch` tokens to the ranks that own their experts,
`combine` the expert outputs back, weighted, in the original token order.

    recv_x, recv_local_expert_ids, handle = comm.moe.dispatch(x, topk_ids, num_experts)
    expert_out = run_local_experts(recv_x, recv_local_expert_ids)   # row for row
    y = comm.moe.combine(expert_out, handle, topk_weights)

Rank r owns experts `[r * E_local, (r + 1) * E_local)`. Two paths:

- `dynamic`: `dispatch` / `combine`, each (token, k) pair one row on the wire, counts
  first, so uneven loads and empty ranks work; the split sizes are read on the host
  once per `dispatch`. For prefill and training.
- `fixed`: `dispatch_fixed` / `combine_fixed`, fixed-size blocks per (source rank,
  expert) and device counts: no host read, shapes set by the arguments alone. For
  decode and CUDA graphs.
- `hf`: `shard_experts(model)` routes a Hugging Face MoE model through either.
- `compiled`: both paths' exchanges as ops, so `torch.compile` traces them whole.

Inside an overlap the all-to-alls yield while in flight; outside they block. Results
are bitwise those of the same calls made serially. `_exchange` holds what both paths
share: the checks, the counts exchange, and the differentiable row exchange with its
order tokens (its docstring says why backward needs them).
"""

from comm.moe.dynamic import DispatchHandle, combine, dispatch
from comm.moe.fixed import FixedDispatchHandle, combine_fixed, dispatch_fixed
from comm.moe.hf import shard_experts

__all__ = [
    "DispatchHandle", "FixedDispatchHandle", "combine", "combine_fixed", "dispatch",
    "dispatch_fixed", "shard_experts",
]
