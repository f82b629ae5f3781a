"""A small MoE model, expert-parallel over the ranks, run serially and with dual-batch overlap.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/moe_overlap.py
    # several nodes: run on each node, with its own --node-rank
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
             --nproc-per-node 8 examples/moe_overlap.py
    # no torchrun (a fresh machine, `make demo`): spawn 2 gloo ranks on a free port
    python examples/moe_overlap.py --spawn 2

Each layer is an attention-like mixing linear, then a mixture of experts: a router picks
the top-k experts of every token, `comm.moe.dispatch` sends the tokens to the ranks that
own those experts, each rank runs its experts, `comm.moe.combine` brings the outputs back
weighted (`--fixed-capacity C`: `dispatch_fixed`/`combine_fixed`, fixed-size blocks
per expert and a batched matmul, no host read). The forward is plain model code:
`dbo.overlap(model)` splits the batch into two ubatches and, while one ubatch's
dispatch/combine is in flight, runs the other's compute.

It prints the checks (DBO bitwise equal to the same ubatches run in turn, allclose to the
whole batch), the median step time of the three modes with its spread, and the host time
blocked in collective waits (from `dbo.trace()`): the communication the overlap did not
hide. Each rank's Chrome trace (ui.perfetto.dev) and PNG timeline go to --out
(dbo-demo/); --json ends the output with one JSON line of the results. On CPU each rank
keeps a core of its own (--no-pin: share them all).
"""

from __future__ import annotations

import argparse

import _harness
import torch
import torch.distributed as dist
from _host_reads import HostReads

import comm
import dbo


class MoELayer(torch.nn.Module):
    """Mixing linear + top-k MoE; this rank holds experts [rank * E_local, (rank + 1) * E_local).

    Every rank builds the same shared weights and the same experts (one seed), so the
    model is identical whatever the number of ranks; each keeps only its own experts.
    """

    def __init__(
        self, hidden: int, ffn: int, num_experts: int, topk: int, seed: int,
        capacity: int | None = None,
    ) -> None:
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        generator = torch.Generator().manual_seed(seed)
        self.mix_in = torch.nn.Parameter(
            torch.randn(hidden, 4 * hidden, generator=generator) / hidden**0.5
        )
        self.mix_out = torch.nn.Parameter(
            torch.randn(4 * hidden, hidden, generator=generator) / (4 * hidden) ** 0.5
        )
        self.router = torch.nn.Parameter(torch.randn(hidden, num_experts, generator=generator))
        w1 = torch.randn(num_experts, hidden, ffn, generator=generator) / hidden**0.5
        w2 = torch.randn(num_experts, ffn, hidden, generator=generator) / ffn**0.5
        self.num_experts, self.topk, self.capacity = num_experts, topk, capacity
        self.num_local_experts = num_experts // world_size
        local = slice(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)
        self.w1 = torch.nn.Parameter(w1[local].contiguous())
        self.w2 = torch.nn.Parameter(w2[local].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(x @ self.mix_in) @ self.mix_out  # "attention": dense compute
        logits = x @ self.router
        weights, expert_ids = logits.topk(self.topk, dim=1)
        weights = torch.softmax(weights, dim=1)
        if self.capacity is not None:
            return x + self._fixed_shape_experts(x, expert_ids, weights)
        recv_x, recv_expert, handle = comm.moe.dispatch(x, expert_ids, self.num_experts)
        # Group the received rows by local expert without a host read: the sizes are
        # already on the host.
        order = torch.argsort(recv_expert, stable=True)
        grouped = recv_x.index_select(0, order).split(handle.rows_per_local_expert)
        outs = [
            torch.relu(rows @ self.w1[local]) @ self.w2[local]
            for local, rows in enumerate(grouped)
        ]
        expert_out = torch.empty_like(recv_x).index_copy_(0, order, torch.cat(outs))
        return x + comm.moe.combine(expert_out, handle, weights)

    def _fixed_shape_experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The fixed-shape path: no host read, shapes set by T, K, capacity and the world
        size. More rows than tokens can never be used, so a call takes min(capacity, T):
        the same on every rank here, since every rank has --tokens rows (dispatch_fixed
        needs one capacity on every rank)."""
        capacity = min(self.capacity, x.shape[0]) or 1
        blocks, _, handle = comm.moe.dispatch_fixed(
            x, expert_ids, self.num_experts, capacity, check_ids=False
        )
        # [E_local, W * capacity, H]: one batched matmul per weight, padding rows included.
        expert_out = torch.bmm(torch.relu(torch.bmm(blocks, self.w1)), self.w2)
        return comm.moe.combine_fixed(expert_out, handle, weights)


class MoEModel(torch.nn.Module):
    def __init__(
        self, num_layers: int, hidden: int, ffn: int, experts_per_rank: int, topk: int,
        capacity: int | None = None,
    ):
        super().__init__()
        num_experts = experts_per_rank * dist.get_world_size()
        self.layers = torch.nn.ModuleList(
            MoELayer(hidden, ffn, num_experts, topk, layer, capacity)
            for layer in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def rank_main(args: argparse.Namespace) -> None:
    """One rank's work: build the model, then compare the three modes (`_harness.compare`)."""
    rank, world_size, device = comm.init_distributed()  # launched by `_harness.launch`
    torch.manual_seed(1234 + rank)
    model = MoEModel(
        args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk,
        args.fixed_capacity,
    ).to(device)
    x = torch.randn(args.tokens, args.hidden, device=device)
    with torch.inference_mode(), HostReads().counting() as reads:
        model(x)
    overlapped = dbo.overlap(model, num_ubatches=2)

    def split_serial() -> torch.Tensor:
        """The two ubatches one after the other: the same work as DBO, no overlap."""
        return torch.cat([model(part) for part in x.tensor_split(2)])

    _harness.compare(
        "MoE forward", whole=lambda: model(x), split=split_serial,
        overlapped=lambda: overlapped(x), args=args, device=device,
        facts={
            "tokens": args.tokens, "num_ubatches": 2, "layers": args.layers,
            "hidden": args.hidden, "experts": args.experts_per_rank * world_size,
            "topk": args.topk, "path": "dynamic" if args.fixed_capacity is None else
            f"fixed-shape, capacity {args.fixed_capacity}", "host_reads_per_step": reads.reads,
        },
        # A capacity under --tokens drops tokens, and the whole batch drops other ones.
        exact_whole=args.fixed_capacity is None or args.fixed_capacity >= args.tokens,
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model's flags (the demo model by default): --layers, --tokens, --hidden, --ffn,
    --experts-per-rank, --topk."""
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default 4)")
    parser.add_argument(
        "--tokens", type=int, default=1024, help="tokens per rank per step (default 1024)"
    )
    parser.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--ffn", type=int, default=128, help="expert hidden width (default 128)")
    parser.add_argument(
        "--experts-per-rank", type=int, default=2, help="experts each rank holds (default 2)"
    )
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument(
        "--fixed-capacity", type=int, metavar="C", help="route through the fixed-shape path "
        "(comm.moe.dispatch_fixed) with C rows per rank and expert; C >= --tokens drops "
        "nothing (default: the dynamic path, comm.moe.dispatch)",
    )
    _harness.add_common_args(parser, default_out="dbo-demo")
    _harness.launch(rank_main, parser.parse_args())


if __name__ == "__main__":
    main()
