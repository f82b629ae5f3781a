"""A tensor-parallel MLP whose all-reduce overlaps the other ubatch's compute.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/tensor_parallel_mlp.py
    # several nodes: run on each node, with its own --node-rank
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
             --nproc-per-node 8 examples/tensor_parallel_mlp.py
    # no torchrun: spawn 2 gloo ranks on a free port
    python examples/tensor_parallel_mlp.py --spawn 2

Each layer is a residual MLP split over the ranks the Megatron way: the first linear is
column-parallel (each rank keeps `ffn / world_size` of its output columns), the second
row-parallel (the matching rows), so each rank computes a partial sum of the layer's
output and `comm.all_reduce` adds the partial sums up. Every rank sees the same tokens.
Under `dbo.overlap` the all-reduce yields while in flight, so one ubatch's reduction
runs while the other ubatch computes its matmuls. The script checks the sharded model
against the unsharded one, then DBO against the same ubatches in turn (bitwise) and the
whole batch (allclose), times the three, and writes each rank's trace and timeline.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness  # noqa: E402

import comm  # noqa: E402
import dbo  # noqa: E402


def _full_weights(hidden: int, ffn: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded layer's weights, [hidden, ffn] and [ffn, hidden]: the same on every
    rank (one seed per layer), whatever the number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    w_in = torch.randn(hidden, ffn, generator=generator) / hidden**0.5
    w_out = torch.randn(ffn, hidden, generator=generator) / ffn**0.5
    return w_in, w_out


class ParallelMLP(torch.nn.Module):
    """x + gelu(x @ W_in) @ W_out with W_in split by columns and W_out by rows over the
    ranks; input and output [tokens, hidden], the same on every rank."""

    def __init__(self, hidden: int, ffn: int, seed: int) -> None:
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if ffn % world_size:
            raise ValueError(f"ffn ({ffn}) must be divisible by the world size ({world_size})")
        w_in, w_out = _full_weights(hidden, ffn, seed)
        shard = slice(rank * ffn // world_size, (rank + 1) * ffn // world_size)
        self.w_in = torch.nn.Parameter(w_in[:, shard].contiguous())  # column-parallel
        self.w_out = torch.nn.Parameter(w_out[shard].contiguous())  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.gelu(x @ self.w_in) @ self.w_out  # this rank's share
        comm.all_reduce(partial)  # the sum over the ranks; yields while in flight
        return x + partial


def dense_forward(x: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The same model unsharded, in this process: what the ranks compute together."""
    for layer in range(args.layers):
        w_in, w_out = (w.to(x.device) for w in _full_weights(args.hidden, args.ffn, layer))
        x = x + torch.nn.functional.gelu(x @ w_in) @ w_out
    return x


def rank_main(args: argparse.Namespace) -> None:
    rank, world_size, device = comm.init_distributed()  # up already: the same answer
    model = torch.nn.Sequential(
        *[ParallelMLP(args.hidden, args.ffn, seed=layer) for layer in range(args.layers)]
    ).to(device)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(device)  # the same tokens on every rank
    overlapped = dbo.overlap(model, num_ubatches=2, decision_group=dist.group.WORLD)
    with torch.inference_mode():
        diff = (model(x) - dense_forward(x, args)).abs().max()
    worst = diff.double().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank takes the same decision
    if not worst.item() <= 1e-4:
        raise SystemExit(f"the sharded model differs from the unsharded one by {worst.item()}")

    def in_turn() -> torch.Tensor:
        return torch.cat([model(part) for part in x.tensor_split(2)])

    _harness.compare(
        "Tensor-parallel MLP forward",
        whole=lambda: model(x), split=in_turn, overlapped=lambda: overlapped(x),
        args=args, device=device,
        facts={
            "layers": args.layers, "tokens": args.tokens, "hidden": args.hidden,
            "ffn": args.ffn, "num_ubatches": 2,
            "max_abs_diff_vs_dense": float(f"{worst.item():.2g}"),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="MLP layers (default 4)")
    parser.add_argument(
        "--tokens", type=int, default=2048, help="tokens per step, on every rank (default 2048)"
    )
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument(
        "--ffn", type=int, default=1024,
        help="MLP inner width, split over the ranks (default 1024)",
    )
    _harness.add_common_args(parser, default_out="dbo-demo-tp")
    _harness.launch(rank_main, parser.parse_args())


if __name__ == "__main__":
    main()
