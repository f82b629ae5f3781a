"""`dbo.yield_between`: yield points between the layers of a model, without editing it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dbo.api import yield_


@dataclass(eq=False)  # hashable, compared by identity like the handles
class YieldHooks:
    """The forward pre-hooks `yield_between` registered (`handles`); `remove()` them all."""

    handles: list[torch.utils.hooks.RemovableHandle]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def yield_between(modules: Iterable[torch.nn.Module]) -> YieldHooks:
    """Make every module but the first call `dbo.yield_()` before its forward (a forward
    pre-hook): inside an overlap the baton passes between consecutive modules (the
    layers of `model.model.layers`); outside one the hooks do nothing."""
    hook = lambda module, args: yield_()  # noqa: E731 - one hook object for every module
    return YieldHooks([m.register_forward_pre_hook(hook) for m in list(modules)[1:]])
