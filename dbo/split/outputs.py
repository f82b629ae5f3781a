"""Merging the ubatch outputs of a call back into one (`default_merge`: tensors along
dim 0, objects with a split rule by their rule, equal values once), or handing over the
parts as they are (`merge_parts`); the leaves are those of `dbo.split.rules`' tree walk.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dbo.split import rules
from dbo.split.rules import flatten, leaf_paths


def default_merge(outputs: Sequence[Any]) -> Any:
    """Concatenate the tensor leaves of the ubatch outputs along dim 0, in ubatch order.

    All outputs must have the same structure (dicts may list their keys in another
    order); a transformers `ModelOutput` merges field by field. A non-tensor leaf must be
    equal in every output and is returned once (an int computed from the rows comes
    back as ubatch 0's: return it as a tensor); an object of a type with a split rule
    (`dbo.register_split_rule`; transformers' KV caches) is merged by its rule. ValueError
    naming the leaf otherwise, and for a 0-dim tensor (a loss, `aux_loss`): compute the
    loss from the merged logits, or pass a `merge=` that weights each ubatch's loss by its
    rows. The concatenation copies every output once; `merge_parts` avoids the copy.
    """
    if len(outputs) == 0:
        raise ValueError("default_merge got no ubatch outputs to merge (an empty sequence)")
    first = outputs[0]
    if all(type(output) is torch.Tensor for output in outputs):
        return _merged_columns([outputs], first)[0]  # the usual case: no tree walk
    flattened = [flatten(output) for output in outputs]
    spec = flattened[0][1]
    for index in range(1, len(outputs)):
        if flattened[index][1] != spec:
            # Dicts built in another order (keys inserted per branch) still merge.
            flattened[index] = flatten(_ordered_like(outputs[index], first))
        if flattened[index][1] != spec:
            raise ValueError(
                f"dbo.overlap cannot merge: ubatch 0 returned {_describe(spec)} but ubatch "
                f"{index} returned {_describe(flattened[index][1])}; return the same "
                "structure from every ubatch, or pass merge="
            )
    columns = zip(*(leaves for leaves, _ in flattened))
    return pytree.tree_unflatten(_merged_columns(columns, first), spec)


class _Unmergeable(Exception):
    """Why one leaf does not merge; `_merged_columns` adds its path."""


def _merged_columns(columns: Iterable[Sequence[Any]], first: Any) -> list[Any]:
    """Each column (one leaf's value from every ubatch) merged; `first` gives the paths."""
    merged = []
    for index, values in enumerate(columns):
        try:
            merged.append(_merged_leaf(list(values)))
        except _Unmergeable as error:
            path = leaf_paths(first, "output")[index]
            raise ValueError(f"dbo.overlap cannot merge {path}: {error}") from error.__cause__
    return merged


def _merged_leaf(values: list[Any]) -> Any:
    first = values[0]
    rule = rules.rule_for(first)
    if rule is not None:
        return rule.merge(values)
    if not any(isinstance(value, torch.Tensor) for value in values):
        if rules.holds_unregistered_tensors(first):
            raise _Unmergeable(rules.unregistered_refusal(first, "merge"))
        if all(_same(first, value) for value in values[1:]):
            return first
        raise _Unmergeable(
            f"the ubatches returned different non-tensor values {values!r}; pass merge= "
            "to combine them"
        )
    kinds = [
        type(value).__name__ if not isinstance(value, torch.Tensor)
        else "tensor" if value.ndim >= 1 else "0-dim tensor" for value in values
    ]
    if all(kind == "0-dim tensor" for kind in kinds):
        raise _Unmergeable(
            "it is a 0-dim tensor in each ubatch, which does not concatenate; pass merge= "
            "to combine it (a loss: weight each ubatch's by its rows, or compute it again "
            "from the merged logits)"
        )
    if any(kind != "tensor" for kind in kinds):
        raise _Unmergeable(
            f"the ubatches returned {', '.join(kinds)} there; return a tensor with a dim 0 "
            "from every ubatch, or pass merge="
        )
    if first.shape[0] > 0 and any(value is first for value in values[1:]):
        # A weight or a global buffer: concatenating its rows n times is never meant.
        raise _Unmergeable(
            "every ubatch returned the same tensor object (not rows of its own part); "
            "return it outside the overlapped function, or pass merge="
        )
    return _concatenated(values)


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, keeping the graph of parts that have one (`fn` turned grad on)."""
    try:
        with torch.set_grad_enabled(torch.is_grad_enabled() or any(p.requires_grad for p in parts)):
            return torch.cat(parts, dim=0)
    except RuntimeError as error:
        shapes = [tuple(part.shape) for part in parts]
        devices = [str(part.device) for part in parts]
        if len({shape[1:] for shape in shapes}) == 1 and len(set(devices)) == 1:
            raise  # not a layout mismatch (out of memory, say): torch's error as it is
        raise _Unmergeable(
            f"the ubatches returned tensors of shapes {', '.join(map(str, shapes))} on "
            f"{', '.join(devices)}, which do not concatenate along dim 0; return the same "
            "shape after dim 0 from every ubatch, on one device, or pass merge="
        ) from error


def _describe(spec: pytree.TreeSpec) -> str:
    try:
        return pytree.treespec_pprint(spec)
    except Exception:  # noqa: BLE001 - a registered type whose constructor refuses '*'
        return str(spec)


def _ordered_like(tree: Any, template: Any) -> Any:
    """`tree` with each plain, ordered or default dict's keys in the order of the dict at
    the same place in `template` (where both have the same keys)."""
    if type(tree) is not type(template):
        return tree
    if type(tree) in (dict, OrderedDict, defaultdict) and tree.keys() == template.keys():
        items = [(key, _ordered_like(tree[key], template[key])) for key in template]
        if type(tree) is defaultdict:
            return defaultdict(tree.default_factory, items)
        return type(tree)(items)
    if type(tree) in (tuple, list) and len(tree) == len(template):
        return type(tree)(_ordered_like(a, b) for a, b in zip(tree, template))
    return tree


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN floats and arrays (an elementwise `==`) included."""
    if a is b or isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        equal = a == b
        if hasattr(equal, "all"):  # elementwise: arrays of one type and shape, all equal
            return type(a) is type(b) and a.shape == b.shape and bool(equal.all())
        return bool(equal)
    except Exception:  # noqa: BLE001 - not comparable: different
        return False


def merge_parts(outputs: Sequence[Any]) -> list[Any]:
    """A merge that copies nothing: the per-ubatch outputs in ubatch order, for a consumer
    that takes the parts or an `fn` that wrote its rows into a shared buffer."""
    return list(outputs)
