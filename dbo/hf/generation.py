"""`overlap_generation`: every forward of `model.generate` under DBO, with the arguments
split by rows (positions passed whole) and a token threshold for prefill and decode."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from dbo.hf.refusals import check_generation_model
from dbo.hf.versions import check_transformers
from dbo.overlap import overlap
from dbo.split import rules
from dbo.split.batch import UBatchInputs, default_split


def _register_cache_rule() -> None:
    from dbo.hf import cache  # imports transformers: only once one of its caches exists

    cache.register()


rules.defer_split_rule("transformers.cache_utils", "Cache", _register_cache_rule)

DEFAULT_MIN_PREFILL_TOKENS = 512
"""Below this many tokens in a call (rows x prompt length), a prefill runs unsplit."""
DEFAULT_MIN_DECODE_TOKENS = 32
"""Below this many rows, a decode step (one token per row) runs unsplit."""

_PASSED_WHOLE = ("cache_position", "logits_to_keep")
"""Forward arguments that index positions, not rows: every ubatch gets them whole."""


class GenerationOverlap:
    """What `overlap_generation` returns: `remove()` (or leaving a `with` block) gives the
    model back its own forward and compile setting; `forward` is the overlapped one."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        """Install `forward` on `model` (and turn its generation's auto-compile off)."""
        self.model, self.forward = model, forward
        self._previous_forward = model.__dict__.get("forward", _UNSET)
        config = getattr(model, "generation_config", None)
        self._previous_disable_compile = getattr(config, "disable_compile", _UNSET)
        model.forward = forward
        if config is not None:  # generate's auto-compile would trace the ubatch threads
            config.disable_compile = True
        self._active = True

    def remove(self) -> None:
        """Restore the model's forward (as it was before) and `disable_compile`; idempotent."""
        if not self._active:
            return
        self._active = False
        if self._previous_forward is _UNSET:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._previous_forward
        config = getattr(self.model, "generation_config", None)
        if config is not None and self._previous_disable_compile is not _UNSET:
            config.disable_compile = self._previous_disable_compile

    def __enter__(self) -> GenerationOverlap:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


_UNSET = object()


def overlap_generation(
    model: torch.nn.Module, *, num_ubatches: int = 2,
    min_prefill_tokens: int = DEFAULT_MIN_PREFILL_TOKENS,
    min_decode_tokens: int = DEFAULT_MIN_DECODE_TOKENS, decision_group: Any = None,
    timeout_s: float | None = None, device: torch.device | str | int | None = None,
) -> GenerationOverlap:
    """Overlap every forward of `model` (a `transformers` causal LM) until `.remove()`.

    `model.forward` becomes `dbo.overlap(model.forward, ...)` with the options given (as
    `dbo.overlap`'s) and a split for the arguments `generate` passes: tensors with a row
    per sequence (`input_ids`, `attention_mask` or its dict of masks, `position_ids` of
    B rows) split along dim 0, the KV cache by its rows (a `DynamicCache` or
    `StaticCache` of transformers' layer kinds, DeepSeek-V4's and MiniMax's own; others
    raise naming them), `cache_position`, `logits_to_keep` and a `position_ids` of one
    row whole. A call overlaps when its batch has at least `num_ubatches` rows and enough
    tokens: `min_decode_tokens` for a call of one token per row (a decode step),
    `min_prefill_tokens` (rows x length) otherwise; with `decision_group`, every rank
    takes the same path each step (needed with `comm.moe.shard_experts`, together with
    `generate(..., synced_gpus=True)` so that ranks whose rows all stopped keep stepping).
    Generation's auto-compile is turned off while active (it would trace the ubatch
    threads). ValueError if `model` has no `generate`, or is already overlapped;
    `UntestedVersionError` on a `transformers` release dbo is not tested on.
    """
    check_transformers()
    check_generation_model(model)
    for name, value in (("min_prefill_tokens", min_prefill_tokens),
                        ("min_decode_tokens", min_decode_tokens)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def worth_overlapping(*args: Any, **kwargs: Any) -> bool:
        rows, tokens_per_row = _batch_shape(args, kwargs)
        threshold = min_decode_tokens if tokens_per_row == 1 else min_prefill_tokens
        return rows >= num_ubatches and rows * tokens_per_row >= threshold

    forward = overlap(
        model.forward, num_ubatches=num_ubatches, split=_split_forward_arguments,
        decision_group=decision_group, timeout_s=timeout_s, device=device,
        overlap_if=worth_overlapping,
    )
    forward._dbo_generation = True  # type: ignore[attr-defined]
    return GenerationOverlap(model, forward)


def cache_bytes_written(cache: Any) -> int:
    """Bytes `dbo` wrote into a `DynamicCache` it split, since it first split it: each
    ubatch's new keys and values, and the copies made when a buffer grows or is made
    anew from the cache; for sliding-window layers, what the layer's own update writes in
    each ubatch and the joined windows. 0 for a cache it never split (a StaticCache is
    written in place by the model, never copied). For comparing with what `torch.cat`
    copies in `transformers`' own layers (the whole layer or window, every call)."""
    if "transformers" not in sys.modules:
        return 0
    from dbo.hf import dynamic

    return dynamic.bytes_written(cache)


def _batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """(rows, tokens per row) of a forward call, from `input_ids` or `inputs_embeds`."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(tokens, torch.Tensor):
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return 0, 0  # nothing to split by rows: run unsplit
    return int(tokens.shape[0]), int(tokens.shape[1])


def _split_forward_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int
) -> UBatchInputs:
    """`dbo.default_split` of the forward's arguments, with position arguments whole."""
    rows, _ = _batch_shape(args, kwargs)
    whole = {name: kwargs[name] for name in _PASSED_WHOLE if name in kwargs}
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.ndim >= 1 and positions.shape[0] != rows:
        whole["position_ids"] = positions  # [1, S]: the same positions for every row
    rest = {name: value for name, value in kwargs.items() if name not in whole}
    return [(part_args, {**part_kwargs, **whole})
            for part_args, part_kwargs in default_split(args, rest, num_ubatches)]
