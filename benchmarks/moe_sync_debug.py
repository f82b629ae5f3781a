"""The fixed-shape MoE path, overlapped, under `torch.cuda.set_sync_debug_mode("error")`.

    torchrun --standalone --nproc-per-node 1 benchmarks/moe_sync_debug.py --json   # NCCL

An overlapped forward of `--layers` MoE layers (router, `comm.moe.dispatch_fixed` with
`check_ids=False`, a batched matmul over the [E_local, W * capacity, H] layout,
`comm.moe.combine_fixed`) runs `--steps` times while torch raises on any synchronizing
CUDA call (`.item()`, `.tolist()`, a device-to-host copy, a synchronize) made in any
thread: the model's, dbo's or comm's. Two warm-up steps run before, in the default mode
(they connect the communicators and grow the workspace); the outputs are then checked
bitwise equal to the same ubatches run one after the other. torch does not cover
synchronizing calls inside torch.distributed (its docs say so). Exit status 1 on a sync
(the JSON line holds the error and its innermost frames, stderr the traceback) or a
mismatch. On CPU (gloo) the same steps run without
the sync check: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

import comm
import dbo


def make_model(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-ubatch forward; every rank builds the same layers and keeps its experts."""
    generator = torch.Generator().manual_seed(0)
    hidden, ffn, local = args.hidden, args.ffn, args.experts_per_rank
    num_experts = local * world_size
    mine = slice(rank * local, (rank + 1) * local)
    layers = []
    for _ in range(args.layers):
        router = torch.randn(hidden, num_experts, generator=generator)
        w1 = torch.randn(num_experts, hidden, ffn, generator=generator) / hidden**0.5
        w2 = torch.randn(num_experts, ffn, hidden, generator=generator) / ffn**0.5
        layers.append((router.to(device), w1[mine].to(device), w2[mine].to(device)))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for router, w1, w2 in layers:
            weights, ids = (x @ router).topk(args.topk, dim=1)
            recv_x, _, handle = comm.moe.dispatch_fixed(
                x, ids, num_experts, args.capacity, check_ids=False
            )
            expert_out = torch.bmm(torch.relu(torch.bmm(recv_x, w1)), w2)
            x = x + comm.moe.combine_fixed(expert_out, handle, torch.softmax(weights, dim=1))
        return x

    return forward


@contextlib.contextmanager
def syncs_raise(device: torch.device) -> Iterator[None]:
    """Synchronizing CUDA calls raise inside (process-wide: every thread); nothing on CPU."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(args: argparse.Namespace) -> dict[str, object]:
    rank, world_size, device = comm.init_distributed(timeout_s=60)
    try:
        forward = make_model(args, rank, world_size, device)
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
        x = x.to(device)
        expected = torch.cat([forward(part) for part in x.tensor_split(2)])
        overlapped = dbo.overlap(forward, num_ubatches=2, timeout_s=60)
        for _ in range(2):
            overlapped(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result: dict[str, object] = {
            "rank": rank, "backend": dist.get_backend(), "device": device.type,
            "world_size": world_size, "tokens": args.tokens, "capacity": args.capacity,
            "layers": args.layers, "steps": args.steps,
            "sync_checked": device.type == "cuda", "sync_error": None,
        }
        got = expected
        try:
            with syncs_raise(device):
                for _ in range(args.steps):
                    got = overlapped(x)
        except RuntimeError as error:  # the traceback shows where the call was made
            traceback.print_exc()
            frames = traceback.extract_tb(error.__traceback__)[-3:]
            where = "; ".join(f"{frame.filename}:{frame.lineno} {frame.name}" for frame in frames)
            result["sync_error"] = f"{type(error).__name__}: {error} (at {where})"
        result["bitwise_equal"] = result["sync_error"] is None and torch.equal(got, expected)
        if device.type == "cuda":
            result["cuda_alloc_retries"] = torch.cuda.memory_stats(device)["num_alloc_retries"]
        return result
    finally:
        dbo.close_default_runners()
        comm.destroy_distributed()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    parser.add_argument(
        "--capacity", type=int, help="rows per (source rank, expert); default --tokens"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="steps under the sync check")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    args.capacity = args.capacity or args.tokens  # >= the tokens: nothing is dropped
    with torch.no_grad():  # decode: no autograd graph
        result = run(args)
    if result["sync_error"]:
        verdict = f"a synchronizing call: {result['sync_error']}"
    else:
        verdict = ("no synchronizing call" if result["sync_checked"] else "no sync check on CPU")
        verdict += f"; bitwise equal to the serial ubatches: {result['bitwise_equal']}"
    if result["rank"] == 0:
        print(f"fixed-shape MoE, {args.steps} overlapped steps on {result['device']} "
              f"({result['backend']}, {result['world_size']} ranks): {verdict}")
        if args.json:
            print(json.dumps(result))
    return 0 if result["sync_error"] is None and result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
