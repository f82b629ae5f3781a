"""Every `transformers` input dbo refuses, in one place. Each check raises the error a
user meets, naming what was passed and the way on; the release check is
`dbo.hf.versions.check_transformers`, and ubatches that did not run the same forward on
their rows meet `dbo.hf.rows.same`. This module imports `transformers` only once a
cache is met (`dbo.hf` itself imports none).

`overlap_generation` takes a model with a `generate` method, not overlapped already
(`check_generation_model`). dbo splits by rows the DynamicCache and StaticCache of
full-attention, sliding-window, indexed (sparse attention) and linear-attention layers
and their hybrids, DeepSeek-V4's layers and MiniMax's cache (`dbo.hf.cache.ROWS`).
Refused:

- any other cache class or layer kind (quantized, a model's own), offloading, a cache
  whose new layers are made of another class (`check_splittable`);
- linear-attention layers that record past states, indexer positions on a layer;
- a cache whose rows are not the batch's (`check_rows`);
- a cache a failed call wrote over in place (a full window, linear-attention states);
- a DynamicCache, or a StaticCache's sliding windows, in `dbo.capture_graph`;
- a split DynamicCache written under autograd (`refuse_grad`);
- caches the ubatches made themselves that cannot be joined (`refuse_join`).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch


def check_generation_model(model: Any) -> None:
    """ValueError unless `overlap_generation` can take `model`."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"overlap_generation needs a transformers model with a generate method, got "
            f"{type(model).__name__}"
        )
    if getattr(model.__dict__.get("forward"), "_dbo_generation", False):
        raise ValueError(
            f"this {type(model).__name__} is already overlapped by overlap_generation; "
            "call .remove() on its handle first"
        )


def check_splittable(cache: Any, known: bool, unknown: list[str]) -> None:
    """ValueError unless dbo can split `cache` by rows: `known` says whether its class is
    one dbo splits, `unknown` names its layers of kinds with no row class."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer  # a cache exists

    odd = list(unknown)
    odd += [f"{type(layer).__name__} (recording past states)" for layer in cache.layers
            if isinstance(layer, LinearAttentionLayer) and layer.record_past]
    odd += [f"{type(layer).__name__} (with indexer positions)" for layer in cache.layers
            if getattr(layer, "indexer_position_ids", None) is not None]
    offloading = getattr(cache, "offloading", False)
    lazy = cache.layer_class_to_replicate  # the class of layers made at the first update
    if not known or odd or offloading or lazy not in (None, DynamicLayer):
        what = f"a {type(cache).__name__}"
        if odd:
            what += f" with {', '.join(sorted(set(odd)))} layers"
        elif offloading:
            what += " that offloads"
        raise ValueError(
            f"dbo.overlap cannot split {what} by rows (it splits transformers' DynamicCache "
            "and StaticCache of full-attention, sliding-window and linear-attention layers); "
            "pass use_cache=False (or cache_implementation='dynamic'), or register a rule for "
            "it with dbo.register_split_rule"
        )
    if getattr(cache, "_dbo_overwritten", False):
        raise ValueError(
            f"this {type(cache).__name__}'s sliding windows or linear-attention states were "
            "written in place by an overlapped call that failed, so they no longer match its "
            "tokens; start a new cache (a new generate does)"
        )


def check_rows(kind: str, have: int, batch_size: int) -> None:
    """ValueError when a cache's rows are not the batch's."""
    if have != batch_size:
        raise ValueError(
            f"the {kind} passed to dbo.overlap holds {have} rows but the batch has "
            f"{batch_size}; pass a cache made for this batch (a new generate starts a new one)"
        )


def check_indexer_positions(parts: list[Any]) -> None:
    """ValueError if the model set indexer positions on a ubatch's layer: dbo does not
    split or join them."""
    if any(getattr(part, "indexer_position_ids", None) is not None for part in parts):
        raise ValueError(
            "dbo does not split the indexer positions this model keeps on its cache layers "
            "(indexer_position_ids); pass use_cache=False"
        )


def refuse_in_capture(what: str) -> NoReturn:
    """ValueError: `what` ("DynamicCache" or "sliding windows") in a `dbo.capture_graph`."""
    if what == "DynamicCache":
        raise ValueError(
            "a transformers DynamicCache cannot be in a dbo.capture_graph: its lengths and "
            "views are kept in Python, which a replay does not run, so every replay would "
            "write its token at the same position; pass a StaticCache "
            "(cache_implementation='static') to a captured decode step"
        )
    raise ValueError(
        "a StaticCache with sliding-window layers cannot be in a dbo.capture_graph: a replay "
        "would keep the window's fill state and attention-mask offsets of the capture; run "
        "these steps without capture_graph"
    )


def refuse_grad(*tensors: torch.Tensor) -> None:
    """RuntimeError if a split DynamicCache is written with tensors autograd follows."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        raise RuntimeError(
            "dbo's split DynamicCache writes each ubatch's keys and values in place, which "
            "autograd cannot follow; run generation under torch.no_grad(), or pass "
            "use_cache=False when training"
        )


def refuse_join(what: str) -> NoReturn:
    """ValueError: the ubatches returned caches of their own making dbo cannot join
    (`what` names them)."""
    raise ValueError(
        f"the ubatches returned {what}, and dbo joins only DynamicCaches of the same layers "
        "made inside the call (full-attention, sliding-window, indexed and linear-attention "
        "layers); pass a cache in, or use_cache=False"
    )
