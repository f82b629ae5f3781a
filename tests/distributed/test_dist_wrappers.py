"""Data-parallel wrappers around and inside an overlapped call, on gloo ranks: FSDP2
(`fully_shard`, per block and at the root) and DDP, with blocks whose forward and
backward exchange through `comm` (each a yield point inside an overlap).

FSDP2: the forward equals the same wrapper on the ubatches in turn, for every
`reshard_after_forward` (True, False, and an int on 4 ranks), and gathers each unit once
per overlapped forward; the overlapped backward (each ubatch's in its thread)
reduce-scatters each unit once and gives every parameter its gradient, allclose to in
turn and the same bits on every run, as `overlap_backward=False` does; so do gradient
accumulation with `set_requires_gradient_sync(False)` and a step after a backward that
failed. DDP, either way round and under `no_sync()`: the gradients of the same ubatches
in turn, with one all-reduce per bucket per backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _exchanges import SumInBackward, SumInForward
from _spawn import expect_ok, run_world, start_together

import comm
import dbo

pytestmark = pytest.mark.distributed

HIDDEN, ROWS = 16, 8


class Block(torch.nn.Module):
    """An exchange in the forward (`comm.all_reduce`) and one in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = SumInForward.apply(self.a(SumInBackward.apply(x))) / torch.distributed.get_world_size()
        return x + self.b(torch.tanh(y))


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[Block() for _ in range(3)])


def _sharded(reshard: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for block in model:
        fully_shard(block, reshard_after_forward=reshard)
    return fully_shard(model, reshard_after_forward=reshard)


class _Twice(torch.nn.Module):
    """Three units, the middle one run twice per forward (weights shared across depth)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.shared, self.last = Block(), Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.shared(self.shared(self.first(x))))


def _twice_sharded(reshard: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _Twice()
    for block in (model.first, model.shared, model.last):
        fully_shard(block, reshard_after_forward=reshard)
    return fully_shard(model, reshard_after_forward=reshard)


def _in_turn(model: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.cat([model(part) for part in x.tensor_split(2)])


def _x(rank: int, requires_grad: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(ROWS, HIDDEN, generator=generator, requires_grad=requires_grad)


def _grads(model: torch.nn.Module, step: Callable[..., Any], x: torch.Tensor,
           calls: int = 1) -> list[torch.Tensor | None]:
    """The gradients after `calls` steps' backwards (accumulated), x's first."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    for _ in range(calls):
        (step(x) ** 2).sum().backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    return [None if g is None else _local(g).clone() for g in grads]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _close(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(
        a is not None and b is not None and torch.allclose(a, b, atol=1e-5)
        for a, b in zip(got, want)
    )


GATHERS = ("all_gather_single", "all_gather_into_tensor")
"""FSDP2 gathers a unit's parameters with one (torch 2.13's name, then 2.11's)."""
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
"""FSDP2 reduces a unit's gradients with one."""


def _count(names: tuple[str, ...], step: Callable[[], Any]) -> int:
    """How many of the `torch.distributed` collectives `names` `step()` makes (one that
    calls another is counted once)."""
    dist = torch.distributed
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    count, depth = [0], [0]

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            count[0] += depth[0] == 0
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return collective

    for name, original in originals.items():
        setattr(dist, name, counted(original))
    try:
        step()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return count[0]


class _FailInUBatch1(torch.autograd.Function):
    """Identity; its backward raises in ubatch 1 while `failing[0]`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, failing: list[bool]) -> torch.Tensor:
        ctx.failing = failing
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.failing[0] and dbo.current_ubatch_id() == 1:
            raise KeyError("injected in ubatch 1's backward")
        return grad, None


def _reshards(world_size: int) -> tuple[Any, ...]:
    """The `reshard_after_forward` settings checked: an int (a smaller mesh after the
    forward) needs a world it divides."""
    return (True, False, 2) if world_size == 4 else (True, False)


def _fsdp_checks() -> dict[str, Any]:
    start_together()
    rank, world_size, _ = comm.init_distributed(timeout_s=60)
    found: dict[str, Any] = {}
    for reshard in _reshards(world_size):
        model, reference = _sharded(reshard), _sharded(reshard)
        step, in_turn = dbo.overlap(model, timeout_s=60), _in_turn(reference)
        with torch.no_grad():
            found[f"{reshard} forward equal"] = torch.equal(step(_x(rank)), in_turn(_x(rank)))
            found[f"{reshard} gathers"] = _count(GATHERS, lambda: step(_x(rank)))  # noqa: B023
            found[f"{reshard} gathers in turn"] = _count(
                GATHERS, lambda: in_turn(_x(rank)))  # noqa: B023
        want = _grads(reference, in_turn, _x(rank, True), calls=2)
        for name, trains in (("overlapped", step), ("in turn", dbo.overlap(
                model, timeout_s=60, overlap_backward=False))):
            got = _grads(model, trains, _x(rank, True), calls=2)
            again = _grads(model, trains, _x(rank, True), calls=2)
            found[f"{reshard} {name} grads close"] = _close(got, want)
            found[f"{reshard} {name} grads same bits"] = all(
                torch.equal(a, b) for a, b in zip(got, again))  # type: ignore[arg-type]
        loss = (step(_x(rank, True)) ** 2).sum()
        with dbo.trace() as timeline:
            found[f"{reshard} reduce-scatters"] = _count(REDUCE_SCATTERS, loss.backward)
        found[f"{reshard} backward waits"] = {
            ubatch: total.waits for ubatch, total in timeline.totals().items()}
        loss = (in_turn(_x(rank, True)) ** 2).sum()
        found[f"{reshard} reduce-scatters in turn"] = _count(REDUCE_SCATTERS, loss.backward)
    # Gradient accumulation without a reduction on the first micro-step.
    model, reference = _sharded(True), _sharded(True)
    accumulated = []
    for wrapped, trains in ((reference, _in_turn(reference)), (model, dbo.overlap(model))):
        wrapped.zero_grad(set_to_none=True)
        for sync in (False, True):
            wrapped.set_requires_gradient_sync(sync)  # type: ignore[operator]
            (trains(_x(rank, True)) ** 2).sum().backward()
        accumulated.append([_local(p.grad) for p in wrapped.parameters()])
    found["no gradient sync, then sync"] = _close(*accumulated)
    # A backward that fails in a ubatch raises on every rank; the next step is right.
    model, reference = _sharded(True), _sharded(True)
    failing = [True]
    step = dbo.overlap(lambda x: _FailInUBatch1.apply(model(x), failing), timeout_s=60)
    try:
        (step(_x(rank, True)) ** 2).sum().backward()
        found["failed backward"] = "no error"
    except KeyError as error:
        found["failed backward"] = f"KeyError in ubatch {getattr(error, 'ubatch_id', None)}"
    failing[0] = False
    found["next step after a failure"] = _close(
        _grads(model, step, _x(rank, True))[1:],
        _grads(reference, _in_turn(reference), _x(rank, True))[1:])
    # A unit run twice in one forward: gathered again for its second run where it
    # reshards, its gradients summed over both runs and both ubatches.
    for reshard in (True, False):
        model, reference = _twice_sharded(reshard), _twice_sharded(reshard)
        step = dbo.overlap(model, timeout_s=60)
        with torch.no_grad():
            found[f"unit twice {reshard} forward"] = torch.allclose(
                step(_x(rank)), _in_turn(reference)(_x(rank)), atol=1e-5)
        found[f"unit twice {reshard} grads"] = _close(
            _grads(model, step, _x(rank, True)),
            _grads(reference, _in_turn(reference), _x(rank, True)))
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_shares_each_units_gather_and_reduce_and_trains_as_in_turn(
    world_size: int,
) -> None:
    results = expect_ok(run_world(_fsdp_checks, world_size, timeout_s=240))
    for rank, found in enumerate(results):
        assert found.pop("no gradient sync, then sync"), rank
        assert found.pop("failed backward") == "KeyError in ubatch 1", rank
        assert found.pop("next step after a failure"), rank
        for reshard in (True, False):
            assert found.pop(f"unit twice {reshard} forward"), (rank, reshard)
            assert found.pop(f"unit twice {reshard} grads"), (rank, reshard)
        for reshard in _reshards(world_size):
            assert found[f"{reshard} forward equal"], (rank, reshard)
            # Three units, each gathered at most once per overlapped forward; in turn,
            # resharding after forward gathers each once per ubatch.
            assert found[f"{reshard} gathers"] <= 3, (rank, found)
            in_turn = found[f"{reshard} gathers in turn"]
            assert in_turn == (6 if reshard else found[f"{reshard} gathers"]), (rank, found)
            for name in ("overlapped", "in turn"):
                assert found[f"{reshard} {name} grads close"], (rank, reshard, name)
                assert found[f"{reshard} {name} grads same bits"], (rank, reshard, name)
            # One reduce-scatter per unit per backward, as the wrapper in turn makes.
            assert found[f"{reshard} reduce-scatters"] == 3, (rank, found)
            assert found[f"{reshard} reduce-scatters in turn"] == 3, (rank, found)
            # Each ubatch's backward waited at its own exchanges; the caller at none.
            waits = found[f"{reshard} backward waits"]
            assert waits.get(0, 0) >= 3 and waits.get(1, 0) >= 3, waits
            assert waits.get(dbo.tracing.CALLER, 0) == 0, waits


class _Overlapping(torch.nn.Module):
    """A module whose forward is its inner module's, overlapped."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.step = dbo.overlap(inner, timeout_s=60)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x)


def _ddp(module: torch.nn.Module, buckets: list[int]) -> torch.nn.Module:
    """`module` in DDP with small buckets, each all-reduce counted in `buckets[0]`."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    def counted(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        buckets[0] += 1
        return allreduce_hook(state, bucket)

    wrapped = DistributedDataParallel(module, bucket_cap_mb=0.002)
    wrapped.register_comm_hook(None, counted)
    return wrapped


def _ddp_checks() -> dict[str, Any]:
    start_together()
    rank, _, _ = comm.init_distributed(timeout_s=60)
    found: dict[str, Any] = {}
    counts = {name: [0] for name in ("in turn", "DDP(overlap)", "overlap(DDP)")}
    reference = _ddp(_model(), counts["in turn"])
    # Two steps: DDP's buckets are rebuilt to bucket_cap_mb after its first.
    want = _grads(reference, _in_turn(reference), _x(rank, True), calls=2)
    wrapped_overlap = _ddp(_Overlapping(_model()), counts["DDP(overlap)"])
    found["DDP(overlap)"] = _close(
        _grads(wrapped_overlap, wrapped_overlap, _x(rank, True), calls=2), want)
    overlap_of_ddp = dbo.overlap(_ddp(_model(), counts["overlap(DDP)"]), timeout_s=60)
    got = _grads(overlap_of_ddp.dbo_target, overlap_of_ddp, _x(rank, True), calls=2)
    found["overlap(DDP)"] = _close(got, want)
    found["all-reduces"] = {name: count[0] for name, count in counts.items()}
    # no_sync: the first call's gradients stay local, the second's are all-reduced.
    model = _ddp(_model(), [0])
    step = dbo.overlap(model, timeout_s=60)
    model.zero_grad(set_to_none=True)
    x = _x(rank, True)
    with model.no_sync():
        (step(x) ** 2).sum().backward()
    (step(x) ** 2).sum().backward()
    found["no_sync"] = _close([p.grad for p in model.parameters()], want[1:])
    return found


@pytest.mark.timeout(300)
def test_ddp_either_way_round_and_no_sync_give_the_in_turn_gradients() -> None:
    for rank, found in enumerate(expect_ok(run_world(_ddp_checks, 2, timeout_s=240))):
        # One all-reduce per bucket per backward, as many as the wrapper in turn makes.
        all_reduces = found.pop("all-reduces")
        assert len(set(all_reduces.values())) == 1 and all_reduces["in turn"] > 2, all_reduces
        assert found and all(found.values()), (rank, found)
