"""comm: communication that knows about DBO.

Collectives on torch.distributed and MoE dispatch/combine that, inside an overlap, yield
to the other ubatch while they are in flight; and an emulated link for single-process
measurements.

    rank, world_size, device = comm.init_distributed()     # under torchrun
    comm.all_to_all_single(output, input, out_splits, in_splits)
    recv_x, recv_ids, handle = comm.moe.dispatch(x, topk_ids, num_experts)
    y = comm.moe.combine(expert_out, handle, topk_weights)

Outside `dbo.overlap` every call is the plain torch.distributed op; inside, see
`comm.collectives`.
"""

from comm import moe
from comm.collectives import (
    CollectiveWork,
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    reduce_scatter_tensor,
)
from comm.distributed import (
    DEFAULT_TIMEOUT_S,
    TorchrunEnvironmentError,
    destroy_distributed,
    init_distributed,
)
from comm.emulated import EmulatedLink, TransferHandle
from comm.groups import ubatch_groups
from comm.moe import DispatchHandle

__all__ = [
    "DEFAULT_TIMEOUT_S", "CollectiveWork", "DispatchHandle", "EmulatedLink", "ReduceOp",
    "TorchrunEnvironmentError", "TransferHandle", "all_gather_into_tensor", "all_reduce",
    "all_to_all_single", "destroy_distributed", "init_distributed", "moe",
    "reduce_scatter_tensor", "ubatch_groups",
]
