"""How comm launches a checked collective (`comm._launch`): a plain call goes straight to
the process group's method, anything torch.distributed's function treats specially
(tensor subclasses, complex tensors, coalescing, torch.compile tracing) goes through
that function. Results are checked on both paths; across real ranks the distributed
tests check the values."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d
from torch.overrides import TorchFunctionMode

import comm
import dbo
from comm import _launch

TORCH_FUNCTIONS = (
    "all_to_all_single", "all_reduce", "all_gather_single", "all_gather_into_tensor",
    "reduce_scatter_single", "reduce_scatter_tensor",
)


@pytest.fixture
def torch_calls(world_of_one: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of torch.distributed's collective functions called (they still run)."""
    called: list[str] = []
    for name in TORCH_FUNCTIONS:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def recording(
            *args: Any, _name: str = name, _original: Any = original, **kwargs: Any
        ) -> Any:
            called.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, recording)
    yield called


def _every_collective(make: Callable[[torch.Tensor], torch.Tensor], async_op: bool) -> None:
    """Run each collective once on tensors from `make` and check the world-of-one result."""
    x = make(torch.arange(6.0).reshape(3, 2))
    out = torch.empty_like(x)
    for call in (
        lambda: comm.all_to_all_single(out, x, async_op=async_op),
        lambda: comm.all_to_all_single(out, x, [3], [3], async_op=async_op),
    ):
        out.zero_()
        work = call()
        if async_op:
            work.wait()
        assert torch.equal(out, x)
    summed = x.clone()
    work = comm.all_reduce(summed, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(summed, x)
    gathered = torch.empty_like(x)
    work = comm.all_gather_into_tensor(gathered, x, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(gathered, x)
    scattered = torch.empty_like(x)
    work = comm.reduce_scatter_tensor(scattered, x, op=comm.ReduceOp.MAX, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(scattered, x)


@pytest.mark.parametrize("async_op", [False, True])
def test_a_plain_call_skips_torch_distributed_functions(
    torch_calls: list[str], async_op: bool
) -> None:
    if None in (_launch._ALL_TO_ALL, _launch._ALL_REDUCE, _launch._ALL_GATHER,
                _launch._REDUCE_SCATTER):
        pytest.skip("this torch lacks a process-group method comm calls directly")
    _every_collective(lambda t: t, async_op)
    assert torch_calls == []


def test_a_plain_call_inside_an_overlap_skips_them_too(torch_calls: list[str]) -> None:
    def body(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        comm.all_reduce(out)
        return out

    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(dbo.overlap(body)(x), x)
    assert torch_calls == []


class _Tagged(torch.Tensor):
    """A tensor subclass with its own `__torch_function__`: torch's path must see it."""

    seen: list[str] = []  # noqa: RUF012 - shared on purpose: records across instances

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_goes_through_torch_distributed(torch_calls: list[str]) -> None:
    x = torch.arange(4.0).as_subclass(_Tagged)
    _Tagged.seen.clear()
    comm.all_reduce(x)
    assert torch_calls == ["all_reduce"]
    assert "all_reduce" in _Tagged.seen, "the subclass's __torch_function__ was bypassed"


def test_complex_tensors_go_through_torch_distributed(torch_calls: list[str]) -> None:
    x = torch.tensor([1 + 2j, 3 - 4j])
    summed = x.clone()
    comm.all_reduce(summed)
    assert torch.equal(summed, x)
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)
    assert torch.equal(out, x)
    assert torch_calls == ["all_reduce", "all_to_all_single"]


def test_a_coalescing_group_goes_through_torch_distributed(torch_calls: list[str]) -> None:
    group = dist.group.WORLD
    x = torch.ones(3)
    state = _c10d._world.pg_coalesce_state
    state[group] = []  # what `dist._coalescing_manager` sets while it records
    try:
        assert not _launch._plain(group, x, x)
    finally:
        del state[group]
    assert _launch._plain(group, x, x)
    with dist._coalescing_manager(group=group):
        x = torch.ones(3)
        comm.all_reduce(x)
    assert torch_calls == ["all_reduce"]  # recorded by torch, launched on exit
    assert torch.equal(x, torch.ones(3))


def test_torch_compile_tracing_goes_through_torch_distributed(
    torch_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_launch, "_is_compiling", lambda: True)
    _every_collective(lambda t: t, async_op=False)
    assert torch_calls == [
        "all_to_all_single", "all_to_all_single", "all_reduce",
        torch_calls[3], torch_calls[4],  # the gather/scatter names depend on torch's version
    ]
    assert torch_calls[3].startswith("all_gather") and torch_calls[4].startswith("reduce_scatter")


def test_a_torch_without_the_methods_uses_its_functions(
    torch_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("_ALL_TO_ALL", "_ALL_REDUCE", "_ALL_GATHER", "_REDUCE_SCATTER"):
        monkeypatch.setattr(_launch, name, None)
    _every_collective(lambda t: t, async_op=True)
    assert len(torch_calls) == 5


def test_an_unknown_coalescing_state_means_torch_decides(
    torch_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_launch, "_c10d", SimpleNamespace())  # a torch without `_world`
    comm.all_reduce(torch.ones(2))
    assert torch_calls == ["all_reduce"]


def test_an_active_torch_function_mode_sees_the_collective(torch_calls: list[str]) -> None:
    """Non-strict `torch.export` intercepts collectives with a mode, not a subclass."""
    seen: list[str] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2)
    with Recording():
        comm.all_reduce(x)
    assert torch_calls == ["all_reduce"]
    assert "all_reduce" in seen, "the mode's __torch_function__ was bypassed"


def test_a_process_group_subclass_goes_through_torch_distributed(
    torch_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose type is not exactly ProcessGroup may override the method torch's
    function calls; only torch's function reaches the override."""

    class Other:
        pass

    monkeypatch.setattr(_launch, "_ProcessGroup", Other)  # WORLD is now "a subclass"
    _every_collective(lambda t: t, async_op=False)
    assert len(torch_calls) == 5


@pytest.mark.parametrize("async_op", [False, True])
def test_the_direct_launch_passes_what_torch_distributed_would(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, async_op: bool
) -> None:
    """Each process-group method gets the tensors in torch's order, the split sizes
    (output's first) and options with `asyncOp` and `reduceOp` set."""
    calls: dict[str, tuple[Any, ...]] = {}
    for name in ("_ALL_TO_ALL", "_ALL_REDUCE", "_ALL_GATHER", "_REDUCE_SCATTER"):
        fast = getattr(_launch, name)
        if fast is None:
            pytest.skip("this torch lacks a process-group method comm calls directly")

        def recording(*args: Any, _name: str = name, _method: Any = fast.method) -> Any:
            calls[_name] = args
            return _method(*args)

        monkeypatch.setattr(_launch, name, fast._replace(method=recording))
    group = dist.group.WORLD
    output, input = torch.empty(3, 2), torch.ones(3, 2)
    for work in (
        comm.all_to_all_single(output, input, [3], [3], async_op=async_op),
        comm.all_reduce(input, op=comm.ReduceOp.MAX, async_op=async_op),
        comm.all_gather_into_tensor(output, input, async_op=async_op),
        comm.reduce_scatter_tensor(output, input, op=comm.ReduceOp.MIN, async_op=async_op),
    ):
        if async_op:
            work.wait()
    a2a, reduce, gather, scatter = (
        calls[name] for name in ("_ALL_TO_ALL", "_ALL_REDUCE", "_ALL_GATHER", "_REDUCE_SCATTER")
    )
    out_splits, in_splits = [3], [3]
    assert a2a[:5] == (group, output, input, out_splits, in_splits)
    assert reduce[:2] == (group, [input]) and reduce[2].reduceOp == comm.ReduceOp.MAX
    assert gather[:3] == (group, output, input)
    assert scatter[:3] == (group, output, input) and scatter[3].reduceOp == comm.ReduceOp.MIN
    for name, args in calls.items():
        options = args[-1]
        if getattr(_launch, name).has_async_op:
            assert options.asyncOp is async_op, name


def test_uneven_splits_reach_the_method_output_splits_first(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = _launch._ALL_TO_ALL
    if fast is None:
        pytest.skip("this torch lacks the process-group method")
    seen: list[tuple[Any, Any]] = []

    def recording(group: Any, output: Any, input: Any, out_splits: Any, in_splits: Any,
                  options: Any) -> Any:
        seen.append((out_splits, in_splits))
        return fast.method(group, output, input, [4], [4], options)  # the real call: world of 1

    monkeypatch.setattr(_launch, "_ALL_TO_ALL", fast._replace(method=recording))
    _launch.all_to_all_single(dist.group.WORLD, torch.empty(4), torch.ones(4), [1, 3], [2, 2],
                              False)
    _launch.all_to_all_single(dist.group.WORLD, torch.empty(4), torch.ones(4), None, None, False)
    assert seen == [([1, 3], [2, 2]), ([], [])]


def test_launch_options_are_built_once_per_kind_and_carry_the_call_s_fields() -> None:
    # Options objects are cached; each cached object says what its call asked for.
    direct = _launch._ALL_REDUCE
    if direct is None:
        pytest.skip("this torch has no direct all_reduce launch")
    max_async = _launch._options(direct, True, dist.ReduceOp.MAX)
    assert _launch._options(direct, True, dist.ReduceOp.MAX) is max_async
    assert max_async.reduceOp == dist.ReduceOp.MAX
    max_blocking = _launch._options(direct, False, dist.ReduceOp.MAX)
    sum_async = _launch._options(direct, True, dist.ReduceOp.SUM)
    assert max_blocking is not max_async and sum_async is not max_async
    assert sum_async.reduceOp == dist.ReduceOp.SUM
    if direct.has_async_op:
        assert max_async.asyncOp and not max_blocking.asyncOp
    # A ReduceOp object may carry a scalar (premultiplied sum): never shared.
    scaled = dist._make_nccl_premul_sum(2.0)
    assert _launch._options(direct, True, scaled) is not _launch._options(direct, True, scaled)



def test_reduce_ops_made_afresh_per_call_share_one_cached_options(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _launch._ALL_REDUCE is None:
        pytest.skip("this torch has no direct all_reduce launch")
    monkeypatch.setattr(_launch, "_options_cache", {})  # filled here, not for later tests
    max_value = int(dist.ReduceOp.MAX)
    for _ in range(300):
        tensor = torch.ones(2)
        comm.all_reduce(tensor, op=dist.ReduceOp.RedOpType(max_value))  # a new object each time
        torch.testing.assert_close(tensor, torch.ones(2), rtol=0, atol=0)
    assert len(_launch._options_cache) == 1
    comm.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM)
    assert len(_launch._options_cache) == 2
    assert {key[2] for key in _launch._options_cache} == {dist.ReduceOp.MAX, dist.ReduceOp.SUM}
