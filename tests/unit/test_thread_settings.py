"""The caller's thread-local torch settings reach the ubatch threads; what `fn` leaves
switched on in a pooled worker does not reach the next call; a call under a torch mode
the workers cannot share runs inline."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import pytest
import torch

import dbo

TIMEOUT_S = 30.0


def _overlap(fn: Any, **options: Any) -> Any:
    return dbo.overlap(fn, timeout_s=TIMEOUT_S, **options)


def _innocent(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.eye(x.shape[1])


# ------------------------------------------------------------ replayed in the workers


@pytest.mark.parametrize("how", ["with torch.device", "torch.set_default_device"])
def test_default_device_context_is_replayed_in_workers(how: str) -> None:
    """A default device (a thread-local TorchFunctionMode) is replayed: factory calls
    inside fn land on the device they land on inline; none is left behind."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0])  # no explicit device: follows the default device

    x = torch.zeros(4)
    with torch.device("meta") if how == "with torch.device" else contextlib.nullcontext():
        if how == "torch.set_default_device":
            torch.set_default_device("meta")
        try:
            inline = fn(x)
            overlapped = dbo.overlap(fn)(x)
        finally:
            torch.set_default_device(None)
    assert inline.device.type == "meta"
    assert overlapped.device.type == inline.device.type
    assert dbo.overlap(fn)(x).device.type == "cpu"


def test_the_callers_autocast_still_reaches_every_call_after_a_leak() -> None:
    def leaky(x: torch.Tensor) -> torch.Tensor:
        torch.set_autocast_enabled("cpu", True)
        return x * 1

    x = torch.randn(8, 4)
    _overlap(leaky)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _overlap(_innocent)(x).dtype == torch.bfloat16
    assert _overlap(_innocent)(x).dtype == torch.float32


@pytest.mark.parametrize(
    "device_type",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="torch.autocast refuses cuda without CUDA"
    ))],
)
def test_the_callers_autocast_reaches_the_ubatches(device_type: str) -> None:
    """With its dtype and cache flag."""
    if device_type == "cuda":
        torch.cuda.init()
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    seen: list[tuple[bool, torch.dtype, bool]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((
            torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        ))
        return x

    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, torch.float16)
    try:
        cache = torch.is_autocast_cache_enabled()
        _overlap(fn)(torch.zeros(4))
    finally:
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])
    assert seen == [(True, torch.float16, cache)] * 2
    _overlap(fn)(torch.zeros(4))
    assert [enabled for enabled, _, _ in seen[2:]] == [before[0]] * 2


# ------------------------------------------------------ nothing left to the next call


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


# -------------------------------------------------------- modes: the call runs inline


def _mutates_a_saved_tensor(a: torch.Tensor) -> torch.Tensor:
    b = a.clone()
    out = b**2  # saves b
    b.sin_()  # allowed under allow_mutation_on_saved_tensors: it clones b first
    return out


@pytest.mark.timeout(30)
def test_allow_mutation_on_saved_tensors_around_an_overlap_gives_the_right_gradient() -> None:
    """The context is saved-tensor hooks plus a dispatch mode that clones before a
    mutation; under a mode the call runs inline, and the gradient is right."""
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


_USER_SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("dbo_test_setting",
                                                                   default="default")


def test_the_callers_context_variables_reach_the_ubatches_and_fn_s_do_not_leak() -> None:
    """A ContextVar the caller set is what each ubatch reads (and its backward); what `fn`
    sets stays in its ubatch, for that call only."""
    seen: list[tuple[int, str]] = []

    class Note(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append((dbo.current_ubatch_id(), "backward " + _USER_SETTING.get()))
            return grad

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((dbo.current_ubatch_id(), _USER_SETTING.get()))
        _USER_SETTING.set(f"set by ubatch {dbo.current_ubatch_id()}")
        dbo.yield_()
        seen.append((dbo.current_ubatch_id(), _USER_SETTING.get()))
        return Note.apply(x)

    token = _USER_SETTING.set("the caller's")
    try:
        x = torch.ones(4, 2, requires_grad=True)
        _overlap(fn)(x).sum().backward()
        assert _USER_SETTING.get() == "the caller's"
        _USER_SETTING.set("changed")
        _overlap(fn)(torch.ones(4, 2))
    finally:
        _USER_SETTING.reset(token)
    assert seen == [
        (0, "the caller's"), (1, "the caller's"),
        (0, "set by ubatch 0"), (1, "set by ubatch 1"),
        (0, "backward the caller's"), (1, "backward the caller's"),
        (0, "changed"), (1, "changed"), (0, "set by ubatch 0"), (1, "set by ubatch 1"),
    ], seen


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "recompile_limit"),
                    reason="this torch names the limit otherwise")
def test_the_callers_dynamo_configuration_reaches_the_ubatches() -> None:
    """torch 2.12 keeps dynamo's configuration in a ContextVar: a new thread would start
    from the defaults (recompile_limit 8)."""
    import torch._dynamo.config as dynamo_config

    seen = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((dynamo_config.recompile_limit, dynamo_config.capture_scalar_outputs))
        return x

    with dynamo_config.patch(recompile_limit=3, capture_scalar_outputs=True):
        _overlap(fn)(torch.ones(4, 2))
    assert seen == [(3, True), (3, True)]
