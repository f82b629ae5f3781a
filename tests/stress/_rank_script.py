"""One gloo rank of the multi-process fault, stress and leak tests, run as a script.

    python _rank_script.py MODE OUT_DIR      # started by `_dist_world.run_ranks`

MODE is `fault`, `stress` or `leak`; OUT_DIR holds `spec.json` (the test's parameters).
The rank appends its events to `OUT_DIR/rank{RANK}.jsonl` (one JSON object a line, with
`time.time()`), and a failure is re-raised uncaught, so the process ends through the
interpreter's own exit with the status it gives.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import comm
import dbo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from _spawn import start_together  # noqa: E402 - the same barrier as the spawned tests

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT_DIR = Path(sys.argv[2])
SPEC: dict[str, Any] = json.loads((OUT_DIR / "spec.json").read_text())


class InjectedFailure(RuntimeError):
    """The error a faulty rank raises on purpose."""


def record(event: str, **fields: Any) -> None:
    with open(OUT_DIR / f"rank{RANK}.jsonl", "a") as file:
        file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


# ------------------------------------------------------------------------------- fault
def _inject(fault: str) -> None:
    """The fault, on the faulty rank, in ubatch 1, before the collective of layer 2."""
    if fault == "raise":
        raise InjectedFailure(f"rank {RANK} fails on purpose")
    if fault == "sigint":  # a Ctrl-C once this ubatch is blocked in the collective
        interrupt = lambda: (record("fault"), os.kill(os.getpid(), signal.SIGINT))  # noqa: E731
        threading.Timer(SPEC["sigint_after_s"], interrupt).start()
        return
    record("fault")
    if fault == "exit":
        os._exit(7)
    elif fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stall":
        time.sleep(3600)


def _maybe_inject(layer: int, fault: str | None) -> None:
    """On the faulty rank, in ubatch 1 at layer 2, the fault (its peers, for sigint, late)."""
    if layer == 2 and dbo.current_ubatch_id() == 1 and fault is not None:
        if SPEC["faulty_rank"] == RANK:
            _inject(fault)
        elif fault == "sigint":
            time.sleep(SPEC["peers_late_s"])  # the faulty rank waits for us


class _Exchange(torch.autograd.Function):
    """An all-to-all of equal parts whose backward is one too; `fault`: inject it in the
    backward, before the backward's all-to-all of `layer`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: int, fault: str | None) -> torch.Tensor:
        ctx.layer, ctx.fault = layer, fault
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _maybe_inject(ctx.layer, ctx.fault)
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad.contiguous())
        return out, None, None


def _faulty_forward(fault: str | None, phase: str) -> Any:
    """Six layers of compute and an all-to-all; the fault before layer 2's all-to-all of
    the forward or (phase "backward") of the backward."""
    weight = torch.eye(8) * 0.5

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in range(6):
            x = torch.tanh(x @ weight)
            if phase == "forward":
                _maybe_inject(layer, fault)
            x = _Exchange.apply(x, layer, fault if phase == "backward" else None)
        return x

    return dbo.overlap(forward, timeout_s=SPEC["timeout_s"])


def fault_main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    start_together(timeout_s=120.0)
    comm.init_distributed(timeout_s=SPEC["group_timeout_s"])
    phase = SPEC.get("phase", "forward")
    x = torch.randn(4 * WORLD, 8, requires_grad=phase == "backward")
    warm = _faulty_forward(None, phase)(x)  # every connection is up
    if phase == "backward":
        warm.sum().backward()
    dist.barrier()
    step = _faulty_forward(SPEC["fault"], phase)
    record("start")
    try:
        y = step(x)
        if phase == "backward":
            y.sum().backward()
    except BaseException as error:
        record("raised", error=type(error).__name__, message=str(error)[:4000])
        raise
    finally:
        if SPEC.get("destroy"):  # as examples/_harness.py does
            comm.destroy_distributed()
            record("destroyed")
    record("returned")


# ------------------------------------------------------------------------------ stress
KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "moe")


def _layer_plan(rng: random.Random) -> list[dict[str, Any]]:
    """Random layers, the same on every rank (one seed): a collective each, a yield after
    some; all-to-all rows per (ubatch, source, destination), uneven and often zero."""
    plan = []
    for _ in range(rng.randint(1, 6)):
        layer: dict[str, Any] = {"kind": rng.choice(KINDS), "yield": rng.random() < 0.3}
        layer["send"] = [
            [[rng.choice([0, 0, 1, 2, 5]) for _ in range(WORLD)] for _ in range(WORLD)]
            for _ in range(2)
        ]
        plan.append(layer)
    return plan


def _collective(layer: dict[str, Any], x: torch.Tensor, ubatch: int) -> torch.Tensor:
    """One plain collective of `x`'s values (no autograd through it), folded back into x."""
    kind, flat = layer["kind"], x.detach().reshape(-1).contiguous()
    if kind == "all_reduce":
        total = flat.clone()
        comm.all_reduce(total)
        return x + total.view_as(x) / WORLD
    if kind == "all_gather":
        gathered = torch.empty(WORLD * flat.numel(), dtype=x.dtype)
        comm.all_gather_into_tensor(gathered, flat)
        return x * gathered.view(WORLD, *x.shape).mean(0).sigmoid()
    if kind == "reduce_scatter":
        scattered = torch.empty(flat.numel() // WORLD, dtype=x.dtype)
        comm.reduce_scatter_tensor(scattered, flat)
        return x + scattered.sum()
    send = layer["send"][ubatch]
    input_splits, output_splits = send[RANK], [send[src][RANK] for src in range(WORLD)]
    rows = x.detach().repeat(sum(input_splits) // len(x) + 1, 1)[: sum(input_splits)]
    received = torch.empty(sum(output_splits), x.shape[1], dtype=x.dtype)
    comm.all_to_all_single(received, rows.contiguous(), output_splits, input_splits)
    return x + received.sum(0) / 10


_serial_half = [0]  # which half a serial call runs (dbo.current_ubatch_id() is 0 there)


def _stress_forward(plan: list[dict[str, Any]], weights: list[torch.Tensor]) -> Any:
    num_experts = 2 * WORLD

    def forward(x: torch.Tensor) -> torch.Tensor:
        ubatch = dbo.current_ubatch_id() if dbo.enabled() else _serial_half[0]
        for layer, weight in zip(plan, weights):
            x = torch.tanh(x @ weight)
            if layer["kind"] != "moe":
                x = _collective(layer, x, ubatch)
            else:  # top-2 experts by a fixed router; gradients flow through both exchanges
                ids = torch.stack([(x.detach().argmax(1) + k) % num_experts for k in (0, 1)], 1)
                recv, local_ids, handle = comm.moe.dispatch(x, ids, num_experts)
                out = torch.tanh(recv * (1.0 + local_ids.unsqueeze(1).to(recv.dtype)))
                x = comm.moe.combine(out, handle, torch.softmax(x[:, :2], dim=1))
            if layer["yield"]:
                dbo.yield_()
        return x

    return forward


def _one_step(
    forward: Any, x: torch.Tensor, weights: list[torch.Tensor], overlapped: bool
) -> list[torch.Tensor]:
    """Forward, loss, backward: [y, x.grad, each weight's grad]."""
    for weight in weights:
        weight.grad = None
    x = x.clone().requires_grad_(True)
    if overlapped:
        y = dbo.overlap(forward, timeout_s=60)(x)
    else:  # the serial result: the same two halves, one after the other
        halves = []
        for _serial_half[0], half in enumerate(x.chunk(2)):
            halves.append(forward(half))
        y = torch.cat(halves)
    (y.square().sum() + y.sum()).backward()
    assert x.grad is not None
    return [y.detach(), x.grad] + [weight.grad.clone() for weight in weights]  # type: ignore[union-attr]


def stress_main() -> None:
    start_together(timeout_s=120.0)
    comm.init_distributed(timeout_s=60)
    torch.set_default_dtype(torch.float64)
    hidden, mismatches, kinds = 4, [], {kind: 0 for kind in KINDS}
    for step in range(SPEC["steps"]):
        rng = random.Random(SPEC["seed"] * 100_003 + step)
        plan = _layer_plan(rng)
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        weights = [(torch.randn(hidden, hidden, generator=generator) / hidden).requires_grad_()
                   for _ in plan]
        x = torch.randn(2 * rng.randint(1, 3), hidden,
                        generator=torch.Generator().manual_seed(step * 131 + RANK))
        forward = _stress_forward(plan, weights)
        serial = _one_step(forward, x, weights, overlapped=False)
        overlapped = _one_step(forward, x, weights, overlapped=True)
        names = ["y", "x.grad"] + [f"weights[{i}].grad" for i in range(len(weights))]
        for name, expected, got in zip(names, serial, overlapped):
            if not torch.equal(expected, got):
                kinds_in_plan = [layer["kind"] for layer in plan]
                mismatches.append({"step": step, "what": name, "plan": kinds_in_plan})
        for layer in plan:
            kinds[layer["kind"]] += 1
    record("stress", steps=SPEC["steps"], mismatches=mismatches[:5], kinds=kinds)
    comm.destroy_distributed()


# -------------------------------------------------------------------------------- leak
def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * resource.getpagesize()


def leak_main() -> None:
    """`SPEC["calls"]` overlapped calls, alternating 2 and 4 ubatches, each output equal to
    the first of its kind; the RSS, threads and workspace capacity at `SPEC["sample_at"]`."""
    import workspace

    start_together(timeout_s=120.0)
    comm.init_distributed(timeout_s=60)
    manager = workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=4)

    def body(x: torch.Tensor) -> torch.Tensor:
        (scratch,) = manager.get_simultaneous(((x.numel(),), x.dtype))
        scratch.copy_(x.reshape(-1))
        dbo.yield_()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        comm.all_reduce(out)
        return out + scratch.view_as(x)

    baseline = sorted(thread.name for thread in threading.enumerate())
    steps = {num: dbo.overlap(body, num_ubatches=num, timeout_s=60) for num in (2, 4)}
    x = torch.randn(8 * WORLD, 4, generator=torch.Generator().manual_seed(RANK))
    first: dict[int, torch.Tensor] = {}
    samples = {}
    for call in range(1, SPEC["calls"] + 1):
        num = 2 if call % 2 else 4
        out = steps[num](x)
        if not torch.equal(first.setdefault(num, out), out):
            raise AssertionError(f"call {call} ({num} ubatches) differs from the first")
        if call in SPEC["sample_at"]:
            samples[call] = {"rss": _rss_bytes(), "threads": threading.active_count(),
                             "capacity": manager.capacity_bytes}
    names = sorted(thread.name for thread in threading.enumerate())
    record("leak", samples=samples, baseline=baseline, thread_names=names)
    comm.destroy_distributed()


if __name__ == "__main__":
    {"fault": fault_main, "stress": stress_main, "leak": leak_main}[sys.argv[1]]()
