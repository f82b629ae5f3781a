"""`dbo.overlap` against calling the function directly, on inputs and outputs that are
easy to get wrong: nested structures, outputs that differ between ubatches,
torch settings a ubatch changes, transforms, custom split and merge on the inline path."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import dbo

TIMEOUT_S = 30.0


def _overlap(fn: Any, **options: Any) -> Any:
    return dbo.overlap(fn, timeout_s=TIMEOUT_S, **options)


# ---------------------------------------------------------------------------- structures
def test_dicts_with_the_same_keys_in_another_order_merge() -> None:
    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        if dbo.current_ubatch_id() == 0:
            return {"a": x, "b": x + 1}
        return {"b": x + 1, "a": x}

    x = torch.arange(4.0)
    out = _overlap(fn)(x)
    assert list(out) == ["a", "b"]
    assert torch.equal(out["a"], x) and torch.equal(out["b"], x + 1)


def test_a_structure_mismatch_names_the_keys() -> None:
    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x} if dbo.current_ubatch_id() == 0 else {"b": x}

    with pytest.raises(ValueError, match="'a'.*'b'"):
        _overlap(fn)(torch.arange(4.0))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (x, None) if dbo.current_ubatch_id() == 0 else (None, x),
        lambda x: x if dbo.current_ubatch_id() == 0 else x.sum(),
        lambda x: x if dbo.current_ubatch_id() == 0 else 3,
    ],
    ids=["tensor-vs-none", "tensor-vs-0-dim", "tensor-vs-int"],
)
def test_leaves_of_different_kinds_raise_value_error_naming_the_leaf(fn: Any) -> None:
    with pytest.raises(ValueError, match="output"):
        _overlap(fn)(torch.arange(4.0))


def test_ordered_dicts_with_keys_in_another_order_merge() -> None:
    def fn(x: torch.Tensor) -> collections.OrderedDict[str, torch.Tensor]:
        if dbo.current_ubatch_id() == 0:
            return collections.OrderedDict(a=x, b=x + 1)
        return collections.OrderedDict(b=x + 1, a=x)

    out = _overlap(fn)(torch.arange(4.0))
    assert isinstance(out, collections.OrderedDict) and list(out.keys()) == ["a", "b"]
    assert torch.equal(out["b"], torch.arange(4.0) + 1)


NO_ROWS = torch.empty(0, 3)


def test_a_shared_tensor_without_rows_may_come_from_every_ubatch() -> None:
    out, aux = _overlap(lambda x: (x, NO_ROWS))(torch.zeros(4, 3))
    assert out.shape == (4, 3) and aux.shape == (0, 3)


# ---------------------------------------------------------------------------- settings
def test_a_thread_count_changed_inside_fn_does_not_leak_into_the_next_run() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []

        def fn(x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            torch.set_num_threads(1)  # e.g. a library call inside the model
            return x

        _overlap(fn)(torch.zeros(4))
        _overlap(fn)(torch.zeros(4))
        assert seen == [2, 2, 2, 2]
    finally:
        torch.set_num_threads(before)


def test_a_grad_mode_left_changed_by_fn_does_not_leak_into_the_next_run() -> None:
    """Workers enter only the settings that differ from their own state: a grad mode
    that `fn` changed for good (the function-call form, no `with`) is set right again."""
    seen: list[bool] = []

    def leaky(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        torch.set_grad_enabled(not torch.is_grad_enabled())
        return x

    _overlap(leaky)(torch.zeros(4))
    _overlap(leaky)(torch.zeros(4))
    with torch.no_grad():
        _overlap(leaky)(torch.zeros(4))
    _overlap(leaky)(torch.zeros(4))
    assert seen == [True] * 4 + [False] * 2 + [True] * 2
    assert torch.is_grad_enabled()


_needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU affinity and 2 CPUs",
)


@_needs_affinity
def test_ubatch_threads_run_on_the_callers_cpus() -> None:
    """CPU affinity is per thread: pinning the caller (to keep every handoff on one
    core) must pin its ubatch threads too, and unpinning it must unpin them."""
    everything = os.sched_getaffinity(0)
    one = {min(everything)}
    seen: list[set[int]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(os.sched_getaffinity(0))
        if dbo.current_ubatch_id() == 1:
            os.sched_setaffinity(0, everything - one)  # fn's own change must not stick
        return x

    try:
        os.sched_setaffinity(0, one)
        _overlap(fn)(torch.zeros(4))
        _overlap(fn)(torch.zeros(4))
    finally:
        os.sched_setaffinity(0, everything)
    _overlap(fn)(torch.zeros(4))
    assert seen == [one] * 4 + [everything] * 2


@_needs_affinity
def test_ubatch_threads_of_a_pinned_caller_never_serve_an_unpinned_one() -> None:
    """A worker's intra-op pool keeps the CPUs the worker had when the pool started, so
    workers are never re-pinned: an unpinned caller gets threads that were never pinned."""
    everything = os.sched_getaffinity(0)
    threads: dict[str, set[int]] = {"pinned": set(), "unpinned": set()}

    def recorder(key: str) -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            threads[key].add(threading.get_native_id())
            return x

        return fn

    _overlap(recorder("unpinned"))(torch.zeros(4))  # a runner created unpinned
    caller = threading.Thread(
        target=lambda: (
            os.sched_setaffinity(0, {min(everything)}),
            _overlap(recorder("pinned"))(torch.zeros(4)),
        )
    )
    caller.start()
    caller.join(timeout=TIMEOUT_S)
    _overlap(recorder("unpinned"))(torch.zeros(4))
    assert threads["pinned"] and threads["unpinned"]
    assert not threads["pinned"] & threads["unpinned"]
    for thread_id in threads["unpinned"]:
        assert os.sched_getaffinity(thread_id) == everything


def test_idle_runners_are_bounded_and_the_least_recently_used_go_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbo.runtime import affinity

    pool = dbo.runtime.pool.runner_pool
    dbo.close_default_runners()
    caller_cpus: list[frozenset[int]] = [frozenset({0})]
    monkeypatch.setattr(affinity, "cpus_of_this_thread", lambda: caller_cpus[0])
    monkeypatch.setattr(affinity, "restore", lambda cpus: None)  # no real re-pinning

    def worker_threads() -> set[int]:
        seen: set[int] = set()

        def fn(x: torch.Tensor) -> torch.Tensor:
            seen.add(threading.get_native_id())
            return x

        _overlap(fn)(torch.zeros(4))
        return seen

    mine = worker_threads()  # this caller's runner, used first
    for core in range(1, 12):  # then callers pinned to eleven other cores
        caller_cpus[0] = frozenset({core})
        worker_threads()
    assert len(pool._idle) == 8
    caller_cpus[0] = frozenset({0})
    assert worker_threads() != mine  # the least recently used runner went first
    caller_cpus[0] = frozenset({11})
    recent = worker_threads()
    assert worker_threads() == recent  # a recently used one is kept, call after call
    dbo.close_default_runners()


def test_a_refused_affinity_query_does_not_break_overlaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbo.runtime import affinity

    def refuse(pid: int) -> set[int]:
        raise PermissionError("sched_getaffinity is not allowed here")

    monkeypatch.setattr(affinity, "_get_affinity", refuse)
    assert affinity.cpus_of_this_thread() is None
    assert torch.equal(_overlap(lambda x: x + 1)(torch.zeros(4)), torch.ones(4))


def test_torch_func_transforms_run_inline_and_stay_correct() -> None:
    calls: list[bool] = []

    def square(u: torch.Tensor) -> torch.Tensor:
        calls.append(dbo.enabled())
        return u * u

    x = torch.arange(1.0, 5.0)
    grad = torch.func.grad(lambda t: _overlap(square)(t).sum())(x)
    assert torch.equal(grad, 2 * x)
    assert calls == [False]  # inline: ubatch threads cannot see the transform
    batched = torch.func.vmap(_overlap(square))(x.reshape(2, 2))
    assert torch.equal(batched, (x * x).reshape(2, 2))


# ---------------------------------------------------------------------------- inline paths
@pytest.mark.parametrize("rows", [1, 4])
def test_a_custom_merge_also_runs_on_the_inline_path(rows: int) -> None:
    step = _overlap(lambda x: x * 2, merge=dbo.merge_parts)
    out = step(torch.ones(rows, 3))
    assert isinstance(out, list)
    assert torch.equal(torch.cat(out), torch.full((rows, 3), 2.0))


def test_a_nested_overlap_with_a_custom_merge_returns_the_merged_form() -> None:
    inner = _overlap(lambda x: x + 1, merge=dbo.merge_parts)
    out = _overlap(lambda x: torch.cat(inner(x)))(torch.zeros(4, 2))
    assert torch.equal(out, torch.ones(4, 2))


def test_a_custom_split_decides_on_the_largest_tensor_not_the_first() -> None:
    # Ragged batches put per-request metadata (here one request of 10 tokens) next to
    # the tokens; the batch is the tokens.
    def split(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Any]:
        lengths, tokens = args
        return [
            ((lengths, tokens[part.token_slice]), {})
            for part in dbo.balanced_token_split(lengths, n)
        ]

    enabled: list[bool] = []

    def fn(lengths: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        enabled.append(dbo.enabled())
        return tokens * 2

    tokens = torch.arange(10.0)
    out = _overlap(fn, split=split)(torch.tensor([10]), tokens)
    assert enabled == [True, True]
    assert torch.equal(out, tokens * 2)


@dataclasses.dataclass(frozen=True)
class RowsCounted:
    x: torch.Tensor
    num_rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_rows", int(self.x.shape[0]))


pytree.register_dataclass(RowsCounted)

def test_a_field_derived_in_post_init_matches_the_merged_output() -> None:
    out = _overlap(lambda x: RowsCounted(x * 2))(torch.ones(6, 1))
    assert out.num_rows == 6 and out.x.shape == (6, 1)


def test_the_same_tensor_object_from_every_ubatch_is_refused() -> None:
    weight = torch.ones(3, 2)
    with pytest.raises(ValueError, match="same tensor object"):
        _overlap(lambda x: (x, weight))(torch.zeros(4))


def test_nan_floats_from_every_ubatch_merge_as_one_value() -> None:
    out = _overlap(lambda x: (x, float("nan")))(torch.zeros(4))
    assert out[0].shape == (4,) and out[1] != out[1]


def test_an_exception_raised_again_gets_its_ubatch_note_once() -> None:
    error = KeyError("missing")

    def fn(x: torch.Tensor) -> torch.Tensor:
        raise error

    for _ in range(2):
        with pytest.raises(KeyError):
            _overlap(fn)(torch.zeros(4))
    notes = [note for note in error.__notes__ if "raised in ubatch" in note]
    assert notes == ["raised in ubatch 0 of 2 (dbo overlap)"]


@pytest.mark.skipif(
    not hasattr(torch._C._profiler, "_ExperimentalConfig"), reason="no experimental config"
)
def test_the_documented_profiler_setting_records_ubatch_threads() -> None:
    from torch.profiler import ProfilerActivity, profile

    step = _overlap(lambda x: x @ x.T)
    x = torch.randn(8, 8)
    step(x)  # warm: the runner's threads exist before the profiler starts
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        step(x)
    assert sum(1 for event in prof.events() if event.name == "aten::mm") == 2


# -------------------------------------------------------------------- registered dataclasses
@dataclasses.dataclass
class Derived:
    x: torch.Tensor
    n: int = dataclasses.field(init=False)
    total: torch.Tensor = dataclasses.field(init=False)
    col_scale: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.n = int(self.x.shape[0])
        self.total = self.x.sum()
        self.col_scale = torch.ones(self.x.shape[1])  # not batch-shaped


pytree.register_dataclass(Derived)


def test_fields_derived_in_post_init_are_derived_again_not_split_or_merged() -> None:
    seen: list[tuple[int, int]] = []

    def fn(batch: Derived) -> Derived:
        seen.append((batch.n, int(batch.col_scale.shape[0])))
        return Derived(batch.x * 2)

    out = _overlap(fn)(Derived(torch.ones(5, 3)))
    assert seen == [(3, 3), (2, 3)]
    assert out.n == 5 and out.total.item() == 30.0 and out.col_scale.shape == (3,)


# ---------------------------------------------------------------------------- memory
def test_outputs_are_freed_by_reference_counting_not_left_to_the_gc() -> None:
    # A reference cycle holding the leaves would keep every step's activations alive
    # until the garbage collector runs, so the allocator could not reuse their memory.
    import gc
    import weakref

    seen: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> dict[str, Any]:
        out = x * 2
        seen.extend((weakref.ref(x), weakref.ref(out)))
        return {"y": out, "aux": [out[:1]]}

    step = _overlap(fn)
    gc.collect()
    gc.disable()
    try:
        merged = step(torch.ones(8, 4))
        assert [ref() for ref in seen[1::2]] == [None, None]  # copied by the merge, freed
        result = weakref.ref(merged["y"])
        del merged
        assert result() is None
        for _ in range(5):
            step(torch.ones(8, 4))
        assert len(seen) == 24 and all(ref() is None for ref in seen)
    finally:
        gc.enable()


# ---------------------------------------------------------------- exit callbacks, custom split
def test_an_exit_callback_registered_by_a_hook_at_the_end_still_runs() -> None:
    ran: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        # Registered for the next ubatch; ubatch 1's hook runs in ubatch 0's thread...
        dbo.register_recv_hook(lambda: dbo.at_ubatch_exit(lambda: ran.append(me)))
        return x  # ...at ubatch 0's end (remaining hooks), after its exit callbacks

    _overlap(fn)(torch.zeros(2))
    assert sorted(ran) == [0, 1]


_SPLIT = r"split\(args, kwargs, num_ubatches\)"


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        (
            lambda x: [([x[:2]], {}), ([x[2:]], {})], TypeError,
            _SPLIT + r"\[0\] must be an \(args_tuple, kwargs_dict\) pair, got a pair of "
            r"\(list, dict\)",
        ),
        (
            lambda x: [((x[:1],), {}), ((x[1:2],), {}), ((x[2:],), {})], ValueError,
            _SPLIT + r" must hold one \(args_tuple, kwargs_dict\) pair per ubatch: "
            r"num_ubatches=2, got 3",
        ),
        (
            lambda x: None, TypeError,
            _SPLIT + r" must be a list of 2 \(args_tuple, kwargs_dict\) pairs, got NoneType",
        ),
        (
            lambda x: [(x[:2],), (x[2:],)], TypeError,
            _SPLIT + r"\[0\] must be an \(args_tuple, kwargs_dict\) pair, got a tuple",
        ),
    ],
)
def test_a_malformed_custom_split_result_is_named_in_the_error(
    returned: Any, error: type[Exception], message: str
) -> None:
    step = dbo.overlap(lambda x: x, split=lambda args, kwargs, n: returned(args[0]))
    with pytest.raises(error, match=message):
        step(torch.arange(4.0))


# ---------------------------------------------------------------- merging and grad mode
@pytest.mark.parametrize("as_dict", [False, True])
def test_the_merge_keeps_the_graph_fn_built_under_the_callers_no_grad(as_dict: bool) -> None:
    """A caller in no_grad whose fn turns grad on (a scoring loop that differentiates one
    head): the ubatch outputs had a graph, but the merge's torch.cat ran under the
    caller's no_grad and returned a tensor without one."""
    weight = torch.randn(3, 2, requires_grad=True)

    def fn(x: torch.Tensor) -> Any:
        with torch.enable_grad():
            y = x @ weight
        return {"y": y} if as_dict else y

    x = torch.randn(6, 3)
    with torch.no_grad():
        plain = fn(x)
        overlapped = _overlap(fn)(x)
    if as_dict:
        plain, overlapped = plain["y"], overlapped["y"]
    assert overlapped.requires_grad and plain.requires_grad
    (expected,) = torch.autograd.grad(plain.sum(), weight)
    (got,) = torch.autograd.grad(overlapped.sum(), weight)
    assert torch.allclose(got, expected)


def test_a_merge_under_no_grad_stays_without_a_graph() -> None:
    with torch.no_grad():
        out = _overlap(lambda x: x * 2)(torch.randn(4, 3, requires_grad=True))
    assert not out.requires_grad


@pytest.mark.parametrize("as_dict", [False, True])
def test_outputs_whose_trailing_shapes_differ_get_an_error_naming_the_leaf(
    as_dict: bool,
) -> None:
    def fn(x: torch.Tensor) -> Any:
        y = x[:, : dbo.current_ubatch_id() + 1]  # ubatch 0: 1 column, ubatch 1: 2
        return {"aux": {"cache": [x, y]}} if as_dict else y

    path = "output['aux']['cache'][1]" if as_dict else "output"
    with pytest.raises(ValueError) as raised:
        _overlap(fn)(torch.randn(4, 3))
    message = str(raised.value)
    assert f"cannot merge {path}" in message and "merge=" in message
    assert "(2, 1)" in message and "(2, 2)" in message  # each ubatch's shape


def test_the_split_keeps_the_inputs_graph_under_the_callers_no_grad() -> None:
    """The same caller: the split ran under its no_grad, so the parts lost their link to
    an input that requires grad and its gradient was silently missing."""
    weight = torch.randn(3, 2)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return x @ weight

    x = torch.randn(6, 3, requires_grad=True)
    with torch.no_grad():
        plain = fn(x)
        overlapped = _overlap(fn)(x)
    (expected,) = torch.autograd.grad(plain.sum(), x)
    (got,) = torch.autograd.grad(overlapped.sum(), x)
    assert torch.allclose(got, expected)


@pytest.mark.parametrize("bad", [0, -5])
def test_a_min_batch_size_below_one_is_refused_when_wrapping(bad: int) -> None:
    """It would silently mean "no minimum"; a typo (0 for 10) should not pass unseen."""
    with pytest.raises(ValueError, match="min_batch_size must be >= 1"):
        dbo.overlap(lambda x: x, min_batch_size=bad)


def test_the_nccl_decision_uses_the_groups_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The current CUDA device is per thread: a caller thread other than the one that
    initialized would name cuda:0 on every rank. A group bound to its GPU (as
    `comm.init_distributed` binds it) says which one."""
    import torch.distributed as dist

    from dbo._decide import smallest_batch_across_ranks

    seen: list[torch.Tensor] = []

    class BoundGroup:
        bound_device_id = torch.device("cpu")  # stands in for this rank's GPU

    def fake_all_reduce(tensor: torch.Tensor, op: object, group: object) -> None:
        seen.append(tensor)

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked the thread"))
    assert smallest_batch_across_ranks(7, BoundGroup()) == 7
    assert seen[0].device == torch.device("cpu")
