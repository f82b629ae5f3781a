"""Train a small MoE, expert-parallel over the ranks, with its ubatches in turn and with DBO.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/train_moe.py
    # no torchrun (a fresh machine, `make demo-train`): spawn 2 gloo ranks on a free port
    python examples/train_moe.py --spawn 2

Two copies of one model (`moe_overlap.MoEModel`: a mixing linear and top-k experts per
layer, `comm.moe.dispatch`/`combine`) train side by side on the same batches with SGD:
one runs the two ubatches in turn, the other is wrapped in `dbo.overlap`, whose backward
runs each ubatch's backward in its own thread, so that one ubatch's backward exchanges
overlap the other's backward compute, as in the forward. The training code is plain:
`loss(step(x)).backward()`, then the optimizer.

It prints the losses of both (equal bit for bit, step after step), the median forward,
backward and whole-step times of each mode (per step the slowest rank), and the host
time blocked in collective waits during the backward (from `dbo.trace()`). Each rank's
Chrome trace and PNG timeline of one DBO training step go to --out (dbo-train/);
--json ends the output with one JSON line of the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import _harness
import torch
import torch.distributed as dist
from moe_overlap import MoEModel, add_model_args

import comm
import dbo

Phases = dict[str, float]  # forward, backward, step (ms)


def _batch(args: argparse.Namespace, step: int, device: torch.device) -> tuple[Any, Any]:
    """This rank's inputs and regression targets for `step` (the same for both modes)."""
    generator = torch.Generator().manual_seed(10_000 * dist.get_rank() + step)
    x = torch.randn(args.tokens, args.hidden, generator=generator)
    target = torch.randn(args.tokens, args.hidden, generator=generator)
    return x.to(device), target.to(device)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Trainer:
    """One model, its optimizer and how its forward runs (in turn or overlapped)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, overlapped: bool) -> None:
        torch.manual_seed(1234)  # the same weights for both modes (and every rank's shared ones)
        self.model = MoEModel(
            args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.device = device
        if overlapped:
            self.forward: Callable[[torch.Tensor], torch.Tensor] = dbo.overlap(
                self.model, num_ubatches=2, timeout_s=args.timeout_s
            )
        else:
            self.forward = lambda x: torch.cat([self.model(part) for part in x.tensor_split(2)])

    def step(
        self, x: torch.Tensor, target: torch.Tensor, backward: Callable[[torch.Tensor], None]
    ) -> tuple[float, Phases]:
        """One training step: (loss, {forward, backward, step} ms on this rank)."""
        dist.barrier()  # every rank starts the step together
        start = _sync(self.device)
        loss = torch.nn.functional.mse_loss(self.forward(x), target)
        forward_end = _sync(self.device)
        backward(loss)
        backward_end = _sync(self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = _sync(self.device)
        phases = {
            "forward": forward_end - start, "backward": backward_end - forward_end,
            "step": end - start,
        }
        return loss.item(), {name: seconds * 1e3 for name, seconds in phases.items()}


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def rank_main(args: argparse.Namespace) -> None:
    """One rank's work: train both copies, check, time, trace, report on rank 0."""
    rank, _, device = comm.init_distributed()  # launched by `_harness.launch`
    trainers = {"split": _Trainer(args, device, False), "dbo": _Trainer(args, device, True)}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    times: dict[str, list[Phases]] = {name: [] for name in trainers}
    for step in range(args.warmup + args.steps):  # interleaved: both see the same conditions
        x, target = _batch(args, step, device)
        for name, trainer in trainers.items():
            loss, phases = trainer.step(x, target, _plain_backward)
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(phases)
    blocked = {
        name: _blocked_backward_ms(trainer, args, device) for name, trainer in trainers.items()
    }
    weights_equal = all(
        torch.equal(a, b) for a, b in zip(
            trainers["split"].model.parameters(), trainers["dbo"].model.parameters()
        )
    )
    files, plot_error = _trace_one_step(trainers["dbo"], args, device, rank)
    summary = _summarize(args, device, losses, times, blocked, weights_equal)
    if rank == 0:
        _report(summary, losses, files, plot_error, args)
    if not (summary["losses_equal"] and summary["weights_equal"]):
        raise SystemExit("training with DBO diverged from the same ubatches in turn")


def _blocked_backward_ms(
    trainer: _Trainer, args: argparse.Namespace, device: torch.device
) -> float:
    """Host time per step blocked in collective waits during the backward (traced alone)."""
    blocked_s = 0.0

    def traced_backward(loss: torch.Tensor) -> None:
        nonlocal blocked_s
        with dbo.trace() as timeline:
            loss.backward()
        blocked_s += sum(total.blocked_s for total in timeline.totals().values())

    for step in range(_harness.TRACED_STEPS):
        trainer.step(*_batch(args, 10_000 + step, device), traced_backward)
    return blocked_s * 1e3 / _harness.TRACED_STEPS


def _trace_one_step(
    trainer: _Trainer, args: argparse.Namespace, device: torch.device, rank: int
) -> tuple[list[str], str]:
    """This rank's Chrome trace and PNG of one DBO training step (forward and backward)."""
    x, target = _batch(args, 20_000, device)
    with dbo.trace() as timeline:
        trainer.step(x, target, _plain_backward)
    return _harness.write_traces(
        args.out, rank, timeline, timeline, name="train",
        title="one DBO training step (forward, then backward)",
    )


def _summarize(
    args: argparse.Namespace, device: torch.device, losses: dict[str, list[float]],
    times: dict[str, list[Phases]], blocked: dict[str, float], weights_equal: bool,
) -> dict[str, Any]:
    """The --json object; medians over the steps of the slowest rank per step and phase."""
    names = ("forward", "backward", "step")
    mine = [phases[name] for mode in times for phases in times[mode] for name in names]
    slowest = _harness.gather(mine, device).max(dim=0).values.view(2, args.steps, 3)
    medians = {
        mode: {name: statistics.median(slowest[m, :, n].tolist()) for n, name in enumerate(names)}
        for m, mode in enumerate(times)
    }
    checks = _harness.gather(
        [float(losses["split"] == losses["dbo"]), float(weights_equal),
         blocked["split"], blocked["dbo"]], device,
    )
    pinned = getattr(args, "pinned_cores", None)  # set by _harness.launch
    summary: dict[str, Any] = {
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "pinned_cores_per_rank": len(pinned) if pinned else None,
        "num_ubatches": 2, "tokens": args.tokens, "layers": args.layers,
        "hidden": args.hidden, "experts": args.experts_per_rank * dist.get_world_size(),
        "topk": args.topk, "steps": args.steps,
        "losses_equal": bool(checks[:, 0].all()), "weights_equal": bool(checks[:, 1].all()),
        "blocked_backward_split_ms": checks[:, 2].max().item(),
        "blocked_backward_dbo_ms": checks[:, 3].max().item(),
    }
    for mode in times:
        for name in names:
            summary[f"{name}_{mode}_ms"] = medians[mode][name]
    for name in names:
        summary[f"{name}_speedup_vs_split"] = medians["split"][name] / medians["dbo"][name]
    return summary


def _report(
    summary: dict[str, Any], losses: dict[str, list[float]], files: list[str],
    plot_error: str, args: argparse.Namespace,
) -> None:
    cores = summary["pinned_cores_per_rank"]
    placement = f", each rank pinned to {cores} core(s) of its own" if cores else ""
    print(
        f"MoE training: tokens {summary['tokens']}, layers {summary['layers']}, hidden "
        f"{summary['hidden']}, experts {summary['experts']}, topk {summary['topk']}, "
        f"2 ubatches, SGD"
    )
    print(
        f"  world: {summary['world_size']} ranks, {summary['backend']} on {summary['device']}"
        f"{placement}"
    )
    shown = ", ".join(f"{loss:.6f}" for loss in losses["dbo"][:6])
    print(f"  losses (DBO, first steps): {shown}")
    print(f"  DBO losses == in turn, every step (bitwise): {summary['losses_equal']}; "
          f"weights after training equal: {summary['weights_equal']}")
    print(f"  {args.steps} steps per mode after {args.warmup} warm-up, slowest rank per step")
    print(f"    {'mode':<24}{'forward ms':>12}{'backward ms':>13}{'step ms':>10}"
          f"{'blocked in backward ms':>24}")
    labels = {"split": "same ubatches in turn", "dbo": "DBO (dbo.overlap)"}
    for mode, label in labels.items():
        print(
            f"    {label:<24}{summary[f'forward_{mode}_ms']:>12.1f}"
            f"{summary[f'backward_{mode}_ms']:>13.1f}{summary[f'step_{mode}_ms']:>10.1f}"
            f"{summary[f'blocked_backward_{mode}_ms']:>24.1f}"
        )
    print_speedups(summary)
    _harness.print_files(files, plot_error)
    if args.json:
        print(json.dumps(summary))


def print_speedups(summary: dict[str, Any]) -> None:
    print(
        f"  DBO over the same ubatches in turn: forward "
        f"{summary['forward_speedup_vs_split']:.2f}x, backward "
        f"{summary['backward_speedup_vs_split']:.2f}x, whole step "
        f"{summary['step_speedup_vs_split']:.2f}x"
    )


def training_args(description: str, default_out: str) -> argparse.Namespace:
    """The flags of the training examples: the model's, --lr, --warmup, the common ones."""
    parser = argparse.ArgumentParser(description=description)
    add_model_args(parser)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (default %(default)s)"
    )
    _harness.add_common_args(parser, default_out=default_out)
    return parser.parse_args()


def main() -> None:
    _harness.launch(rank_main, training_args(__doc__.split("\n\n")[0], "dbo-train"))


if __name__ == "__main__":
    main()
