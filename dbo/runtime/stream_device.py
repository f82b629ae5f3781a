"""The device a run's ubatch streams are on: the one asked for, else its CUDA inputs'."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dbo.split.batch import UBatchInputs, flat_arguments


def streams_device(inputs: UBatchInputs, device: torch.device | None) -> torch.device:
    """`device` (a CPU one as it is, the inputs unread), else the first CUDA input's (a
    CPU scalar before the CUDA batch does not pick the CPU), else CPU; a bare "cuda" is
    the calling thread's current device. ValueError for a CUDA input on another device:
    its kernels would run on that device's current stream, unordered with the ubatch
    streams."""
    if device is not None and device.type != "cuda":
        return device
    leaves = _input_leaves(inputs)
    cuda_inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_cuda]
    if device is None:
        device = cuda_inputs[0].device if cuda_inputs else torch.device("cpu")
    bare = device.type == "cuda" and device.index is None
    if bare:
        device = torch.device("cuda", torch.cuda.current_device())
    for leaf in cuda_inputs:
        if leaf.device != device:
            named = " ('cuda' names the calling thread's current device)" if bare else ""
            raise ValueError(
                f"a ubatch input is on {leaf.device} but the ubatch streams are on "
                f"{device}{named}; pass device='{leaf.device}', or call "
                f"torch.cuda.set_device({leaf.device.index}) in this thread"
            )
    return device


def _input_leaves(inputs: UBatchInputs) -> list[Any]:
    """The leaves of `inputs`, in order; no tree walk for flat tensor and scalar arguments."""
    flat = flat_arguments(inputs)
    return flat if flat is not None else tree_leaves(inputs)
