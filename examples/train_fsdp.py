"""Train the demo MoE under FSDP2, its ubatches in turn and with DBO.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/train_fsdp.py
    # no torchrun (a fresh machine, `make demo-train-fsdp`): spawn 2 gloo ranks
    python examples/train_fsdp.py --spawn 2

The model is `moe_overlap.MoEModel`, sharded as torchtitan shards an MoE: each layer's
dense weights with `fully_shard` (per layer, then at the root), its experts kept out of
FSDP2 (`ignored_params`) and expert-parallel through `comm.moe`. Two copies train side
by side on the same batches with SGD: one runs the two ubatches in turn, the other is
wrapped in `dbo.overlap`. Under DBO each FSDP2 unit is gathered once per forward and
reduce-scattered once per backward, as soon as both ubatches' backwards have left it
(`dbo.fsdp`); the training code is plain: `loss(step(x)).backward()`, then the optimizer.

It prints the losses of both (allclose, and the largest difference: FSDP2 sums the
ubatches' gradients in another order than autograd does in turn), the median forward,
backward and whole-step times of each mode (per step the slowest rank), per mode the
gradient reduce-scatters of a backward and the host time inside them, and on CUDA the
memory each backward allocates at its peak; --json ends the output with one JSON line.
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
from moe_overlap import MoEModel
from torch.distributed.fsdp import fully_shard
from train_moe import _batch, _sync, print_speedups, training_args

import comm
import dbo

REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
"""The collective FSDP2 reduces a unit's gradients with (torch 2.13's name, then 2.11's)."""


def sharded_moe(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The demo MoE, its dense weights sharded by FSDP2 and its experts not."""
    torch.manual_seed(1234)
    model = MoEModel(args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk)
    model = model.to(device)
    experts = {layer.w1 for layer in model.layers} | {layer.w2 for layer in model.layers}
    for layer in model.layers:
        fully_shard(layer, ignored_params={layer.w1, layer.w2})
    return fully_shard(model, ignored_params=experts)


class _ReduceScatters:
    """`with _ReduceScatters() as timed:` counts FSDP2's reduce-scatters and the host time
    inside them (one that calls the other is counted once)."""

    def __enter__(self) -> _ReduceScatters:
        self.count, self.seconds, self._depth = 0, 0.0, 0
        self._originals = {name: getattr(dist, name) for name in REDUCE_SCATTERS
                           if hasattr(dist, name)}
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            outermost = self._depth == 0
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if outermost:
                    self.count += 1
                    self.seconds += time.perf_counter() - start
        return reduce_scatter


class _Trainer:
    """One sharded model, its optimizer and how its forward runs (in turn or overlapped)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, overlapped: bool) -> None:
        self.model = sharded_moe(args, device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.device = device
        if overlapped:
            self.forward: Callable[[torch.Tensor], torch.Tensor] = dbo.overlap(
                self.model, num_ubatches=2, timeout_s=args.timeout_s
            )
        else:
            self.forward = lambda x: torch.cat([self.model(part) for part in x.tensor_split(2)])

    def step(self, x: torch.Tensor, target: torch.Tensor) -> tuple[float, dict[str, float]]:
        """One training step: (loss, {forward, backward, step, reduce-scatter} ms, count)."""
        dist.barrier()
        start = _sync(self.device)
        loss = torch.nn.functional.mse_loss(self.forward(x), target)
        forward_end = _sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        with _ReduceScatters() as reduced:
            loss.backward()
        backward_end = _sync(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = _sync(self.device)
        return loss.item(), {
            "forward": (forward_end - start) * 1e3, "backward": (backward_end - forward_end) * 1e3,
            "step": (end - start) * 1e3, "reduce_scatter": reduced.seconds * 1e3,
            "reduce_scatters": float(reduced.count), "backward_peak": peak / 2**20,
        }


PHASES = ("forward", "backward", "step", "reduce_scatter", "reduce_scatters", "backward_peak")
"""Per step: ms, ms, ms, ms, a count, and the memory the backward allocated at its peak
over what it started with (MiB; CUDA only: 0 on CPU)."""


def rank_main(args: argparse.Namespace) -> None:
    """One rank's work: train both copies, compare, time, report on rank 0."""
    rank, _, device = comm.init_distributed()  # launched by `_harness.launch`
    trainers = {"split": _Trainer(args, device, False), "dbo": _Trainer(args, device, True)}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
    for step in range(args.warmup + args.steps):  # interleaved: both see the same conditions
        x, target = _batch(args, step, device)
        for name, trainer in trainers.items():
            loss, phases = trainer.step(x, target)
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(phases)
    summary = _summarize(args, device, losses, times)
    if rank == 0:
        _report(summary, losses, args)
    if not summary["losses_close"]:
        raise SystemExit("training with DBO under FSDP2 diverged from the ubatches in turn")


def _summarize(
    args: argparse.Namespace, device: torch.device, losses: dict[str, list[float]],
    times: dict[str, list[dict[str, float]]],
) -> dict[str, Any]:
    """The --json object; medians over the steps of the slowest rank per step and phase."""
    mine = [phases[name] for mode in times for phases in times[mode] for name in PHASES]
    slowest = _harness.gather(mine, device).max(dim=0).values.view(2, args.steps, len(PHASES))
    difference = max(abs(a - b) for a, b in zip(losses["split"], losses["dbo"]))
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b))
                for a, b in zip(losses["dbo"], losses["split"]))
    checks = _harness.gather([float(close), difference], device)
    summary: dict[str, Any] = {
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "num_ubatches": 2, "tokens": args.tokens,
        "layers": args.layers, "hidden": args.hidden,
        "experts": args.experts_per_rank * dist.get_world_size(), "steps": args.steps,
        "losses_close": bool(checks[:, 0].all()),
        "largest_loss_difference": checks[:, 1].max().item(),
    }
    for m, mode in enumerate(times):
        for n, name in enumerate(PHASES):
            value = statistics.median(slowest[m, :, n].tolist())
            unit = {"reduce_scatters": "", "backward_peak": "_mib"}.get(name, "_ms")
            summary[f"{name}_{mode}{unit}"] = value
    for name in ("forward", "backward", "step"):
        summary[f"{name}_speedup_vs_split"] = (
            summary[f"{name}_split_ms"] / summary[f"{name}_dbo_ms"])
    return summary


def _report(summary: dict[str, Any], losses: dict[str, list[float]],
            args: argparse.Namespace) -> None:
    print(
        f"MoE training under FSDP2: tokens {summary['tokens']}, layers {summary['layers']}, "
        f"hidden {summary['hidden']}, experts {summary['experts']} (expert-parallel, not "
        f"sharded), 2 ubatches, SGD"
    )
    print(f"  world: {summary['world_size']} ranks, {summary['backend']} on {summary['device']}")
    shown = ", ".join(f"{loss:.6f}" for loss in losses["dbo"][:6])
    print(f"  losses (DBO, first steps): {shown}")
    print(f"  DBO losses allclose to in turn, every step: {summary['losses_close']} "
          f"(largest difference {summary['largest_loss_difference']:.2e})")
    print(f"  {args.steps} steps per mode after {args.warmup} warm-up, slowest rank per step")
    print(f"    {'mode':<24}{'forward ms':>12}{'backward ms':>13}{'step ms':>10}"
          f"{'reduce-scatters':>17}{'in them ms':>12}")
    labels = {"split": "same ubatches in turn", "dbo": "DBO (dbo.overlap)"}
    for mode, label in labels.items():
        print(
            f"    {label:<24}{summary[f'forward_{mode}_ms']:>12.1f}"
            f"{summary[f'backward_{mode}_ms']:>13.1f}{summary[f'step_{mode}_ms']:>10.1f}"
            f"{summary[f'reduce_scatters_{mode}']:>17.0f}"
            f"{summary[f'reduce_scatter_{mode}_ms']:>12.1f}"
        )
    print_speedups(summary)
    if summary["device"] == "cuda":
        print(f"  memory the backward allocated at its peak (MiB): in turn "
              f"{summary['backward_peak_split_mib']:.1f}, "
              f"DBO {summary['backward_peak_dbo_mib']:.1f}")
    if args.json:
        print(json.dumps(summary))


def main() -> None:
    _harness.launch(rank_main, training_args(__doc__.split("\n\n")[0], "dbo-train-fsdp"))


if __name__ == "__main__":
    main()
