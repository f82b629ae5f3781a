"""Splitting a call's arguments into ubatches (`default_split`): the checks of the
`(args, kwargs)` pairs a custom split returns, the batch size the tensor leaves agree on,
and the cut itself (tensors along dim 0, objects with a split rule by their rule); the
leaves are those of `dbo.split.rules`' tree walk.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dbo._checks import check_num_ubatches
from dbo.split import rules
from dbo.split.rules import flatten, leaf_paths, splittable

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


_SCALARS = (int, float, bool, str, type(None))


def flat_arguments(inputs: UBatchInputs) -> list[Any] | None:
    """The ubatches' arguments in order when each is a plain tensor or scalar (the usual
    `fn(x)`, where a tree walk would cost more than what the caller does with them);
    None when one is anything else."""
    flat = [arg for args, kwargs in inputs for arg in (*args, *kwargs.values())]
    if all(type(arg) is torch.Tensor or type(arg) in _SCALARS for arg in flat):
        return flat
    return None


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each argument with the root of its paths: `args[0]`, ..., `kwargs['mask']`, ..."""
    yield from ((f"args[{i}]", arg) for i, arg in enumerate(args))
    yield from ((f"kwargs[{key!r}]", value) for key, value in kwargs.items())


def check_objects(args: tuple[Any, ...], kwargs: dict[str, Any], batch_size: int) -> None:
    """ValueError naming the path for an argument leaf of a type without a split rule that
    holds a tensor of `batch_size` rows (`dbo.split.rules.hidden_batch_tensor`): it would reach
    every ubatch whole, and each would write its rows into it."""
    for root, value in _named(args, kwargs):
        if isinstance(value, (torch.Tensor, *_SCALARS)):
            continue  # the usual arguments, without a tree walk
        leaves, _ = flatten(value)
        for index, leaf in enumerate(leaves):
            where = rules.hidden_batch_tensor(leaf, batch_size)
            if where is not None:
                path = leaf_paths(value, root)[index]
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
    for root, value in _named(args, kwargs):
        if type(value) is torch.Tensor:  # the usual argument, without a tree walk
            if value.ndim >= 1:
                found.append((root, value))
            continue
        leaves, _ = flatten(value)
        if any(splittable(leaf) for leaf in leaves):
            paths = leaf_paths(value, root)
            found += [(path, leaf) for path, leaf in zip(paths, leaves) if splittable(leaf)]
        opaque = [i for i, leaf in enumerate(leaves) if rules.holds_unregistered_tensors(leaf)]
        if check_leaves and opaque:
            path = leaf_paths(value, root)[opaque[0]]
            refusal = rules.unregistered_refusal(leaves[opaque[0]], "split")
            raise ValueError(f"dbo.overlap cannot split {path}: {refusal}")
    return found


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
        if splittable(leaf):
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
    return rules.is_leaf(node) or not any(
        splittable(leaf) or rules.rule_for(leaf) is not None
        for leaf in pytree.tree_leaves(node, is_leaf=rules.is_leaf)
    )
