"""dbo.overlap: baton ring, bitwise equality, registration, failure, watchdog, nesting, leaks."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from torch.utils import _pytree as pytree

import dbo
from dbo.runtime.context import num_registered_threads


def layered(x: torch.Tensor, weight: torch.Tensor, num_layers: int = 4) -> torch.Tensor:
    """A small 'model' that yields between its layers, like a DBO-ready forward."""
    for _ in range(num_layers):
        x = torch.tanh(x @ weight)
        dbo.yield_()
    return x


# ---------------------------------------------------------------- 1. baton ring
def test_baton_ring_order_is_round_robin_and_exclusive() -> None:
    events: list[tuple[int, int]] = []
    active: list[int | None] = [None]
    overlapped_segments: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        for step in range(5):
            active[0] = me
            events.append((me, step))
            time.sleep(0.001)  # releases the GIL: another running ubatch would show up
            if active[0] != me:
                overlapped_segments.append(f"ubatch {active[0]} ran during ubatch {me}")
            dbo.yield_()
        return x

    dbo.overlap(fn)(torch.zeros(4))
    assert overlapped_segments == []
    assert events == [(u, s) for s in range(5) for u in (0, 1)]


def test_finished_ubatches_are_skipped_in_the_ring() -> None:
    events: list[tuple[int, int]] = []
    yields = {0: 1, 1: 4, 2: 2}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        for step in range(yields[me] + 1):
            events.append((me, step))
            if step < yields[me]:
                dbo.yield_()
        return x

    dbo.overlap(fn, num_ubatches=3)(torch.zeros(3))
    assert events == [
        (0, 0), (1, 0), (2, 0),
        (0, 1), (1, 1), (2, 1),
        (1, 2), (2, 2),
        (1, 3),
        (1, 4),
    ]  # fmt: skip


def test_order_is_deterministic_across_runs() -> None:
    def fn(x: torch.Tensor, log: list[int]) -> torch.Tensor:
        for _ in range(3 + dbo.current_ubatch_id()):
            log.append(dbo.current_ubatch_id())
            dbo.yield_()
        return x

    logs = []
    for _ in range(20):
        log: list[int] = []
        dbo.overlap(fn, num_ubatches=3)(torch.zeros(6), log)
        logs.append(log)
    assert all(log == logs[0] for log in logs)


# ---------------------------------------------------------------- 2. bitwise equality
@pytest.mark.parametrize("num_ubatches", [2, 3, 4])
@pytest.mark.parametrize("batch", [7, 9, 13])
def test_overlap_is_bitwise_equal_to_serial_parts(num_ubatches: int, batch: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(16, 16) / 4
    x = torch.randn(batch, 16)
    expected = torch.cat([layered(p, weight) for p in torch.tensor_split(x, num_ubatches)])
    got = dbo.overlap(functools.partial(layered, weight=weight), num_ubatches=num_ubatches)(x)
    assert torch.equal(got, expected)


def test_module_and_decorator_forms() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(6, 8)
    expected = torch.cat([model(p) for p in torch.tensor_split(x, 2)])
    assert torch.equal(dbo.overlap(model)(x), expected)

    @dbo.overlap
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * dbo.num_ubatches()

    @dbo.overlap(num_ubatches=3)
    def three(x: torch.Tensor) -> torch.Tensor:
        return x * dbo.num_ubatches()

    assert torch.equal(plain(torch.ones(4)), torch.full((4,), 2.0))
    assert torch.equal(three(torch.ones(4)), torch.full((4,), 3.0))
    assert plain.__name__ == "plain"

    class Layer:
        def __init__(self) -> None:
            self.scale = 5.0

        @dbo.overlap
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + dbo.current_ubatch_id()

    assert torch.equal(Layer().forward(torch.zeros(4)), torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_the_wrapper_keeps_the_functions_signature_and_shows_its_options() -> None:
    import inspect

    def step(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        """Scale x."""
        return x * scale

    wrapped = dbo.overlap(step, num_ubatches=3, timeout_s=5)
    assert inspect.signature(wrapped) == inspect.signature(step)
    assert wrapped.__doc__ == "Scale x." and wrapped.__wrapped__ is step
    options = wrapped.options  # type: ignore[attr-defined]
    assert (options.num_ubatches, options.timeout_s, options.overlap_backward) == (3, 5.0, True)
    assert "step" in repr(wrapped)


# ---------------------------------------------------------------- 3. registration
def test_ubatch_id_registration_lasts_exactly_the_run() -> None:
    seen: dict[int, tuple[int, bool, int, int]] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        seen[me] = (threading.get_ident(), dbo.enabled(), dbo.num_ubatches(), x.shape[0])
        dbo.yield_()
        counts.append(num_registered_threads())
        return x

    counts: list[int] = []
    assert num_registered_threads() == 0
    dbo.overlap(fn, num_ubatches=3)(torch.zeros(7))
    assert num_registered_threads() == 0
    assert counts == [3, 2, 1]  # each thread deregisters when its ubatch ends
    assert sorted(seen) == [0, 1, 2]
    assert len({ident for ident, *_ in seen.values()}) == 3
    assert threading.get_ident() not in {ident for ident, *_ in seen.values()}
    assert all(enabled and n == 3 for _, enabled, n, _ in seen.values())
    assert [seen[i][3] for i in range(3)] == [3, 2, 2]
    assert (dbo.current_ubatch_id(), dbo.enabled(), dbo.num_ubatches()) == (0, False, 1)


def test_workspace_slots_follow_real_overlaps() -> None:
    import workspace

    manager = workspace.WorkspaceManager("cpu", num_ubatches=2)
    failures: list[str] = []
    pointers: dict[int, int] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id()
        for step in range(4):
            # ubatch 0 asks for more and more; ubatch 1 stays small: grow together.
            numel = 64 * (step + 1) if me == 0 else 16
            (view,) = manager.get_simultaneous(((numel,), torch.int64))
            view.fill_(me * 1000 + step)
            pointers[me] = view.data_ptr()
            dbo.yield_()
            if not torch.all(view == me * 1000 + step):
                failures.append(f"ubatch {me} step {step}: its view was overwritten")
        return x

    dbo.overlap(fn)(torch.zeros(4))
    assert failures == []
    assert pointers[0] != pointers[1]
    stats = manager.stats()
    assert stats.capacity_bytes == 64 * 4 * 8
    assert stats.realized_bytes_per_slot == (stats.capacity_bytes, stats.capacity_bytes)


# ---------------------------------------------------------------- 4. failure
class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["before_first_yield", "middle", "after_last_yield"])
@pytest.mark.parametrize("num_ubatches,failing", [(2, 0), (2, 1), (3, 1), (3, 2)])
def test_failure_reraises_and_aborts_the_others(
    where: str, num_ubatches: int, failing: int
) -> None:
    started: list[int] = []
    completed: list[int] = []
    cleaned_up: list[int] = []
    aborted: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        me = dbo.current_ubatch_id() if x.sum() == 0 else -1  # only all-zero inputs fail
        started.append(me)
        try:
            if me == failing and where == "before_first_yield":
                raise Boom(f"from {me}")
            for step in range(3):
                dbo.yield_()
                if me == failing and where == "middle" and step == 1:
                    raise Boom(f"from {me}")
            if me == failing and where == "after_last_yield":
                raise Boom(f"from {me}")
            completed.append(me)
            return x
        except dbo.UBatchAbortedError:
            aborted.append(me)
            raise
        finally:
            cleaned_up.append(me)

    wrapped = dbo.overlap(fn, num_ubatches=num_ubatches, timeout_s=10)
    with pytest.raises(Boom) as info:
        wrapped(torch.zeros(6))
    assert f"ubatch {failing} of {num_ubatches}" in "\n".join(info.value.__notes__)
    assert getattr(info.value, "ubatch_id", None) == failing
    # Every ubatch that started ran its finally; one that had not started never runs fn.
    assert sorted(cleaned_up) == sorted(started)
    assert failing in started and failing not in aborted
    # The others either had finished already or were aborted at a yield point.
    assert sorted(aborted + completed) == sorted(set(started) - {failing})
    assert num_registered_threads() == 0
    # The wrapper is usable again.
    assert torch.equal(wrapped(torch.ones(6)), torch.ones(6))


def test_keyboard_interrupt_like_base_exceptions_propagate() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            raise SystemExit(3)
        dbo.yield_()
        return x

    with pytest.raises(SystemExit):
        dbo.overlap(fn)(torch.zeros(2))
    assert torch.equal(dbo.overlap(lambda x: x)(torch.ones(2)), torch.ones(2))


# ---------------------------------------------------------------- 5. watchdog
def test_watchdog_names_the_stuck_ubatch_and_shows_its_stack() -> None:
    release = threading.Event()

    def stuck_in_ubatch_one(x: torch.Tensor) -> torch.Tensor:
        dbo.yield_()
        if dbo.current_ubatch_id() == 1:
            release.wait(timeout=10)
        dbo.yield_()
        return x

    started = time.perf_counter()
    with pytest.raises(dbo.OverlapTimeoutError) as info:
        dbo.overlap(stuck_in_ubatch_one, timeout_s=0.3)(torch.zeros(4))
    elapsed = time.perf_counter() - started
    release.set()
    assert elapsed < 0.3 + 1.0
    message = str(info.value)
    assert "ubatch 1 of 2" in message
    assert "stuck_in_ubatch_one" in message  # its stack
    assert info.value.ubatch_id == 1
    # A fresh call works (the stuck runner is replaced).
    assert torch.equal(dbo.overlap(lambda x: x + 1, timeout_s=5)(torch.zeros(4)), torch.ones(4))


def test_watchdog_does_not_fire_when_the_baton_moves() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            time.sleep(0.1)  # each hold is short; the whole run is longer than timeout_s
            dbo.yield_()
        return x

    started = time.perf_counter()
    assert torch.equal(dbo.overlap(fn, timeout_s=0.6)(torch.ones(4)), torch.ones(4))
    assert time.perf_counter() - started > 0.6  # the run outlived timeout_s


# ---------------------------------------------------------------- 6. nesting
def test_nested_overlap_runs_inline() -> None:
    seen: list[tuple[int, int, bool]] = []

    def inner(x: torch.Tensor) -> torch.Tensor:
        seen.append((dbo.current_ubatch_id(), x.shape[0], dbo.enabled()))
        return x * 2

    inner_overlapped = dbo.overlap(inner, num_ubatches=2)

    def outer(x: torch.Tensor) -> torch.Tensor:
        before = threading.active_count()
        y = inner_overlapped(x)
        assert threading.active_count() == before, "a nested overlap must not start threads"
        return y

    out = dbo.overlap(outer)(torch.ones(6))
    assert torch.equal(out, torch.full((6,), 2.0))
    assert sorted(seen) == [(0, 3, True), (1, 3, True)]


# ---------------------------------------------------------------- 7. leaks
def test_no_thread_leak_over_many_calls() -> None:
    with dbo.UBatchRunner(num_ubatches=2) as runner:
        baseline = threading.active_count()
        parts = [((torch.ones(2),), {}), ((torch.ones(2),), {})]
        for _ in range(500):
            runner.run(lambda x: x + dbo.current_ubatch_id(), parts)
        assert threading.active_count() == baseline
    assert not any(thread.is_alive() for thread in runner.threads)


def test_overlap_reuses_its_runner_threads() -> None:
    wrapped = dbo.overlap(lambda x: x * 2)
    wrapped(torch.ones(4))
    baseline = threading.active_count()
    for _ in range(500):
        wrapped(torch.ones(4))
    assert threading.active_count() == baseline


# ---------------------------------------------------------------- 8. bad input
@pytest.mark.parametrize(
    "bad,error",
    [("2", TypeError), (2.0, TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)],
)
def test_bad_num_ubatches(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        dbo.overlap(lambda x: x, num_ubatches=bad)  # type: ignore[call-overload]
    with pytest.raises(error):
        dbo.UBatchRunner(num_ubatches=bad)  # type: ignore[arg-type]


def test_other_options_are_validated() -> None:
    with pytest.raises(ValueError):
        dbo.overlap(lambda x: x, timeout_s=0)
    with pytest.raises(TypeError):
        dbo.overlap(lambda x: x, min_batch_size="4")  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        dbo.overlap(lambda x: x, merge=3)  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        dbo.overlap(42)  # type: ignore[call-overload]


def test_unregistered_thread_inside_an_overlap_behaves_as_outside() -> None:
    seen: list[tuple[int, bool, int, bool]] = []

    def helper() -> None:
        dbo.yield_()  # no-op: not a ubatch thread
        seen.append(
            (dbo.current_ubatch_id(), dbo.enabled(), dbo.num_ubatches(), dbo.maybe_run_recv_hook())
        )

    def fn(x: torch.Tensor) -> torch.Tensor:
        thread = threading.Thread(target=helper)
        thread.start()
        thread.join(timeout=5)
        assert not thread.is_alive()
        return x

    dbo.overlap(fn)(torch.zeros(2))
    assert seen == [(0, False, 1, False), (0, False, 1, False)]


# ---------------------------------------------------------------- thread settings
def test_workers_inherit_grad_inference_and_autocast_modes() -> None:
    weight = torch.randn(4, 4, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x @ weight

    with torch.no_grad():
        assert not dbo.overlap(fn)(torch.randn(4, 4)).requires_grad
    assert dbo.overlap(fn)(torch.randn(4, 4)).requires_grad
    with torch.inference_mode():
        assert dbo.overlap(fn)(torch.randn(4, 4)).is_inference()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dbo.overlap(fn)(torch.randn(4, 4)).dtype == torch.bfloat16


def test_workers_use_the_callers_intra_op_thread_count() -> None:
    original = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            counts = dbo.overlap(lambda x: torch.full((1,), torch.get_num_threads()))(
                torch.zeros(2)
            )
            assert counts.tolist() == [count, count]
    finally:
        torch.set_num_threads(original)


def test_gradients_flow_through_an_overlap() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(6, 8)
    dbo.overlap(functools.partial(layered, weight=weight))(x).sum().backward()
    grad_dbo = weight.grad.clone()
    weight.grad = None
    torch.cat([layered(p, weight) for p in torch.tensor_split(x, 2)]).sum().backward()
    assert torch.allclose(grad_dbo, weight.grad)


# ---------------------------------------------------------------- split / merge
@dataclass
class Batch:
    tokens: torch.Tensor
    scale: float


pytree.register_dataclass(Batch)


def test_nested_arguments_and_outputs_are_split_and_merged() -> None:
    def fn(batch: Batch, extra: dict[str, torch.Tensor], tag: str) -> dict[str, object]:
        return {"out": (batch.tokens * batch.scale, extra["mask"].sum(1)), "tag": tag}

    tokens = torch.arange(10.0).reshape(5, 2)
    mask = torch.ones(5, 3)
    scalar = torch.tensor(2.0)
    out = dbo.overlap(fn)(Batch(tokens, 3.0), {"mask": mask, "scalar": scalar}, tag="t")
    assert out["tag"] == "t"
    assert torch.equal(out["out"][0], tokens * 3.0)
    assert torch.equal(out["out"][1], torch.full((5,), 3.0))


def test_mismatched_batch_sizes_name_the_arguments() -> None:
    with pytest.raises(ValueError, match=r"args\[0\]: 4.*kwargs\['mask'\]: 3"):
        dbo.overlap(lambda x, mask: x)(torch.zeros(4), mask=torch.zeros(3))


def test_merge_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="same structure"):
        dbo.overlap(lambda x: (x,) if dbo.current_ubatch_id() == 0 else [x])(torch.zeros(4))
    with pytest.raises(ValueError, match="0-dim"):
        dbo.overlap(lambda x: x.sum())(torch.zeros(4))
    with pytest.raises(ValueError, match="different non-tensor"):
        dbo.overlap(lambda x: (x, dbo.current_ubatch_id()))(torch.zeros(4))


def test_merge_parts_and_custom_split() -> None:
    x = torch.arange(6.0)
    parts = dbo.overlap(lambda x: x + 0, merge=dbo.merge_parts)(x)
    assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]

    def ragged(args: tuple, kwargs: dict, n: int) -> list:
        (x,) = args
        return [((x[:1],), {}), ((x[1:],), {})]

    got = dbo.overlap(lambda x: x * 10, split=ragged, merge=dbo.merge_parts)(x)
    assert [p.shape[0] for p in got] == [1, 5]
    # A merge that writes into one buffer: fn writes its rows, merge returns the buffer.
    out = torch.empty(6)

    def into_out(x: torch.Tensor, rows: torch.Tensor) -> None:
        out[rows] = x * 2

    result = dbo.overlap(into_out, merge=lambda outputs: out)(x, torch.arange(6))
    assert result is out and torch.equal(out, x * 2)


def test_small_batches_run_inline() -> None:
    calls: list[tuple[int, bool]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append((x.shape[0] if isinstance(x, torch.Tensor) else x, dbo.enabled()))
        return x

    dbo.overlap(fn, num_ubatches=3)(torch.zeros(2))  # fewer rows than ubatches
    dbo.overlap(fn, min_batch_size=8)(torch.zeros(6))  # below the threshold
    dbo.overlap(fn)(3.0)  # nothing to split
    dbo.overlap(fn, min_batch_size=8)(torch.zeros(8))
    assert calls == [(2, False), (6, False), (3.0, False), (4, True), (4, True)]


def test_the_caller_s_saved_tensor_hooks_are_active_in_the_ubatches() -> None:
    # save_on_cpu and non-reentrant checkpointing around an overlapped call work by
    # these hooks; without them in the ubatch threads memory is silently not saved.
    linear = torch.nn.Linear(4, 4)

    def fn(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(linear(h)).sin()

    x = torch.randn(6, 4, requires_grad=True)
    packed: list[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(threading.current_thread().name)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for part in x.tensor_split(2):
            fn(part)
        in_turn = len(packed)
        packed.clear()
        y = dbo.overlap(fn, timeout_s=30)(x)
    assert in_turn > 0 and len(packed) == in_turn
    assert all(name.startswith("dbo-ubatch-") for name in packed)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (expected,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.allclose(grad, expected)


def test_disabled_saved_tensor_hooks_stay_disabled_in_the_ubatches() -> None:
    def fn(h: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return h * 2

    message = "no hooks here, says the caller"
    with (
        torch.autograd.graph.disable_saved_tensors_hooks(message),
        pytest.raises(RuntimeError, match=message),
    ):
        dbo.overlap(fn, timeout_s=30)(torch.ones(4, 2))


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_non_reentrant_checkpointing_around_an_overlap_gives_the_same_gradients(
    num_ubatches: int,
) -> None:
    # Its hooks now run in the ubatch threads: the recomputation in backward reruns
    # the overlap, and must find the tensors the forward's ubatches packed.
    from torch.utils.checkpoint import checkpoint

    linear = torch.nn.Linear(4, 4)

    def fn(h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(linear(h))
        dbo.yield_()
        return torch.sin(linear(h)) * h

    step = dbo.overlap(fn, num_ubatches=num_ubatches, timeout_s=30)
    x = torch.randn(7, 4, requires_grad=True)
    y = checkpoint(step, x, use_reentrant=False)
    grads = torch.autograd.grad(y.sum(), (x, linear.weight))
    expected = torch.autograd.grad(step(x).sum(), (x, linear.weight))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want)
