"""Caches the ubatches made themselves (a forward called without one, `use_cache=True`),
joined into one cache of every row: one copy of each layer, by its kind."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import cache_utils as hf

from dbo.hf.attention import fill_indexer, fill_keys
from dbo.hf.model_caches import MODEL_LAYERS, cache_state, class_name, join_cache_state, join_rows
from dbo.hf.refusals import check_indexer_positions, refuse_join
from dbo.hf.rows import same


def joined(parts: list[Any]) -> Any:
    """Dynamic caches the ubatches made themselves, one cache of every row (one copy)."""
    cache_kind = type(parts[0])
    if (cache_kind is not hf.DynamicCache and cache_state(parts[0]) is None) or any(
        type(part) is not cache_kind or len(part.layers) != len(parts[0].layers) for part in parts
    ):
        refuse_join("transformers caches that are not their parts of one cache passed in "
                    f"({', '.join(type(part).__name__ for part in parts)})")
    cache = copy.copy(parts[0])
    cache.layers = []
    for layers in zip(*(part.layers for part in parts)):
        kind = type(layers[0])
        join = _JOINS.get(kind) or (join_model_layer if class_name(kind) in MODEL_LAYERS else None)
        if join is None or any(type(layer) is not kind for layer in layers):
            refuse_join("DynamicCaches with layers dbo cannot join "
                        f"({', '.join(type(layer).__name__ for layer in layers)})")
        cache.layers.append(join(list(layers)))
    if cache_state(cache) is not None:
        join_cache_state(cache, parts)
    return cache


def join_keys(parts: list[Any]) -> Any:
    """One DynamicLayer or sliding-window layer of the rows of `parts`."""
    kind = type(parts[0])
    layer = kind(parts[0].sliding_window) if kind is hf.DynamicSlidingWindowLayer else kind()
    if all(part.is_initialized for part in parts):
        fill_keys(layer, parts)
    return layer


def join_states(parts: list[Any]) -> Any:
    """One LinearAttentionLayer of the rows of `parts` (the same states of each); with
    attention keys or a window too (the hybrid layers), those joined as well."""
    options = dict(number_of_states=parts[0].number_of_states)
    if isinstance(parts[0], hf.DynamicSlidingWindowLayer):
        options["sliding_window"] = parts[0].sliding_window
    layer = type(parts[0])(**options)
    if isinstance(layer, hf.DynamicLayer) and all(part.is_initialized for part in parts):
        fill_keys(layer, parts)
    for name in ("device", "dtype", "conv_kernel_size", "has_previous_state",
                 "is_conv_states_initialized", "is_recurrent_states_initialized"):
        value = same([getattr(part, name) for part in parts],
                     f"{name} of a linear-attention layer")
        setattr(layer, name, copy.copy(value))
    for name in ("conv_states", "recurrent_states"):
        getattr(layer, name).update({
            index: None if states[0] is None else torch.cat(states)
            for index, states in zip(getattr(parts[0], name), zip(
                *(getattr(part, name).values() for part in parts)))
        })
    return layer


def join_indexed(parts: list[Any]) -> Any:
    """One DynamicIndexedLayer of the rows of `parts`: keys, values and indexer keys."""
    check_indexer_positions(parts)
    layer = join_keys(parts)
    if all(part.is_indexer_initialized for part in parts):
        fill_indexer(layer, parts)
    return layer


def join_model_layer(parts: list[Any]) -> Any:
    """One layer of a model's own class (`dbo.hf.model_caches`) of the rows of `parts`."""
    layer = copy.copy(parts[0])
    join_rows(layer, parts)
    return layer


_JOINS: dict[Any, Any] = {
    hf.DynamicLayer: join_keys, hf.DynamicSlidingWindowLayer: join_keys,
    hf.LinearAttentionLayer: join_states, hf.LinearAttentionAndFullAttentionLayer: join_states,
    hf.LinearAttentionAndSlidingWindowAttentionLayer: join_states,
    hf.DummyLayer: lambda parts: hf.DummyLayer(), hf.DynamicIndexedLayer: join_indexed,
}
"""How to join each kind of layer the ubatches made in caches of their own."""
