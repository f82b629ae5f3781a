"""Count host reads of tensor values: a CPU stand-in for GPU host syncs.

    with HostReads().counting() as reads:
        model(x)
    reads.reads                 # reads of tensor values on the host (see HostReads)
    reads.all_to_all_splits     # [(output_split_sizes, input_split_sizes)] per all-to-all

On a GPU each such read waits for the device to drain; the fixed-shape MoE path makes
none. `torch.cuda.set_sync_debug_mode("error")` is the check on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops whose output size depends on the data: on CUDA they read a count on the host.
_SIZED_BY_DATA = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.bincount.default,
}


class HostReads(TorchDispatchMode):
    """Counts host reads and records the all-to-alls' split arguments. Through the
    dispatcher, in the thread that enters it: `_local_scalar_dense` (`item()`, `bool()`,
    `int()`), the ops sized by the data (`nonzero`, boolean indexing, `masked_select`,
    `unique`, `bincount`, `repeat_interleave` without `output_size`) and copies off the
    device. `tolist()` / `numpy()` / `cpu()`, which do not reach the dispatcher on CPU,
    by wrapping them for the duration: in every thread."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.all_to_all_splits: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SIZED_BY_DATA or _reads_the_host(func, args, kwargs):
            self.reads += 1
        if "alltoall" in str(func):
            self.all_to_all_splits.append((list(args[3]), list(args[4])))
        return func(*args, **kwargs)

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


def _reads_the_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else ()
        return any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
            for index in indices
        )
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return device is not None and args[0].device.type != "cpu" and device.type == "cpu"
    return False
