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
weighted. The forward is plain model code: `dbo.overlap(model)` splits the batch into
two ubatches and, while one ubatch's dispatch/combine is in flight, runs the other's
compute. The script checks that the overlapped output equals the serial one (bitwise
for the same ubatch split, allclose for the whole batch), prints the step times, and,
from a `dbo.trace()` of a few steps, how long the host sat blocked in collective waits
(`--trace-dir DIR` saves each rank's timeline for Perfetto / chrome://tracing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import comm  # noqa: E402
import dbo  # noqa: E402


class MoELayer(torch.nn.Module):
    """Mixing linear + top-k MoE; this rank holds experts [rank * E_local, (rank + 1) * E_local).

    Every rank builds the same shared weights and the same experts (one seed), so the
    model is identical whatever the number of ranks; each keeps only its own experts.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, seed: int) -> None:
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
        self.num_experts, self.topk = num_experts, topk
        self.num_local_experts = num_experts // world_size
        local = slice(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)
        self.w1 = torch.nn.Parameter(w1[local].contiguous())
        self.w2 = torch.nn.Parameter(w2[local].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(x @ self.mix_in) @ self.mix_out  # "attention": dense compute
        logits = x @ self.router
        weights, expert_ids = logits.topk(self.topk, dim=1)
        weights = torch.softmax(weights, dim=1)
        recv_x, recv_expert, handle = comm.moe.dispatch(x, expert_ids, self.num_experts)
        # Group the received rows by local expert without a host sync: the sizes are
        # already on the host (handle.num_recv_tokens_per_expert, [source rank, expert]).
        rows_per_expert = handle.num_recv_tokens_per_expert.sum(dim=0).tolist()
        order = torch.argsort(recv_expert, stable=True)
        grouped = recv_x.index_select(0, order).split(rows_per_expert)
        outs = [
            torch.relu(rows @ self.w1[local]) @ self.w2[local]
            for local, rows in enumerate(grouped)
        ]
        expert_out = torch.empty_like(recv_x).index_copy_(0, order, torch.cat(outs))
        return x + comm.moe.combine(expert_out, handle, weights)


class MoEModel(torch.nn.Module):
    def __init__(self, num_layers: int, hidden: int, ffn: int, experts_per_rank: int, topk: int):
        super().__init__()
        num_experts = experts_per_rank * dist.get_world_size()
        self.layers = torch.nn.ModuleList(
            MoELayer(hidden, ffn, num_experts, topk, seed=layer) for layer in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step_ms(fn: Any, device: torch.device) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


_TRACED_STEPS = 3


def _blocked_ms_per_step(timeline: dbo.Trace) -> float:
    blocked_s = sum(total.blocked_s for total in timeline.totals().values())
    return blocked_s * 1e3 / _TRACED_STEPS


def run(args: argparse.Namespace, backend: str | None = None) -> None:
    """One rank's work (under torchrun: NCCL on each rank's GPU when there is one, else
    gloo; or in a process that `--spawn` started: gloo on CPU)."""
    rank, world_size, device = comm.init_distributed(backend=backend, timeout_s=120)
    torch.manual_seed(1234 + rank)
    model = MoEModel(args.layers, args.hidden, args.ffn, args.experts_per_rank, args.topk)
    model = model.to(device)
    x = torch.randn(args.tokens, args.hidden, device=device)
    overlapped = dbo.overlap(model, num_ubatches=2)

    def split_serial() -> torch.Tensor:
        """The two ubatches one after the other: the same work as DBO, no overlap."""
        return torch.cat([model(part) for part in x.tensor_split(2)])

    with torch.inference_mode():
        serial_out = model(x)
        dbo_out = overlapped(x)
        bitwise = torch.equal(dbo_out, split_serial())
        close = torch.allclose(dbo_out, serial_out, rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {"whole": [], "split": [], "dbo": []}
        for _ in range(args.steps):  # interleaved, so all see the same conditions
            times["whole"].append(_step_ms(lambda: model(x), device))
            times["split"].append(_step_ms(split_serial, device))
            times["dbo"].append(_step_ms(lambda: overlapped(x), device))
        # Where the host sat blocked in collective waits: communication not hidden.
        blocked = {}
        for name, step in (("split", split_serial), ("dbo", lambda: overlapped(x))):
            with dbo.trace() as timeline:
                for _ in range(_TRACED_STEPS):
                    _step_ms(step, device)
            blocked[name] = _blocked_ms_per_step(timeline)
            if args.trace_dir and name == "dbo":
                os.makedirs(args.trace_dir, exist_ok=True)
                timeline.save(
                    os.path.join(args.trace_dir, f"dbo_rank{rank}.json"), f"rank {rank}"
                )

    summary = torch.tensor(
        [statistics.median(times[name]) for name in ("whole", "split", "dbo")]
        + [float(bitwise), float(close), blocked["split"], blocked["dbo"]],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.empty_like(summary) for _ in range(world_size)]
    dist.all_gather(gathered, summary)
    if rank == 0:
        table = torch.stack(gathered).cpu()
        whole, split, overlap = (table[:, column].max().item() for column in range(3))
        all_bitwise, all_close = bool(table[:, 3].all()), bool(table[:, 4].all())
        print(
            f"MoE forward: {world_size} ranks ({dist.get_backend()}, {device.type}), "
            f"{args.layers} layers, {args.tokens} tokens/rank, hidden {args.hidden}, "
            f"{args.experts_per_rank * world_size} experts, top-{args.topk}"
        )
        print(f"  DBO == serial on the same ubatch split (bitwise): {all_bitwise}")
        print(f"  DBO ~= serial on the whole batch (allclose):      {all_close}")
        print(f"  step time, median of {args.steps}, slowest rank:")
        print(f"    serial, whole batch               {whole:8.1f} ms")
        print(f"    serial, two ubatches in turn      {split:8.1f} ms")
        print(
            f"    DBO, two ubatches overlapped      {overlap:8.1f} ms   speedup "
            f"{whole / overlap:.2f}x over whole-batch serial, {split / overlap:.2f}x over "
            "the same ubatches in turn"
        )
        blocked_split, blocked_dbo = (table[:, column].max().item() for column in (5, 6))
        print(
            f"  host blocked in collective waits per step (dbo.trace), slowest rank:\n"
            f"    two ubatches in turn {blocked_split:6.1f} ms, DBO {blocked_dbo:6.1f} ms "
            "(communication the overlap did not hide; NCCL's waits do not block the host)"
        )
        if args.trace_dir:
            print(f"  DBO timelines: {args.trace_dir}/dbo_rank*.json (open in ui.perfetto.dev)")
        if not (all_bitwise and all_close):
            raise SystemExit("the overlapped forward does not match the serial one")
    comm.destroy_distributed()


def _spawned_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """Entry of a process `--spawn` started: the environment torchrun would give it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store, as torchrun does
    )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= world_size:
        os.sched_setaffinity(0, {cores[rank]})  # one core per rank, like one GPU per rank
    torch.set_num_threads(max(1, len(cores) // world_size))
    run(args, backend="gloo")  # CPU ranks, even where a GPU (fewer than N, maybe) is present


def spawn(world_size: int, args: argparse.Namespace) -> None:
    """Run `world_size` gloo ranks on this machine, without torchrun."""
    import torch.multiprocessing as mp

    # Bound to port 0: the OS picks a free port, and it stays ours while the ranks join.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    context = mp.start_processes(
        _spawned_rank, args=(world_size, store.port, args), nprocs=world_size,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + args.timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise SystemExit(f"the ranks did not finish within {args.timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spawn", type=int, metavar="N", help="start N gloo ranks (no torchrun)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--trace-dir", metavar="DIR", help="save each rank's DBO timeline (dbo.trace) here"
    )
    args = parser.parse_args()
    if args.spawn is not None:
        if args.spawn < 1:
            parser.error(f"--spawn needs at least 1 rank, got {args.spawn}")
        spawn(args.spawn, args)
        return
    try:
        run(args)
    except comm.TorchrunEnvironmentError as error:
        raise SystemExit(f"{error}\nor, without torchrun: python {sys.argv[0]} --spawn 2") from None


if __name__ == "__main__":
    main()
