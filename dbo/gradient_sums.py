"""The ubatches' gradients of each leaf their graphs reach (the parameters), summed as the
ubatches' backwards compute them.

dbo's node runs one `torch.autograd.grad` per ubatch. Were each to return its gradients,
every ubatch's gradient of every parameter would live until the last ubatch's backward
ended: a copy of the parameters' gradients per ubatch at the peak. Instead, for the
duration of the ubatches' backwards, a tensor hook on each leaf adds the gradient autograd
has just computed for it into the leaf's running sum, and hands `autograd.grad` back a
zero that takes no memory (an expanded scalar). At the peak: one copy, plus the gradient
being added. With two ubatches each sum has the bits of autograd's own sum over the
ubatches in turn (one addition, which commutes); with more, their order of arrival, which
the baton makes the same on every run.

`on_last(key)`, when set, runs in the thread whose gradient was a leaf's last expected one
(one per ubatch whose graph reaches the leaf; `key` is `id(leaf)`): there `dbo.fsdp`
releases an FSDP2 unit as soon as every ubatch's backward has left it.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable

import torch


class GradientSums:
    """`with sums:` around the ubatches' backwards; then `pop(leaf)` gives each leaf's
    sum (None: no gradient came). `leaves_per_ubatch`: the leaves each ubatch's backward
    differentiates by."""

    def __init__(self, leaves_per_ubatch: Iterable[Iterable[torch.Tensor]]) -> None:
        self._leaves: dict[int, torch.Tensor] = {}
        self.expected: collections.Counter[int] = collections.Counter()
        """id(leaf) -> how many ubatches' backwards give it a gradient."""
        for leaves in leaves_per_ubatch:
            for leaf in leaves:
                self._leaves.setdefault(id(leaf), leaf)
                self.expected[id(leaf)] += 1
        self.on_last: Callable[[int], None] | None = None
        self._summed: dict[int, torch.Tensor] = {}
        self._given: collections.Counter[int] = collections.Counter()

    def __enter__(self) -> GradientSums:
        self._summed.clear()  # a backward again (retain_graph=True) starts afresh
        self._given.clear()
        self._hooks = [leaf.register_hook(functools.partial(self._add, key))
                       for key, leaf in self._leaves.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def pop(self, leaf: torch.Tensor) -> torch.Tensor | None:
        return self._summed.pop(id(leaf), None)

    def _add(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        total = self._summed.get(key)
        self._summed[key] = grad if total is None else total + grad
        self._given[key] += 1
        if self.on_last is not None and self._given[key] == self.expected[key]:
            self.on_last(key)
        if grad.layout != torch.strided:  # a sparse gradient: an empty one
            return torch.zeros_like(grad)
        return _zero(grad.shape, grad.dtype, grad.device)


@functools.lru_cache(maxsize=1024)
def _zero(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero of `shape` that takes no memory (a scalar, expanded), made once per kind."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)
