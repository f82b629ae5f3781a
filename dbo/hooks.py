"""`dbo.yield_between`: yield points between the layers of a model, without editing it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dbo.api import yield_


class YieldHooks:
    """The forward pre-hooks `yield_between` registered; `remove()` removes them all."""

    def __init__(self, handles: list[torch.utils.hooks.RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def yield_between(modules: Iterable[torch.nn.Module]) -> YieldHooks:
    """Make every module but the first call `dbo.yield_()` before its forward (a forward
    pre-hook), so that inside an overlap the baton passes between consecutive modules
    (the layers of `model.model.layers`); outside an overlap the hooks do nothing."""
    hooks = [module.register_forward_pre_hook(_yield) for module in list(modules)[1:]]
    return YieldHooks(hooks)


def _yield(module: torch.nn.Module, args: object) -> None:
    yield_()
