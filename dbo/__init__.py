"""dbo: dual-batch overlap for PyTorch.

Split a batch into microbatches ("ubatches"), run each in its own thread, and pass a
baton between them so that one ubatch's communication overlaps another's compute:

    import dbo

    def forward(x):
        for layer in layers:
            x = layer.attention(x)
            dbo.yield_()            # let the other ubatch run while ...
            x = layer.moe(x)        # ... (comm.* collectives yield by themselves)
        return x

    y = dbo.overlap(forward)(x)     # bitwise equal to forward on the two halves in turn
                                    # (random ops draw in the ubatches' interleaved order)
    loss_fn(y).backward()           # each ubatch's backward overlapped the same way

Every call used inside `fn` is a cheap no-op outside an overlap (ubatch id 0, not
enabled, one ubatch), so model code written for DBO also runs without it.
"""

from dbo import hf
from dbo._checks import MAX_NUM_UBATCHES, check_num_ubatches
from dbo.errors import OverlapTimeoutError, UBatchAbortedError
from dbo.graphs import OverlapGraph, add_capture_hook, capture_graph
from dbo.overlap import overlap
from dbo.runtime.exit import wait_at_exit
from dbo.runtime.pool import close_default_runners
from dbo.runtime.runner import RunnerState, UBatchRunner
from dbo.split.batch import default_split
from dbo.split.outputs import default_merge, merge_parts
from dbo.split.rules import register_split_rule
from dbo.split.tokens import TokenSplit, balanced_token_split
from dbo.tracing import Trace, trace
from dbo.ubatch import (
    at_ubatch_exit,
    backward_state,
    blocking_wait,
    capturing,
    current_stream,
    current_ubatch_id,
    enabled,
    maybe_run_recv_hook,
    num_ubatches,
    on_comm_stream,
    register_recv_hook,
    run_state,
    switch_to_comm,
    switch_to_compute,
    yield_,
    yield_and_switch_to_comm,
    yield_and_switch_to_compute,
    yield_between,
)

__all__ = [
    "MAX_NUM_UBATCHES", "OverlapGraph", "OverlapTimeoutError", "RunnerState", "TokenSplit",
    "Trace", "UBatchAbortedError", "UBatchRunner", "add_capture_hook", "at_ubatch_exit",
    "backward_state",
    "balanced_token_split", "blocking_wait", "capture_graph", "capturing",
    "check_num_ubatches", "close_default_runners", "current_stream", "current_ubatch_id",
    "default_merge", "default_split", "enabled", "hf", "maybe_run_recv_hook", "merge_parts",
    "num_ubatches", "on_comm_stream", "overlap", "register_recv_hook",
    "register_split_rule", "run_state", "switch_to_comm", "switch_to_compute", "trace",
    "wait_at_exit", "yield_", "yield_and_switch_to_comm", "yield_and_switch_to_compute",
    "yield_between",
]
