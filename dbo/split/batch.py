"""Splitting a batch into ubatches (`default_split`) and merging their outputs back
(`default_merge`, `merge_parts`).

Arguments and outputs are walked with `torch.utils._pytree`: its containers (tuple,
list, dict, namedtuple, ...) and the types registered with it (transformers'
`ModelOutput`; a dataclass after `register_dataclass`); anything else, `torch.Size`
included, is a leaf.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dbo._checks import check_num_ubatches
from dbo.split import rules

UBatchInputs = list[tuple[tuple[Any, ...], dict[str, Any]]]
"""One `(args, kwargs)` pair per ubatch, in ubatch order."""


def checked_ubatch_inputs(parts: Any, num_ubatches: int, name: str) -> UBatchInputs:
    """`parts` as a list, checked to hold one `(args_tuple, kwargs_dict)` pair per ubatch
    (TypeError or ValueError naming them `name`)."""
    if not isinstance(parts, Iterable):
        raise TypeError(
            f"{name} must be a list of {num_ubatches} (args_tuple, kwargs_dict) pairs, got "
            f"{type(parts).__name__}"
        )
    parts = list(parts)
    if len(parts) != num_ubatches:
        raise ValueError(
            f"{name} must hold one (args_tuple, kwargs_dict) pair per ubatch: "
            f"num_ubatches={num_ubatches}, got {len(parts)}"
        )
    for index, part in enumerate(parts):
        pair = isinstance(part, tuple) and len(part) == 2
        if not (pair and isinstance(part[0], tuple) and isinstance(part[1], dict)):
            got = (
                f"a pair of ({type(part[0]).__name__}, {type(part[1]).__name__})" if pair
                else f"a {type(part).__name__}"
            )
            raise TypeError(
                f"{name}[{index}] must be an (args_tuple, kwargs_dict) pair, got {got}; "
                "e.g. ((x_i,), {})"
            )
    return parts


def _is_leaf(node: Any) -> bool:
    """A shape (one value, not a container of ints) or an object with a split rule (split
    by its rule even if its type is a pytree node too)."""
    return isinstance(node, torch.Size) or rules.rule_for(node) is not None


_SCALARS = (int, float, bool, str, type(None))


def flat_arguments(inputs: UBatchInputs) -> list[Any] | None:
    """The ubatches' arguments in order when each is a plain tensor or scalar (the usual
    `fn(x)`, where a tree walk would cost more than what the caller does with them);
    None when one is anything else."""
    flat = [arg for args, kwargs in inputs for arg in (*args, *kwargs.values())]
    if all(type(arg) is torch.Tensor or type(arg) in _SCALARS for arg in flat):
        return flat
    return None


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """`tree`'s leaves and spec; shapes and objects with a split rule are leaves."""
    return pytree.tree_flatten(tree, is_leaf=_is_leaf)


def _leaf_paths(tree: Any, root: str) -> list[str]:
    """The readable path of each leaf (`args[0]`, `kwargs['mask']`, `output.logits`)."""
    pairs, _ = pytree.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return [root + pytree.keystr(path) for path, _ in pairs]


def _splittable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.ndim >= 1


def check_objects(args: tuple[Any, ...], kwargs: dict[str, Any], batch_size: int) -> None:
    """ValueError naming the path for an argument leaf of a type without a split rule that
    holds a tensor of `batch_size` rows (`dbo.split.rules.hidden_batch_tensor`): it would reach
    every ubatch whole, and each would write its rows into it."""
    named = [(f"args[{i}]", arg) for i, arg in enumerate(args)]
    for root, value in named + [(f"kwargs[{key!r}]", v) for key, v in kwargs.items()]:
        if isinstance(value, (torch.Tensor, bool, int, float, str, type(None))):
            continue  # the usual arguments, without a tree walk
        leaves, _ = flatten(value)
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) or rules.rule_for(leaf) is not None:
                continue
            where = rules.hidden_batch_tensor(leaf, batch_size)
            if where is not None:
                path = _leaf_paths(value, root)[index]
                raise ValueError(rules.refusal(path, leaf, where, batch_size))


def rows_per_ubatch(batch_size: int, num_ubatches: int) -> list[int]:
    """The rows of each part `torch.tensor_split` cuts a batch into (the first ones larger)."""
    base, extra = divmod(batch_size, num_ubatches)
    return [base + (1 if i < extra else 0) for i in range(num_ubatches)]


def splittable_leaves(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, check_leaves: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor leaf with ndim >= 1, args first. With `check_leaves`,
    ValueError for a leaf of a type torch's pytree does not know holding such tensors."""
    found = []
    named = [(f"args[{i}]", arg) for i, arg in enumerate(args)]
    for root, value in named + [(f"kwargs[{key!r}]", v) for key, v in kwargs.items()]:
        if type(value) is torch.Tensor:  # the usual argument, without a tree walk
            if value.ndim >= 1:
                found.append((root, value))
            continue
        leaves, _ = flatten(value)
        if any(_splittable(leaf) for leaf in leaves):
            paths = _leaf_paths(value, root)
            found += [(path, leaf) for path, leaf in zip(paths, leaves) if _splittable(leaf)]
        opaque = [i for i, leaf in enumerate(leaves) if _unregistered_holding_tensors(leaf)]
        if check_leaves and opaque:
            path = _leaf_paths(value, root)[opaque[0]]
            raise ValueError(
                f"dbo.overlap cannot split {path}: {_unregistered(leaves[opaque[0]], 'split')}"
            )
    return found


def _unregistered_holding_tensors(leaf: Any) -> bool:
    """A leaf that holds batch tensors: a dataclass, mapping, list or tuple whose type
    torch's pytree does not know."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        inner: Any = [getattr(leaf, field.name, None) for field in dataclasses.fields(leaf)]
    elif isinstance(leaf, Mapping):
        inner = list(leaf.values())
    elif isinstance(leaf, (list, tuple)) and not isinstance(leaf, torch.Size):
        inner = list(leaf)
    else:
        return False
    return any(_splittable(x) for x in pytree.tree_leaves(inner, is_leaf=_is_leaf))


def _unregistered(leaf: Any, verb: str) -> str:
    name = type(leaf).__name__
    how = "register_dataclass" if dataclasses.is_dataclass(leaf) else "register_pytree_node"
    effect = "every ubatch would get it whole" if verb == "split" else "it cannot be joined"
    return (
        f"it is a {name} holding tensors, a type torch.utils._pytree does not know, so "
        f"{effect}; register it with torch.utils._pytree.{how}({name}), or pass {verb}="
    )


def batch_size_of(leaves: list[tuple[str, torch.Tensor]]) -> int | None:
    """The common dim-0 size of `splittable_leaves`, None if there are none; ValueError
    naming the paths when the sizes differ."""
    if not leaves:
        return None
    # size(0), not shape[0]: a strided nested tensor has no `shape` but has a size(0).
    sizes = {x.size(0) for _, x in leaves}
    if len(sizes) > 1:
        described = ", ".join(f"{path}: {x.size(0)}" for path, x in leaves)
        raise ValueError(
            "dbo.overlap splits every tensor argument along dim 0, but their dim-0 sizes "
            f"differ ({described}); pass no_split= for arguments every ubatch takes whole "
            "(position_ids [1, S]), or split= for ragged inputs"
        )
    return int(sizes.pop())


def default_split(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int
) -> UBatchInputs:
    """Split every tensor leaf with ndim >= 1 into views, as `torch.tensor_split(x,
    num_ubatches)` does; 0-dim tensors and other leaves reach every ubatch unchanged, and
    a container with nothing to split (at any depth) as the same object. An object of a
    type with a split rule (`dbo.register_split_rule`; transformers' KV caches) is split
    by its rule, with the rows of each part. ValueError when dim-0 sizes differ, a leaf of
    a type torch's pytree does not know holds tensors, or an object without a split rule
    holds a tensor of the batch's rows (`.layers[0].keys`). Sparse and nested tensors are
    unsupported (torch.tensor_split refuses them): pass `split=`."""
    num_ubatches = check_num_ubatches(num_ubatches)
    batch_size = batch_size_of(splittable_leaves(args, kwargs))  # checks leaves and sizes
    if batch_size is not None:
        check_objects(args, kwargs, batch_size)
    return split_parts(args, kwargs, num_ubatches, batch_size or 0)


def split_parts(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int, batch_size: int
) -> UBatchInputs:
    """`default_split` for arguments whose leaves are already known to be valid, with
    `batch_size` rows (how stateful objects are cut)."""
    rows = rows_per_ubatch(batch_size, num_ubatches)
    arg_parts = [_split_argument(arg, rows, f"args[{i}]") for i, arg in enumerate(args)]
    kwarg_parts = {
        key: _split_argument(value, rows, f"kwargs[{key!r}]") for key, value in kwargs.items()
    }
    return [
        (tuple(parts[i] for parts in arg_parts), {k: p[i] for k, p in kwarg_parts.items()})
        for i in range(num_ubatches)
    ]


def _split_argument(value: Any, rows: list[int], root: str) -> Sequence[Any]:
    """The parts of one argument, one per ubatch (itself each time if nothing is split)."""
    num_ubatches = len(rows)
    if type(value) is torch.Tensor:
        if value.ndim == 0:
            return (value,) * num_ubatches
        return torch.tensor_split(value, num_ubatches, dim=0)
    leaves, spec = pytree.tree_flatten(value, is_leaf=_passes_whole)
    cut: dict[int, Sequence[Any]] = {}
    for i, leaf in enumerate(leaves):
        if _splittable(leaf):
            cut[i] = torch.tensor_split(leaf, num_ubatches)
        elif (rule := rules.rule_for(leaf)) is not None:
            path = root if len(leaves) == 1 else f"{root} (leaf {i})"
            cut[i] = rules.split_object(leaf, rule, rows, path)
    if not cut:
        return (value,) * num_ubatches
    return [
        pytree.tree_unflatten([cut[i][part] if i in cut else x for i, x in enumerate(leaves)], spec)
        for part in range(num_ubatches)
    ]


def _passes_whole(node: Any) -> bool:
    """A shape, an object with a split rule (a leaf, split by the rule), or a container
    with nothing to split: every ubatch gets the same object (state that `fn` writes into,
    such as a dict of counters, stays shared)."""
    return _is_leaf(node) or not any(
        _splittable(leaf) or rules.rule_for(leaf) is not None
        for leaf in pytree.tree_leaves(node, is_leaf=_is_leaf)
    )


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
    if type(first) is torch.Tensor and first.ndim >= 1 and all(
        type(output) is torch.Tensor and output.ndim >= 1 and output is not first
        for output in outputs[1:]
    ):
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
            path = _leaf_paths(first, "output")[index]
            raise ValueError(f"dbo.overlap cannot merge {path}: {error}") from error.__cause__
    return merged


def _merged_leaf(values: list[Any]) -> Any:
    first = values[0]
    rule = rules.rule_for(first)
    if rule is not None:
        return rule.merge(values)
    if not any(isinstance(value, torch.Tensor) for value in values):
        if _unregistered_holding_tensors(first):
            raise _Unmergeable(_unregistered(first, "merge"))
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
