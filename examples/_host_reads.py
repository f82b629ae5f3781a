"""Count host reads of tensor values: a CPU stand-in for GPU host syncs.

    with HostReads().counting() as reads:
        model(x)
    reads.reads                 # item() / bool() / int() / tolist() / numpy() / cpu()
    reads.all_to_all_splits     # [(output_split_sizes, input_split_sizes)] per all-to-all

On a GPU each such read waits for the device to drain; the fixed-shape MoE path makes
none. Counts the thread that enters it (TorchDispatchMode is per thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values and records the all-to-alls' split arguments,
    in the thread that enters it: `_local_scalar_dense` (`item()`, `bool()`, `int()`)
    through the dispatcher, and `tolist()` / `numpy()` / `cpu()`, which do not go through
    it, by wrapping them for the duration."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.all_to_all_splits: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if "alltoall" in str(func):
            self.all_to_all_splits.append((list(args[3]), list(args[4])))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

        def wrap(name: str):
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.reads += 1
                return originals[name](tensor, *args, **kwargs)
            return read

        for name in originals:
            setattr(torch.Tensor, name, wrap(name))
        try:
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
