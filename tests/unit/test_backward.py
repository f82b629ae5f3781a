"""The backward of an overlapped call: each ubatch's in its ubatch thread, gradients as
if the ubatches had run in turn (`dbo/backward.py`)."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dbo


class _Model(torch.nn.Module):
    """Two linears with a yield between them; `pre` is an upstream layer, not overlapped."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.pre = torch.nn.Linear(8, 8)
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 8)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / 3)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        dbo.yield_()
        return self.second(h) + x


def _in_turn(fn: Callable[..., Any], num_ubatches: int = 2) -> Callable[..., Any]:
    """The same ubatches one after the other in this thread: the reference."""
    return lambda x: torch.cat([fn(part) for part in x.tensor_split(num_ubatches)])


def _grads(model: _Model, x: torch.Tensor, step: Callable[..., Any]) -> list[torch.Tensor]:
    """Gradients of x and of every parameter after one step through `pre` and `step`."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    (step(model.pre(x)) ** 2).sum().backward()
    assert x.grad is not None
    return [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]


def _x(rows: int = 10) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_two_ubatches_give_the_gradients_of_the_same_ubatches_in_turn_bitwise() -> None:
    model, x = _Model(), _x()
    got = _grads(model, x, dbo.overlap(model.block, timeout_s=30))
    want = _grads(model, x, _in_turn(model.block))
    assert _bitwise(got, want)


def test_each_ubatch_backward_runs_in_its_ubatch_thread_with_its_id() -> None:
    model, x = _Model(), _x()
    seen: list[tuple[int, bool, str]] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        h = model.block(x)
        h.register_hook(lambda grad: seen.append(
            (dbo.current_ubatch_id(), dbo.enabled(), threading.current_thread().name)
        ))
        return h

    _grads(model, x, dbo.overlap(block, timeout_s=30))
    assert sorted(ubatch for ubatch, _, _ in seen) == [0, 1]
    assert all(enabled for _, enabled, _ in seen)
    assert all(name.startswith("dbo-ubatch-") for _, _, name in seen), seen


class _YieldInBackward(torch.autograd.Function):
    """Identity whose backward notes its ubatch, yields, and notes it again."""

    log: list[tuple[int, str]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _YieldInBackward.log.append((dbo.current_ubatch_id(), ctx.label + " before"))
        dbo.yield_()
        _YieldInBackward.log.append((dbo.current_ubatch_id(), ctx.label + " after"))
        return grad, None


def test_the_baton_passes_at_the_yield_points_of_the_backward() -> None:
    model, x = _Model(), _x()
    _YieldInBackward.log = []

    def block(x: torch.Tensor) -> torch.Tensor:
        return _YieldInBackward.apply(model.block(x), "b")

    _grads(model, x, dbo.overlap(block, timeout_s=30))
    # ubatch 0 yields in its backward, ubatch 1 runs to its yield, then each goes on.
    assert _YieldInBackward.log == [(0, "b before"), (1, "b before"), (0, "b after"),
                                    (1, "b after")]


def test_overlap_backward_false_runs_the_backward_whole_in_the_callers_thread() -> None:
    model, x = _Model(), _x()
    seen: list[tuple[bool, str]] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        h = model.block(x)
        h.register_hook(lambda grad: seen.append((dbo.enabled(), threading.current_thread().name)))
        return h

    got = _grads(model, x, dbo.overlap(block, overlap_backward=False, timeout_s=30))
    assert seen == [(False, threading.current_thread().name)] * 2
    assert _bitwise(got, _grads(model, x, _in_turn(model.block)))


def test_retain_graph_and_a_second_backward_accumulate_as_in_turn() -> None:
    model, x = _Model(), _x()

    def twice(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = (step(model.pre(x)) ** 2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    got = twice(dbo.overlap(model.block, timeout_s=30))
    want = twice(_in_turn(model.block))
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    loss = (dbo.overlap(model.block, timeout_s=30)(model.pre(x)) ** 2).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()


def test_autograd_grad_returns_the_in_turn_gradients_and_accumulates_nothing() -> None:
    model, x = _Model(), _x()
    model.zero_grad(set_to_none=True)
    wrt = [x, model.first.weight, model.second.bias]

    def grads(step: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad((step(model.pre(x)) ** 2).sum(), wrt)

    got = grads(dbo.overlap(model.block, timeout_s=30))
    assert all(p.grad is None for p in model.parameters())
    assert _bitwise(list(got), list(grads(_in_turn(model.block))))


def test_a_loss_from_part_of_the_outputs() -> None:
    model, x = _Model(), _x()

    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model.block(x), torch.sigmoid(x)  # the second output is never used

    def grads(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(step(model.pre(x))[0][:3].sum())  # ubatch 0's rows only
        return [p.grad.clone() for p in model.parameters()]

    def in_turn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = [pair(part) for part in x.tensor_split(2)]
        return torch.cat([a for a, _ in outputs]), torch.cat([b for _, b in outputs])

    assert _bitwise(grads(dbo.overlap(pair, timeout_s=30)), grads(in_turn))


def test_gradients_accumulated_over_two_calls_are_close_and_the_same_every_run() -> None:
    model, x = _Model(), _x()

    def two_calls(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = (step(model.pre(x)) ** 2).sum() + step(model.pre(x) * 2).sum()
        loss.backward()
        (step(model.pre(x)) ** 2).sum().backward()  # and one more step's, accumulated
        return [p.grad.clone() for p in model.parameters()]

    first = two_calls(dbo.overlap(model.block, timeout_s=30))
    assert _bitwise(first, two_calls(dbo.overlap(model.block, timeout_s=30)))
    want = two_calls(_in_turn(model.block))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first, want))


@pytest.mark.parametrize("num_ubatches", [3, 4])
def test_more_ubatches_give_close_gradients_with_the_same_bits_every_run(
    num_ubatches: int,
) -> None:
    model, x = _Model(), _x(11)
    step = dbo.overlap(model.block, num_ubatches=num_ubatches, timeout_s=30)
    first = _grads(model, x, step)
    assert _bitwise(first, _grads(model, x, step))
    want = _grads(model, x, _in_turn(model.block, num_ubatches))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first, want))


def test_checkpointing_inside_the_function_gives_the_in_turn_gradients() -> None:
    from torch.utils.checkpoint import checkpoint

    model, x = _Model(), _x()

    def block(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(model.block, x, use_reentrant=False)

    got = _grads(model, x, dbo.overlap(block, timeout_s=30))
    assert _bitwise(got, _grads(model, x, _in_turn(block)))


def test_reentrant_checkpointing_inside_the_function_is_refused_naming_both_ways_out() -> None:
    """Its backward refuses torch.autograd.grad, which each ubatch's backward is: refused
    at the forward, naming use_reentrant=False and overlap_backward=False, which work."""
    from torch.utils.checkpoint import checkpoint

    model, x = _Model(), _x()

    def block(x: torch.Tensor, use_reentrant: bool = True) -> torch.Tensor:
        return checkpoint(model.block, x, use_reentrant=use_reentrant)

    with pytest.raises(ValueError, match=r"use_reentrant=True.*use_reentrant=False.*"
                                         r"overlap_backward=False"):
        dbo.overlap(block, timeout_s=30)(model.pre(x))
    want = _grads(model, x, _in_turn(block))
    assert _bitwise(_grads(model, x, dbo.overlap(block, overlap_backward=False)), want)
    non_reentrant = functools.partial(block, use_reentrant=False)
    assert _bitwise(_grads(model, x, dbo.overlap(non_reentrant, timeout_s=30)), want)
    with torch.no_grad():  # no graph, no backward to refuse
        torch.testing.assert_close(dbo.overlap(block)(x), block(x))


def test_reentrant_checkpointing_around_an_overlap_gives_the_same_gradients() -> None:
    """Its forward runs without grad (nothing to overlap backward) and its backward reruns
    the call under grad mode inside autograd's backward: the ubatches' backward runs there."""
    from torch.utils.checkpoint import checkpoint

    model, x = _Model(), _x()
    step = dbo.overlap(model.block, timeout_s=30)
    want = _grads(model, x, _in_turn(model.block))
    got = _grads(model, x, lambda h: checkpoint(step, h, use_reentrant=True))
    assert _bitwise(got, want)


def test_an_argument_passed_whole_gets_the_sum_of_the_ubatches_gradients() -> None:
    model, x = _Model(), _x()
    scale = torch.full((8,), 0.5, requires_grad=True)

    def block(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return model.block(x * scale)

    def grads(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        scale.grad = None
        (step(model.pre(x), scale) ** 2).sum().backward()
        return [scale.grad.clone(), *(p.grad.clone() for p in model.parameters())]

    def in_turn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.cat([block(part, scale) for part in x.tensor_split(2)])

    got = grads(dbo.overlap(block, no_split="scale", timeout_s=30))
    assert _bitwise(got, grads(in_turn))


def test_create_graph_is_refused_naming_the_option_that_allows_it() -> None:
    model, x = _Model(), _x()
    y = dbo.overlap(model.block, timeout_s=30)(model.pre(x))
    with pytest.raises(RuntimeError, match="overlap_backward=False"):
        torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    whole = dbo.overlap(model.block, overlap_backward=False, timeout_s=30)
    (grad,) = torch.autograd.grad(whole(model.pre(x)).pow(2).sum(), x, create_graph=True)
    grad.sum().backward()  # a second order, through the whole backward
    assert model.first.weight.grad is not None


def test_a_tensor_from_before_the_call_used_inside_it_gets_the_in_turn_gradients() -> None:
    """The ubatches' graphs meet at `offset`'s: its backward runs once, on the sum of the
    gradients the ubatches' backwards bring to it, as autograd's own does."""
    model, x = _Model(), _x()

    def with_offset(step: Callable[..., Any]) -> Callable[..., Any]:
        def call(x: torch.Tensor) -> torch.Tensor:
            offset = model.pre(torch.ones(1, 8))  # requires grad, computed before the call
            return step(lambda x: model.block(x + offset))(x)
        return call

    want = _grads(model, x, with_offset(_in_turn))
    assert _bitwise(_grads(model, x, with_offset(lambda fn: dbo.overlap(fn, timeout_s=30))), want)
    whole = with_offset(lambda fn: dbo.overlap(fn, overlap_backward=False, timeout_s=30))
    assert _bitwise(_grads(model, x, whole), want)


class _FailInBackward(torch.autograd.Function):
    fail_in: int | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == _FailInBackward.fail_in:
            raise KeyError("boom in backward")
        return grad


def test_a_failing_ubatch_backward_reaches_the_caller_and_the_next_step_is_right() -> None:
    model, x = _Model(), _x()

    def block(x: torch.Tensor) -> torch.Tensor:
        return _FailInBackward.apply(model.block(x))

    step = dbo.overlap(block, timeout_s=30)
    _FailInBackward.fail_in = 1
    try:
        with pytest.raises(KeyError, match="boom in backward") as failure:
            _grads(model, x, step)
    finally:
        _FailInBackward.fail_in = None
    assert getattr(failure.value, "ubatch_id", None) == 1
    assert dbo.runtime.context.num_registered_threads() == 0
    assert _bitwise(_grads(model, x, step), _grads(model, x, _in_turn(block)))


def test_the_watchdog_covers_the_backward() -> None:
    model, x = _Model(), _x()

    def block(x: torch.Tensor) -> torch.Tensor:
        h = model.block(x)
        if dbo.current_ubatch_id() == 0:
            h.register_hook(lambda grad: time.sleep(1.0))
        return h

    with pytest.raises(dbo.OverlapTimeoutError) as failure:
        _grads(model, x, dbo.overlap(block, timeout_s=0.3))
    assert failure.value.ubatch_id == 0
    time.sleep(1.0)  # the sleeping hook returns; the next step's runner is fresh or idle
    assert _bitwise(
        _grads(model, x, dbo.overlap(model.block, timeout_s=30)),
        _grads(model, x, _in_turn(model.block)),
    )


class _Saves(torch.autograd.Function):
    """Identity that saves a tensor for backward, which the test watches."""

    saved: list[weakref.ref[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        kept = x * 2
        _Saves.saved.append(weakref.ref(kept))
        ctx.save_for_backward(kept)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (kept,) = ctx.saved_tensors
        return grad + 0 * kept


@pytest.mark.parametrize("graphs", ["apart", "meeting", "meeting-and-apart"])
def test_the_ubatches_saved_tensors_are_freed_by_the_backward_while_the_output_lives(
    graphs: str,
) -> None:
    model, x = _Model(), _x()
    _Saves.saved = []
    offset = {
        "apart": lambda: torch.zeros(1, 8),
        "meeting": lambda: model.pre(torch.ones(1, 8)),
        "meeting-and-apart": lambda: model.second(torch.ones(1, 16)),  # block uses it too
    }[graphs]()
    y = dbo.overlap(lambda x: _Saves.apply(model.block(x + offset)), timeout_s=30)(model.pre(x))
    assert len(_Saves.saved) == 2 and all(ref() is not None for ref in _Saves.saved)
    y.sum().backward()
    gc.collect()
    assert all(ref() is None for ref in _Saves.saved)  # y is alive: autograd frees them anyway
    del y


def test_no_grad_mode_builds_no_backward() -> None:
    model, x = _Model(), _x()
    with torch.no_grad():
        y = dbo.overlap(model.block, timeout_s=30)(x)
    assert not y.requires_grad and y.grad_fn is None


def test_overlap_backward_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="overlap_backward"):
        dbo.overlap(lambda x: x, overlap_backward="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_hugging_face_model_trains_as_in_turn(checkpointing: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).train()
    if checkpointing:  # transformers' own: torch.utils.checkpoint around each layer
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))

    def grads(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (step(ids).logits.float() ** 2).mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def in_turn(ids: torch.Tensor) -> Any:
        return dbo.default_merge([model(part) for part in ids.tensor_split(2)])

    got = grads(dbo.overlap(model, timeout_s=30))
    want = grads(in_turn)
    assert len(got) == len(want) > 10 and _bitwise(got, want)


def test_a_parameter_used_twice_per_ubatch_gets_close_gradients_the_same_every_run() -> None:
    """Tied weights: autograd sums the four uses of one parameter in its own order over
    both ubatches; the overlapped backward sums each ubatch's two first."""
    model, x = _Model(), _x()

    def tied(x: torch.Tensor) -> torch.Tensor:
        h = model.block(x)
        return model.block(torch.tanh(h))  # every parameter twice

    first = _grads(model, x, dbo.overlap(tied, timeout_s=30))
    assert _bitwise(first, _grads(model, x, dbo.overlap(tied, timeout_s=30)))
    want = _grads(model, x, _in_turn(tied))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first, want))


def test_a_parameter_only_one_ubatch_uses_gets_that_ubatchs_gradient() -> None:
    model, x = _Model(), _x()

    def one_sided(x: torch.Tensor) -> torch.Tensor:
        h = model.block(x)
        return model.pre(h) if dbo.current_ubatch_id() == 1 or not dbo.enabled() else h

    def in_turn(x: torch.Tensor) -> torch.Tensor:
        first, second = x.tensor_split(2)
        return torch.cat([model.block(first), model.pre(model.block(second))])

    got = _grads(model, x, dbo.overlap(one_sided, timeout_s=30))
    assert _bitwise(got, _grads(model, x, in_turn))


def test_training_under_autocast_gives_close_gradients_the_same_every_run() -> None:
    model, x = _Model(), _x()

    def grads(step: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = step(model.pre(x))
        assert y.dtype == torch.bfloat16  # the ubatches ran under the caller's autocast
        (y.float() ** 2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    # Autocast caches each weight's cast for both ubatches: their graphs meet there.
    got = grads(dbo.overlap(model.block, timeout_s=30))
    assert _bitwise(got, grads(dbo.overlap(model.block, timeout_s=30)))
    want = grads(_in_turn(model.block))
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(got, want))


def test_a_parameter_used_before_the_call_and_inside_it_gets_close_gradients() -> None:
    """`offset` comes from `second`, which the block uses too: each ubatch's backward runs
    `offset`'s part itself (autograd sums the same terms in another order)."""
    model, x = _Model(), _x()

    def with_offset(step: Callable[..., Any]) -> Callable[..., Any]:
        def call(x: torch.Tensor) -> torch.Tensor:
            offset = model.second(torch.ones(1, 16))
            return step(lambda x: model.block(x + offset))(x)
        return call

    overlapped = with_offset(lambda fn: dbo.overlap(fn, timeout_s=30))
    first = _grads(model, x, overlapped)
    assert _bitwise(first, _grads(model, x, overlapped))  # the same bits every run
    want = _grads(model, x, with_offset(_in_turn))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first, want))


def test_post_accumulate_grad_hooks_run_once_on_the_summed_gradient() -> None:
    """An optimizer step in the backward (`register_post_accumulate_grad_hook`) steps each
    parameter once, with the gradient the same ubatches in turn give it."""
    def trained(step: Callable[..., Any]) -> tuple[list[torch.Tensor], list[int]]:
        model, x = _Model(), _x()
        calls = [0]

        def sgd(parameter: torch.Tensor) -> None:
            calls[0] += 1
            with torch.no_grad():
                parameter -= 0.1 * parameter.grad
            parameter.grad = None

        handles = [p.register_post_accumulate_grad_hook(sgd) for p in model.parameters()]
        (step(model)(model.pre(x)) ** 2).sum().backward()
        for handle in handles:
            handle.remove()
        return [p.detach().clone() for p in model.parameters()], calls

    got, got_calls = trained(lambda model: dbo.overlap(model.block, timeout_s=30))
    want, want_calls = trained(lambda model: _in_turn(model.block))
    assert got_calls == want_calls == [len(got)]
    assert _bitwise(got, want)


def test_a_tensor_hook_on_a_parameter_is_refused_naming_it_and_the_way_out() -> None:
    """autograd runs a parameter's `register_hook` hook once, on the gradient summed over
    the ubatches; each ubatch's backward would run it on its share first."""
    model, x = _Model(), _x()
    seen: list[torch.Tensor] = []
    model.first.weight.register_hook(lambda grad: seen.append(grad))
    out = dbo.overlap(model.block, timeout_s=30)(model.pre(x))
    refused = r"torch.Size\(\[16, 8\]\).*register_hook.*overlap_backward=False"
    with pytest.raises(ValueError, match=refused):
        out.sum().backward()
    assert seen == []
    seen.clear()
    model.zero_grad(set_to_none=True)
    dbo.overlap(model.block, timeout_s=30, overlap_backward=False)(model.pre(x)).sum().backward()
    assert len(seen) == 1 and model.first.weight.grad is not None
