"""Whether a call overlaps: this rank's decision, or every rank's of a decision group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dbo._torch_private import private
from dbo.split.batch import UBatchInputs, batch_size_of, check_objects, splittable_leaves


def decided_parts(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, smallest: int, custom_split: bool,
    must_inline: bool, overlap_if: Callable[[], bool] | None,
    make_parts: Callable[[list[tuple[str, torch.Tensor]]], UBatchInputs], group: Any,
) -> tuple[list[tuple[str, torch.Tensor]], UBatchInputs | None]:
    """The (path, tensor) leaves of `args` and `kwargs` to split, and the ubatches' parts
    (None: run inline).

    This rank's decision: a batch of at least `smallest` (with `custom_split`, the largest
    dim 0: the tokens of ragged inputs), not `must_inline` (a mode or transform is on),
    then `overlap_if()`; then `make_parts(leaves)`. With `group`, every rank's together: a
    MIN all-reduce of the batch sizes, 0 from a rank that runs inline. A rank whose input
    cannot be sized, whose `overlap_if` raises or whose split raises (a custom `split=`, a
    split rule) votes before it raises, and every other rank then raises too instead of
    waiting."""
    parts = None
    try:
        leaves = splittable_leaves(args, kwargs, check_leaves=not custom_split)
        if custom_split:
            size = max((int(leaf.size(0)) for _, leaf in leaves), default=0)
        else:
            size = batch_size_of(leaves) or 0
        wanted = size >= smallest and not must_inline
        if wanted and not custom_split:
            check_objects(args, kwargs, size)
        if wanted and overlap_if is not None:
            wanted = bool(overlap_if())
        if wanted:
            parts = make_parts(leaves)
    except Exception:
        if group is not None:
            with contextlib.suppress(Exception):  # this rank's own error says more
                smallest_batch_across_ranks(FAILED_RANK, group)
        raise
    if group is None:
        return leaves, parts
    group_smallest = smallest_batch_across_ranks(0 if parts is None else size, group, leaves)
    if group_smallest == FAILED_RANK:
        raise RuntimeError(
            "dbo.overlap: another rank of decision_group could not size or split its "
            "input (its own error says why), so no rank runs the function: they would "
            "wait for that rank's collectives"
        )
    return leaves, parts if group_smallest >= smallest else None


FAILED_RANK = -1  # the vote of a rank that cannot size or split its input: the MIN tells all


def smallest_batch_across_ranks(
    local_size: int, group: Any, leaves: Sequence[tuple[str, torch.Tensor]] = ()
) -> int:
    """MIN of every rank's batch size over `group` (blocking; same call on every rank)."""
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        # The group's own GPU (init_distributed binds it), else the inputs': the current
        # device is per thread, and another caller thread would name cuda:0 everywhere.
        device = getattr(group, "bound_device_id", None) or next(
            (leaf.device for _, leaf in leaves if leaf.is_cuda),
            torch.device("cuda", torch.cuda.current_device()),
        )
    # torch.full: a copy from host memory would sync the host once more than .item().
    # Outside the caller's modes (a FakeTensorMode would make the vote a fake tensor).
    with private.disable_current_modes(), private.DisableTorchFunction():
        size = torch.full((1,), local_size, dtype=torch.int64, device=device)
        dist.all_reduce(size, op=dist.ReduceOp.MIN, group=group)
        return int(size.item())
