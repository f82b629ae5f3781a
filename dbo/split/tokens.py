"""`balanced_token_split`: contiguous token ranges of a ragged batch, one per ubatch."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dbo._checks import check_num_ubatches
from dbo.split.batch import rows_per_ubatch


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
        num_tokens_per_request = num_tokens_per_request.tolist()  # floats and bools: refused
    counts = [_token_count(c) for c in num_tokens_per_request]
    if any(c < 0 for c in counts):
        raise ValueError(f"num_tokens_per_request must hold counts >= 0, got {counts}")
    starts = [0, *itertools.accumulate(counts)]
    if allow_straddle:
        bounds = [0, *itertools.accumulate(rows_per_ubatch(starts[-1], num_ubatches))]
    else:
        bounds = _min_max_boundaries(counts, starts, num_ubatches)
    return [
        TokenSplit(slice(lo, hi), _requests_touching(starts, lo, hi))
        for lo, hi in itertools.pairwise(bounds)
    ]


def _token_count(count: Any) -> int:
    """One entry of a list of token counts, as an int (TypeError naming the argument)."""
    is_bool = isinstance(count, bool) or (
        isinstance(count, torch.Tensor) and count.dtype == torch.bool
    )
    if not is_bool:  # operator.index takes a bool (and a bool tensor) as 0 or 1
        with contextlib.suppress(TypeError):
            return operator.index(count)
    raise TypeError(
        f"num_tokens_per_request must hold integer counts, got {count!r} of type "
        f"{type(count).__name__}"
    )


def _requests_touching(starts: list[int], lo: int, hi: int) -> slice:
    """Requests r with tokens in [lo, hi): starts[r] < hi and starts[r + 1] > lo (none,
    at the request holding token lo, when hi <= lo)."""
    first = bisect.bisect_right(starts, lo) - 1
    last = bisect.bisect_left(starts, hi) if hi > lo else first  # one past the last
    return slice(first, last)


def _min_max_boundaries(counts: list[int], starts: list[int], num_ubatches: int) -> list[int]:
    """Token boundaries on request boundaries that minimise the largest ubatch.

    The optimum comes from a binary search with a greedy feasibility pass. Each boundary
    goes to the request boundary nearest to the ideal `k * total / n` when that reaches
    the optimum without leaving a ubatch empty (the most even split), else a greedy split
    at the optimum keeps every ubatch non-empty when at least `n` requests have tokens.
    """
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

    # The optimum: the smallest limit the greedy pass meets (every larger one meets it).
    largest_request = max(counts, default=0)
    limit = largest_request + bisect.bisect_left(
        range(largest_request, total), True, key=lambda candidate: greedy(candidate) is not None
    )
    nearest = [0]
    for k in range(1, num_ubatches):
        ideal = k * total / num_ubatches
        index = bisect.bisect_left(starts, ideal)
        candidates = [starts[j] for j in (index - 1, index) if 0 <= j < len(starts)]
        cut = min(candidates, key=lambda c: (abs(c - ideal), c))
        nearest.append(max(cut, nearest[-1]))
    nearest.append(total)
    sizes = [b - a for a, b in itertools.pairwise(nearest)]
    if max(sizes) <= limit and (min(sizes) > 0 or not fill_all):
        return nearest
    bounds = greedy(limit, keep_nonempty=fill_all)
    assert bounds is not None, "the binary search ends on a feasible limit"
    return bounds
