"""`torch.compile`d code under `dbo.overlap`: dynamo compiles, and recompiles (a new
shape: an odd batch gives ubatches one row apart), inside the ubatch threads, holding the
baton, and the results equal the compiled code on the same ubatches in turn, forward and
backward, with 2 to 4 ubatches. A yield inside the compiled code is a graph break."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dbo

TIMEOUT_S = 120.0
"""A first compile with inductor takes seconds on a small CPU, all in one turn."""


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        dbo.yield_()  # a graph break: the other ubatch runs here
        return x + self.b(h)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Block() for _ in range(3)])


def _in_turn(fn: Callable[..., Any], num_ubatches: int) -> Callable[[torch.Tensor], Any]:
    return lambda x: torch.cat([fn(part) for part in x.tensor_split(num_ubatches)])


@pytest.fixture
def compiles_in() -> Any:
    """A dynamo backend (eager after AOT autograd) that notes the thread of each compile."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    threads: list[str] = []

    def compiler(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    yield threads, aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    torch._dynamo.reset()


def test_compiles_and_recompiles_run_in_the_ubatch_threads_and_equal_compiled_in_turn(
    compiles_in: Any,
) -> None:
    threads, backend = compiles_in
    model = _model()
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in (8, 9, 10, 7, 12, 9, 5, 8):
            for num_ubatches in (2, 3, 4):
                x = torch.randn(rows, 16, generator=generator)
                got = dbo.overlap(compiled, num_ubatches=num_ubatches, timeout_s=TIMEOUT_S)(x)
                assert torch.equal(got, _in_turn(compiled, num_ubatches)(x)), (rows, num_ubatches)
    # The first compile of each graph happened in a ubatch thread (dbo's workers).
    assert threads and all(name.startswith("dbo-") for name in threads[:2]), threads


def test_compiled_training_gives_the_compiled_in_turn_gradients_bitwise(
    compiles_in: Any,
) -> None:
    _, backend = compiles_in
    model = _model()
    compiled = torch.compile(model, backend=backend)
    for rows in (8, 9, 7):
        x = torch.randn(rows, 16, requires_grad=True, generator=torch.Generator().manual_seed(rows))
        grads = []
        for step in (dbo.overlap(compiled, timeout_s=TIMEOUT_S), _in_turn(compiled, 2)):
            model.zero_grad(set_to_none=True)
            x.grad = None
            (step(x) ** 2).sum().backward()
            grads.append([x.grad, *(p.grad for p in model.parameters())])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), rows


def test_inductor_compiled_code_under_dbo_equals_it_in_turn() -> None:
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model)  # inductor
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = dbo.overlap(compiled, timeout_s=TIMEOUT_S)(x)
        assert torch.equal(got, _in_turn(compiled, 2)(x))
    torch._dynamo.reset()
