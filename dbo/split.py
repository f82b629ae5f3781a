"""Splitting a batch into ubatches and merging the ubatch outputs back.

Default split: every tensor leaf with `ndim >= 1` of the arguments is split along dim 0
exactly like `torch.tensor_split(x, num_ubatches, dim=0)`; other leaves go to every
ubatch unchanged. Default merge: tensor leaves are concatenated along dim 0 in ubatch
order. `merge_parts` skips the copy and returns the per-ubatch outputs.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo._checks import check_num_ubatches
from dbo._pytree import TreeSpec, children, flatten, rebuild, unflatten

UBatchInputs = list[tuple[tuple[Any, ...], dict[str, Any]]]
"""One `(args, kwargs)` pair per ubatch, in ubatch order."""


def splittable_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path, tensor) of every tensor leaf with ndim >= 1, args first."""
    if not kwargs and all(type(arg) is torch.Tensor for arg in args):
        # The usual call (tensors only), without the tree walk.
        return [(f"args[{index}]", arg) for index, arg in enumerate(args) if arg.ndim >= 1]
    found = []
    for tree, root in ((args, "args"), (kwargs, "kwargs")):
        leaves, paths, _ = flatten(tree, root)
        found += [
            (path, leaf)
            for path, leaf in zip(paths, leaves)
            if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1
        ]
    return found


def batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The common dim-0 size of the tensor leaves (ndim >= 1); None if there are none.

    Raises ValueError naming the argument paths when the sizes differ.
    """
    return batch_size_of(splittable_leaves(args, kwargs))


def batch_size_of(leaves: list[tuple[str, torch.Tensor]]) -> int | None:
    """`batch_size` of already collected `(path, tensor)` leaves."""
    if not leaves:
        return None
    # size(0), not shape[0]: a strided nested tensor has no `shape` but has a size(0).
    sizes = {x.size(0) for _, x in leaves}
    if len(sizes) > 1:
        described = ", ".join(f"{path}: {x.size(0)}" for path, x in leaves)
        raise ValueError(
            "dbo.overlap splits every tensor argument along dim 0, but their dim-0 sizes "
            f"differ ({described}); pass split= for ragged inputs, or pass the tensors "
            "that must not be split inside a non-tensor wrapper"
        )
    return int(sizes.pop())


def default_split(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int
) -> UBatchInputs:
    """Split every tensor leaf (ndim >= 1) like `torch.tensor_split(x, num_ubatches)`.

    Tensor contract: ubatch i gets views (no copy) of rows
    `[i * B // n + min(i, B % n) ...)` of each tensor, exactly `torch.tensor_split`'s
    parts; 0-dim tensors and non-tensor leaves are passed to every ubatch unchanged.
    A container (list, dict, dataclass, ...) with no tensor to split inside is passed to
    every ubatch as the same object, so what `fn` writes into it reaches the caller; a
    container that holds split tensors is rebuilt per ubatch.
    """
    num_ubatches = check_num_ubatches(num_ubatches)
    batch_size(args, kwargs)  # validates that dim-0 sizes agree
    return split_parts(args, kwargs, num_ubatches)


def split_parts(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int
) -> UBatchInputs:
    """`default_split` for arguments whose dim-0 sizes are already known to agree."""
    try:
        return _split_parts(args, kwargs, num_ubatches)
    except (RuntimeError, NotImplementedError) as error:
        # torch.tensor_split refuses sparse and nested tensors with errors that name
        # neither the argument nor the way out. (Checked here, not on every call.)
        for path, leaf in splittable_leaves(args, kwargs):
            if leaf.is_nested or leaf.layout != torch.strided:
                kind = "a nested" if leaf.is_nested else f"a {leaf.layout}"
                raise ValueError(
                    f"the default split cuts every tensor along dim 0 with "
                    f"torch.tensor_split, which {path} ({kind} tensor) does not support; "
                    "pass split= (and merge=) to divide it yourself"
                ) from error
        raise


def _split_parts(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_ubatches: int
) -> UBatchInputs:
    if not kwargs and all(type(arg) is torch.Tensor and arg.ndim >= 1 for arg in args):
        # The usual call (tensors only), without the tree walk.
        columns = [torch.tensor_split(arg, num_ubatches, dim=0) for arg in args]
        return [(tuple(column[i] for column in columns), kwargs) for i in range(num_ubatches)]
    split_args = _split_node(args, num_ubatches) or [args] * num_ubatches
    split_kwargs = _split_node(kwargs, num_ubatches) or [kwargs] * num_ubatches
    return list(zip(split_args, split_kwargs))


def _split_node(node: Any, num_ubatches: int) -> list[Any] | None:
    """The ubatch parts of `node`, or None when nothing inside it is split."""
    if isinstance(node, torch.Tensor):
        return list(torch.tensor_split(node, num_ubatches, dim=0)) if node.ndim >= 1 else None
    described = children(node)
    if described is None:
        return None
    kind, node_type, keys, values = described
    parts = [_split_node(value, num_ubatches) for value in values]
    if all(part is None for part in parts):
        return None
    return [
        rebuild(
            kind,
            node_type,
            keys,
            [value if part is None else part[i] for value, part in zip(values, parts)],
            node,
        )
        for i in range(num_ubatches)
    ]


def default_merge(outputs: Sequence[Any]) -> Any:
    """Concatenate the tensor leaves of the ubatch outputs along dim 0, in ubatch order.

    All outputs must have the same structure. A non-tensor leaf must be equal in every
    output (it is returned once); 0-dim tensors cannot be concatenated. Both cases that do
    not hold raise ValueError naming the leaf: pass `merge=` to combine them your way.
    The concatenation copies every output once; `merge_parts` avoids the copy.
    """
    if len(outputs) == 0:
        raise ValueError("default_merge got no ubatch outputs to merge (an empty sequence)")
    first = outputs[0]
    if (
        isinstance(first, torch.Tensor)
        and first.ndim >= 1
        and all(
            isinstance(output, torch.Tensor) and output.ndim >= 1 and output is not first
            for output in outputs[1:]
        )
    ):
        # The usual case (fn returns one tensor), without the tree walk; anything the
        # general path would refuse or treat specially goes through it below.
        return _concatenated(list(outputs), "output")
    flattened = [flatten(output, "output") for output in outputs]
    _, paths, spec = flattened[0]
    for index, (_, _, other_spec) in enumerate(flattened[1:], start=1):
        if other_spec != spec:
            # Dicts built in another order (keys inserted per branch) still merge.
            flattened[index] = flatten(_ordered_like(outputs[index], spec), "output")
            other_spec = flattened[index][2]
        if other_spec != spec:
            raise ValueError(
                f"dbo.overlap cannot merge: ubatch 0 returned {spec!r} but ubatch {index} "
                f"returned {other_spec!r}; return the same structure from every ubatch, or "
                "pass merge="
            )
    merged = []
    for position, path in enumerate(paths):
        values = [leaves[position] for leaves, _, _ in flattened]
        first = values[0]
        if any(isinstance(value, torch.Tensor) for value in values):
            kinds = [_leaf_kind(value) for value in values]
            if any(kind != "tensor" for kind in kinds):
                if all(kind == "0-dim tensor" for kind in kinds):
                    raise ValueError(
                        f"dbo.overlap cannot merge {path}: it is a 0-dim tensor in each "
                        "ubatch; pass merge= to combine it (for example a sum)"
                    )
                raise ValueError(
                    f"dbo.overlap cannot merge {path}: the ubatches returned "
                    f"{', '.join(kinds)} there; return a tensor with a dim 0 from every "
                    "ubatch, or pass merge="
                )
            if first.shape[0] > 0 and any(value is first for value in values[1:]):
                # A weight or a global buffer returned by every ubatch: concatenating the
                # same rows n times is never what the caller meant.
                raise ValueError(
                    f"dbo.overlap cannot merge {path}: every ubatch returned the same tensor "
                    "object (not rows of its own part); return it outside the overlapped "
                    "function, or pass merge="
                )
            merged.append(_concatenated(values, path))
        elif all(_same(first, value) for value in values[1:]):
            merged.append(first)
        else:
            raise ValueError(
                f"dbo.overlap cannot merge {path}: the ubatches returned different "
                f"non-tensor values {values!r}; pass merge= to combine them"
            )
    return unflatten(spec, merged)


def _concatenated(parts: list[torch.Tensor], path: str) -> torch.Tensor:
    """`torch.cat(parts)` for the merge of leaf `path`.

    The concatenation runs in the caller's thread, under its grad mode: a caller in
    `no_grad` whose `fn` turned grad on has parts with a graph, and the merged result
    must keep it, as `fn`'s own output would. A mismatch beyond dim 0 (or of devices)
    is the ubatches' doing: the error names the leaf and each ubatch's shape.
    """
    try:
        if not torch.is_grad_enabled() and any(part.requires_grad for part in parts):
            with torch.enable_grad():
                return torch.cat(parts, dim=0)
        return torch.cat(parts, dim=0)
    except RuntimeError as error:
        shapes = [tuple(part.shape) for part in parts]
        devices = [str(part.device) for part in parts]
        if len({shape[1:] for shape in shapes}) == 1 and len(set(devices)) == 1:
            raise  # not a layout mismatch (out of memory, say): torch's error as it is
        raise ValueError(
            f"dbo.overlap cannot merge {path}: the ubatches returned tensors of shapes "
            f"{', '.join(map(str, shapes))} on {', '.join(devices)}, which do not "
            "concatenate along dim 0; return the same shape after dim 0 from every "
            "ubatch, on one device, or pass merge="
        ) from error


def _leaf_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor" if value.ndim >= 1 else "0-dim tensor"
    return type(value).__name__


def _ordered_like(tree: Any, spec: TreeSpec) -> Any:
    """`tree` with each dict's items in the key order of the matching node of `spec`,
    where both hold the same keys (anything else is left for the caller to report)."""
    described = children(tree)
    if described is None or spec.kind != described[0] or spec.node_type is not described[1]:
        return tree
    kind, node_type, keys, values = described
    if kind == "dict" and set(keys) == set(spec.keys) and len(keys) == len(spec.keys):
        by_key = dict(zip(keys, values))
        keys, values = spec.keys, [by_key[key] for key in spec.keys]
    if len(values) != len(spec.children):
        return tree
    values = [_ordered_like(value, child) for value, child in zip(values, spec.children)]
    return rebuild(kind, node_type, keys, values, tree)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # a NaN loss or metric from every ubatch is one value
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an elementwise == (numpy arrays), or none at all
        pass
    try:  # arrays of one type and shape: equal when every element is
        if type(a) is type(b) and a.shape == b.shape:
            return bool((a == b).all())
    except Exception:  # noqa: BLE001 - not comparable: different
        pass
    return False


def merge_parts(outputs: Sequence[Any]) -> list[Any]:
    """A merge that copies nothing: the list of per-ubatch outputs, in ubatch order.

    Use it (`dbo.overlap(fn, merge=dbo.merge_parts)`) when the consumer can take the parts,
    or when `fn` already wrote its rows into a shared output buffer.
    """
    return list(outputs)


@dataclass(frozen=True)
class TokenSplit:
    """One ubatch's share of a ragged token batch."""

    token_slice: slice
    """The ubatch's tokens: rows of the flattened token batch."""
    request_slice: slice
    """The requests with at least one token in `token_slice` (a request split over two
    ubatches appears in both)."""


def balanced_token_split(
    num_tokens_per_request: Sequence[int] | torch.Tensor,
    num_ubatches: int,
    *,
    allow_straddle: bool = True,
) -> list[TokenSplit]:
    """Split a ragged batch of requests into `num_ubatches` contiguous token ranges.

    Args:
        num_tokens_per_request: token count of each request, in batch order.
        num_ubatches: how many ubatches, in [1, 1024].
        allow_straddle: if True, token counts differ by at most one and a request may
            continue from one ubatch into the next; if False, the split falls on request
            boundaries and minimises the largest ubatch's token count.

    Returns one `TokenSplit` per ubatch, in order; the token slices tile `[0, total)`.
    A ubatch is empty (zero tokens) only when there are fewer tokens (straddling) or fewer
    requests with tokens (request boundaries) than ubatches.
    """
    num_ubatches = check_num_ubatches(num_ubatches)
    if isinstance(num_tokens_per_request, torch.Tensor):
        if num_tokens_per_request.ndim != 1:
            raise ValueError(
                "num_tokens_per_request must be 1-D, got shape "
                f"{tuple(num_tokens_per_request.shape)}"
            )
        dtype = num_tokens_per_request.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(
                "num_tokens_per_request must hold integer counts, got a tensor of "
                f"{num_tokens_per_request.dtype}; convert it with .long() if that is meant"
            )
        counts = [int(c) for c in num_tokens_per_request.tolist()]
    else:
        counts = [_token_count(c) for c in num_tokens_per_request]
    if any(c < 0 for c in counts):
        raise ValueError(f"token counts must be >= 0, got {counts}")
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    total = starts[-1]
    if allow_straddle:
        base, extra = divmod(total, num_ubatches)
        bounds = [0]
        for i in range(num_ubatches):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    else:
        bounds = _min_max_boundaries(starts, num_ubatches)
    return [
        TokenSplit(slice(lo, hi), _requests_touching(starts, lo, hi))
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]


def _token_count(count: Any) -> int:
    """One entry of a list of token counts, as an int (TypeError naming the argument)."""
    is_bool = isinstance(count, bool) or (
        isinstance(count, torch.Tensor) and count.dtype == torch.bool
    )
    if not is_bool:  # operator.index takes a bool (and a bool tensor) as 0 or 1
        try:
            return operator.index(count)
        except TypeError:
            pass
    raise TypeError(
        f"num_tokens_per_request must hold integer counts, got {count!r} of type "
        f"{type(count).__name__}"
    )


def _requests_touching(starts: list[int], lo: int, hi: int) -> slice:
    """Requests r with tokens in [lo, hi): starts[r] < hi and starts[r + 1] > lo."""
    if hi <= lo:
        first = bisect.bisect_right(starts, lo) - 1
        first = max(0, min(first, len(starts) - 1))
        return slice(first, first)
    first = bisect.bisect_right(starts, lo) - 1
    last = bisect.bisect_left(starts, hi)  # one past the last request starting before hi
    return slice(first, last)


def _min_max_boundaries(starts: list[int], num_ubatches: int) -> list[int]:
    """Token boundaries on request boundaries that minimise the largest ubatch.

    The smallest feasible largest-ubatch size comes from a binary search with a greedy
    feasibility pass. The split returned is the one that puts each boundary at the request
    boundary nearest to the ideal `k * total / n` when that reaches the optimum without
    leaving a ubatch empty (the common case, and the most even split), else a greedy split
    at the optimum that keeps every ubatch non-empty when there are at least `n`
    non-empty requests.
    """
    counts = [b - a for a, b in zip(starts[:-1], starts[1:])]
    total = starts[-1]
    num_nonempty = sum(1 for count in counts if count > 0)
    fill_all = num_nonempty >= num_ubatches

    def greedy(limit: int, keep_nonempty: bool = False) -> list[int] | None:
        bounds = [0]
        filled = 0
        nonempty_left = num_nonempty
        for index, count in enumerate(counts):
            # With `keep_nonempty`, once the non-empty requests left are no more than the
            # ubatches after the current one, each of them opens its own ubatch.
            if filled + count > limit or (
                keep_nonempty and count > 0 and filled > 0
                and nonempty_left <= num_ubatches - len(bounds)
            ):
                bounds.append(starts[index])
                filled = 0
            filled += count
            nonempty_left -= count > 0
        if len(bounds) > num_ubatches:
            return None
        return bounds + [total] * (num_ubatches + 1 - len(bounds))

    lo, hi = max(counts, default=0), total
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    nearest = [0]
    for k in range(1, num_ubatches):
        ideal = k * total / num_ubatches
        index = bisect.bisect_left(starts, ideal)
        candidates = [starts[j] for j in (index - 1, index) if 0 <= j < len(starts)]
        cut = min(candidates, key=lambda c: (abs(c - ideal), c))
        nearest.append(max(cut, nearest[-1]))
    nearest.append(total)
    sizes = [b - a for a, b in zip(nearest[:-1], nearest[1:])]
    if max(sizes) <= lo and (min(sizes) > 0 or not fill_all):
        return nearest
    bounds = greedy(lo, keep_nonempty=fill_all)
    assert bounds is not None, "the binary search ends on a feasible limit"
    return bounds
