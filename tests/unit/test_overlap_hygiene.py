"""What one overlapped call must not leave to the next, and containers that must not be
rebuilt twice.

Ubatch workers are pooled: thread-local torch state that `fn` switches on and never
switches off would otherwise reach later, unrelated calls (run in the same workers),
while a direct call would have left it in the caller's thread for the caller to see.
Containers are rebuilt for every part and for the merged output: code that runs on
construction (`__post_init__`, a namedtuple's `__new__`) has already run once on the
values and must not transform them again. Last, values the merge and the wrapper refused
wrongly (equal arrays, a dict subclass with a required argument) or too late (a
coroutine function, whose body would run after the overlap).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any

import pytest
import torch

import dbo

TIMEOUT_S = 30.0


def _overlap(fn: Any, **options: Any) -> Any:
    return dbo.overlap(fn, timeout_s=TIMEOUT_S, **options)


def _innocent(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.eye(x.shape[1])


# ------------------------------------------------------------ state left in the workers
def test_an_autocast_fn_switched_on_and_left_on_does_not_reach_the_next_call() -> None:
    def leaky(x: torch.Tensor) -> torch.Tensor:
        torch.set_autocast_enabled("cpu", True)  # no `with`: never switched off
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        return x * 1

    x = torch.randn(8, 4)
    _overlap(leaky)(x)
    assert not torch.is_autocast_enabled("cpu")  # the caller never saw it
    seen: list[bool] = []

    def innocent(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return _innocent(x)

    y = _overlap(innocent)(x)
    assert seen == [False, False]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, _innocent(x), rtol=0, atol=0)


def test_saved_tensor_hooks_fn_entered_and_never_exited_do_not_reach_the_next_call() -> None:
    def refuse(_: torch.Tensor) -> Any:
        raise RuntimeError("a pack hook left behind by an earlier call")

    def leaves_hooks(x: torch.Tensor) -> torch.Tensor:
        torch.autograd.graph.saved_tensors_hooks(refuse, lambda packed: packed).__enter__()
        return x * 1

    def leaves_hooks_disabled(x: torch.Tensor) -> torch.Tensor:
        torch.autograd.graph.disable_saved_tensors_hooks("left disabled").__enter__()
        return x * 1

    x = torch.randn(8, 4, requires_grad=True)
    _overlap(leaves_hooks)(x)
    y = _overlap(lambda t: t * t)(x)  # saves t for backward: the hook would raise
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * x.detach())
    _overlap(leaves_hooks_disabled)(x)
    with torch.autograd.graph.save_on_cpu():  # the caller's hooks, refused if disabled
        y = _overlap(lambda t: t * t)(x)
    assert y.requires_grad


def test_an_inference_mode_fn_entered_and_never_exited_does_not_reach_the_next_call() -> None:
    guards: list[Any] = []  # a guard kept alive keeps the worker in inference mode

    def leaky(x: torch.Tensor) -> torch.Tensor:
        guard = torch.inference_mode()
        guard.__enter__()
        guards.append(guard)
        return x * 1

    x = torch.randn(8, 4, requires_grad=True)
    parts = [((part,), {}) for part in x.tensor_split(2)]
    with dbo.UBatchRunner(num_ubatches=2) as runner:  # its own workers: left for good
        runner.run(leaky, parts, timeout_s=TIMEOUT_S)
        outputs = runner.run(lambda t: t * 2, parts, timeout_s=TIMEOUT_S)
    assert len(guards) == 2
    for output in outputs:
        assert not output.is_inference()
        assert output.requires_grad


def test_the_callers_autocast_still_reaches_every_call_after_a_leak() -> None:
    def leaky(x: torch.Tensor) -> torch.Tensor:
        torch.set_autocast_enabled("cpu", True)
        return x * 1

    x = torch.randn(8, 4)
    _overlap(leaky)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _overlap(_innocent)(x).dtype == torch.bfloat16
    assert _overlap(_innocent)(x).dtype == torch.float32


# ------------------------------------------------------- construction code runs once
@dataclasses.dataclass
class NormalizedBatch:
    pixels: torch.Tensor

    def __post_init__(self) -> None:
        self.pixels = self.pixels.float() / 255  # uint8 in, [0, 1] floats kept


@dataclasses.dataclass
class Unsqueezed:
    logits: torch.Tensor

    def __post_init__(self) -> None:
        self.logits = self.logits.unsqueeze(1)  # [B, V] -> [B, 1, V]


@dataclasses.dataclass
class Counted:
    x: torch.Tensor
    rows: int = 0

    def __post_init__(self) -> None:
        self.rows = int(self.x.shape[0])  # derived: must follow the part


class Scaled(collections.namedtuple("Scaled", "a b")):  # noqa: PYI024 - a plain namedtuple base
    def __new__(cls, a: Any, b: Any) -> Scaled:
        return super().__new__(cls, a, b * 10)


def test_an_input_dataclass_whose_post_init_transforms_a_field_is_not_transformed_again() -> None:
    batch = NormalizedBatch(torch.full((4, 3), 255, dtype=torch.uint8))
    out = _overlap(lambda b: b.pixels.sum(dim=1))(batch)
    torch.testing.assert_close(out, torch.full((4,), 3.0), rtol=0, atol=0)


def test_an_output_dataclass_whose_post_init_transforms_a_field_keeps_its_shape() -> None:
    x = torch.randn(4, 5)
    out = _overlap(lambda t: Unsqueezed(t * 1))(x)
    assert isinstance(out, Unsqueezed)
    assert out.logits.shape == (4, 1, 5)
    torch.testing.assert_close(out.logits, x.unsqueeze(1), rtol=0, atol=0)


def test_a_value_post_init_derives_still_follows_each_part() -> None:
    seen: list[int] = []

    def fn(batch: Counted) -> torch.Tensor:
        seen.append(batch.rows)
        return batch.x * 1

    out = _overlap(fn)(Counted(torch.arange(6.0)))
    assert seen == [3, 3]
    torch.testing.assert_close(out, torch.arange(6.0), rtol=0, atol=0)


def test_a_namedtuple_whose_new_transforms_a_field_is_not_transformed_again() -> None:
    x = torch.arange(4.0)
    value = Scaled(x, torch.ones(4))
    out = _overlap(lambda p: p)(value)
    assert type(out) is Scaled
    torch.testing.assert_close(out.b, torch.full((4,), 10.0), rtol=0, atol=0)
    torch.testing.assert_close(out.a, x, rtol=0, atol=0)


class Tagged(collections.namedtuple("Tagged", "x")):  # noqa: PYI024
    def __new__(cls, x: torch.Tensor) -> Tagged:
        self = super().__new__(cls, x)
        self.source = "made"  # an attribute its __new__ sets on the instance
        return self


@dataclasses.dataclass
class NormalizedList:
    parts: list[torch.Tensor]

    def __post_init__(self) -> None:
        self.parts = [part / 255 for part in self.parts]


def test_a_namedtuples_own_new_does_not_run_again_on_split_or_merge() -> None:
    """Running it again on values it already made (once per part, once for the merge)
    divided twice, counted calls, and broke `_replace`, the usual way to pass one on."""
    calls: list[int] = []

    class Counted(collections.namedtuple("Counted", "x n")):  # noqa: PYI024
        def __new__(cls, x: torch.Tensor, n: int = 0) -> Counted:
            calls.append(1)
            return super().__new__(cls, x, int(x.shape[0]))

    value = Counted(torch.arange(5.0))
    calls.clear()
    out = _overlap(lambda b: b._replace(x=b.x + 1))(value)
    assert calls == []
    assert type(out) is Counted
    assert out.n == 5  # passed through unchanged (README: derived values do not follow)
    torch.testing.assert_close(out.x, torch.arange(5.0) + 1, rtol=0, atol=0)


@dataclasses.dataclass
class Features:
    feats: dict[str, Any]

    def __post_init__(self) -> None:
        self.feats = {**self.feats, "rows": int(self.feats["x"].shape[0])}


def test_a_derived_item_next_to_a_tensor_in_a_field_still_follows_each_part() -> None:
    seen: list[int] = []

    def fn(batch: Features) -> torch.Tensor:
        seen.append(batch.feats["rows"])
        return batch.feats["x"] * 1

    out = _overlap(fn)(Features({"x": torch.arange(6.0)}))
    assert seen == [3, 3]
    torch.testing.assert_close(out, torch.arange(6.0), rtol=0, atol=0)


def test_attributes_a_namedtuples_new_sets_survive_the_merge() -> None:
    out = _overlap(lambda t: Tagged(t * 1))(torch.zeros(4))
    assert type(out) is Tagged
    assert out.source == "made"


def test_a_post_init_that_transforms_a_list_of_tensors_is_not_applied_twice() -> None:
    batch = NormalizedList([torch.full((4,), 510.0)])
    out = _overlap(lambda b: b.parts[0] * 1)(batch)
    torch.testing.assert_close(out, torch.full((4,), 2.0), rtol=0, atol=0)


# ------------------------------------------------------------------------ recv hooks
@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_a_hook_registered_by_a_hook_run_for_a_finished_ubatch_still_runs(
    num_ubatches: int,
) -> None:
    ran: list[str] = []

    def second() -> None:
        ran.append("second")

    def first() -> None:
        ran.append("first")
        dbo.register_recv_hook(second)  # a two-stage receive

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == num_ubatches - 1:
            dbo.register_recv_hook(first)  # for ubatch 0, which has already returned
        return x

    _overlap(fn, num_ubatches=num_ubatches)(torch.zeros(num_ubatches))
    assert ran == ["first", "second"]


# ---------------------------------------------------- refused wrongly, or refused late
class ElementwiseEqual:
    """Like a numpy array: `==` is elementwise, and its truth value is ambiguous."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.shape = (len(values),)

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, ElementwiseEqual):
            return NotImplemented
        return _Elementwise([a == b for a, b in zip(self.values, other.values)])

    __hash__ = None  # type: ignore[assignment]


class _Elementwise:
    def __init__(self, flags: list[bool]) -> None:
        self.flags = flags

    def __bool__(self) -> bool:
        raise ValueError("the truth value of an array with more than one element is ambiguous")

    def all(self) -> bool:
        return all(self.flags)


def test_equal_array_like_leaves_from_every_ubatch_merge_as_one_value() -> None:
    out = _overlap(lambda t: (t * 1, ElementwiseEqual([0, 1, 2])))(torch.zeros(4))
    assert out[1].values == [0, 1, 2]


def test_array_like_leaves_that_differ_are_still_refused() -> None:
    def fn(t: torch.Tensor) -> Any:
        return t * 1, ElementwiseEqual([dbo.current_ubatch_id(), 1])

    with pytest.raises(ValueError, match="different non-tensor values"):
        _overlap(fn)(torch.zeros(4))


class NamedBatch(collections.OrderedDict):  # type: ignore[type-arg]
    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name


def test_a_dict_subclass_whose_init_needs_an_argument_is_split_and_merged() -> None:
    x = torch.arange(8.0).reshape(4, 2)

    def fn(batch: NamedBatch) -> NamedBatch:
        return NamedBatch(batch.name, y=batch["x"] * 2)

    out = _overlap(fn)(NamedBatch("batch", x=x))
    assert type(out) is NamedBatch
    assert out.name == "batch"
    torch.testing.assert_close(out["y"], x * 2, rtol=0, atol=0)


async def _coroutine_function(x: torch.Tensor) -> torch.Tensor:
    return x


def _generator_function(x: torch.Tensor) -> Any:
    yield x


@pytest.mark.parametrize("fn", [_coroutine_function, _generator_function])
def test_a_coroutine_or_generator_function_is_refused_when_wrapped(fn: Any) -> None:
    with pytest.raises(TypeError, match="coroutine or generator function"):
        dbo.overlap(fn)


# ------------------------------------------------- what a failed call's error keeps
class _Held:
    pass


def test_callbacks_an_aborted_ubatch_left_are_freed_while_the_error_is_kept() -> None:
    """The error's traceback holds the runner's frame, and that frame the run: its exit
    callbacks and recv hooks, which never run once their ubatch was aborted, kept what
    they hold alive as long as the error (an uncaught one: until interpreter exit)."""
    import gc
    import weakref

    refs: list[weakref.ref[_Held]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        held, other = _Held(), _Held()
        refs.extend([weakref.ref(held), weakref.ref(other)])
        dbo.at_ubatch_exit(functools.partial(id, held))
        dbo.register_recv_hook(functools.partial(id, other))
        del held, other
        dbo.yield_()  # aborted here: neither runs
        return x

    gc.disable()  # reference counting alone must free them
    try:
        try:
            _overlap(fn)(torch.zeros(2))
        except ValueError as error:
            failure = error
        assert "ubatch 1 fails" in str(failure)
        assert len(refs) == 2
        assert all(ref() is None for ref in refs)
        del failure
    finally:
        gc.enable()


def test_a_hook_that_keeps_registering_itself_for_a_finished_ubatch_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poller that never stops, for a ubatch that has returned: it spun until the
    watchdog fired (or for good without one). Polling is bounded in time."""
    from dbo import _run

    monkeypatch.setattr(_run, "_HOOK_POLL_LIMIT_S", 0.2)
    runs: list[int] = []

    def poll() -> None:
        runs.append(1)
        dbo.register_recv_hook(poll)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            dbo.register_recv_hook(poll)  # for ubatch 0, which has already returned
        return x

    with pytest.raises(RuntimeError, match="kept registering new hooks"):
        _overlap(fn)(torch.zeros(2))
    assert len(runs) > 1
    assert _overlap(lambda t: t + 1)(torch.zeros(2)).tolist() == [1.0, 1.0]  # usable


def test_a_hook_that_polls_until_its_receive_completes_finishes() -> None:
    done = threading.Event()
    threading.Timer(0.02, done.set).start()  # the receive completes a little later
    polls: list[int] = []

    def poll() -> None:
        polls.append(1)
        if not done.is_set():
            dbo.register_recv_hook(poll)

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            dbo.register_recv_hook(poll)
        return x

    _overlap(fn)(torch.zeros(2))
    assert done.is_set() and len(polls) > 1


# ------------------------------------------ torch-function / dispatch modes (tenth session)
def _mutates_a_saved_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a.clone()
    out = b**2  # saves b
    b.sin_()  # allowed under allow_mutation_on_saved_tensors: it clones b first
    return out


@pytest.mark.timeout(30)
def test_allow_mutation_on_saved_tensors_around_an_overlap_gives_the_right_gradient() -> None:
    """The context is saved-tensor hooks (replayed in the workers) plus a dispatch mode
    that clones before a mutation (not replayable: modes keep per-entry state). With
    only the hooks, a mutated saved tensor gave a silently wrong gradient; a call under
    a mode now runs inline, like one under a torch.func transform."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        dbo.overlap(_mutates_a_saved_tensor, timeout_s=10)(a).sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach())


@pytest.mark.timeout(30)
def test_a_dispatch_mode_around_an_overlap_sees_the_ops_of_fn() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    weight = torch.ones(3, 3)
    with Recording() as recording:
        dbo.overlap(lambda x: torch.mm(x, weight), timeout_s=10)(torch.ones(4, 3))
    assert any("mm" in op for op in recording.ops), recording.ops


@pytest.mark.timeout(30)
def test_a_fake_tensor_mode_around_an_overlap_covers_the_tensors_fn_creates() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(4, 3))
        out = dbo.overlap(lambda t: t + torch.ones(3), timeout_s=10)(x)
    assert tuple(out.shape) == (4, 3)


@pytest.mark.timeout(30)
def test_the_default_device_context_still_overlaps() -> None:
    """`with torch.device(...)` is a torch-function mode too, but the workers replay it."""
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(dbo.enabled())
        return x

    with torch.device("cpu"):
        dbo.overlap(fn, timeout_s=10)(torch.zeros(4))
    assert seen == [True, True]


@pytest.mark.timeout(30)
def test_a_mode_fn_entered_and_never_exited_does_not_reach_the_next_call() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class RefuseMul(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.mul.Tensor:
                raise RuntimeError("a mode left behind by an earlier call intercepted mul")
            return func(*args, **(kwargs or {}))

    def leaky(x: torch.Tensor) -> torch.Tensor:
        RefuseMul().__enter__()  # never exited
        return x + 1

    x = torch.zeros(4)
    dbo.overlap(leaky, timeout_s=10)(x)
    assert torch.equal(dbo.overlap(lambda t: t * 2, timeout_s=10)(x), x * 2)
    depths: list[int] = []
    dbo.overlap(lambda t: (depths.append(torch._C._len_torch_dispatch_stack()), t)[1])(x)
    assert depths == [0, 0]
