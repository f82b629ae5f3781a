"""One NCCL rank (run by tests/gpu/test_cuda_streams.py under torchrun --standalone).

Exercises what only NCCL does: per-ubatch duplicate communicators (created and connected
outside the overlap), collectives launched on the comm stream and waited on the device,
`record_stream` of their tensors, and MoE dispatch/combine, each compared bitwise with
the same calls made serially on the same ubatch split; then a backward through an
overlapped MoE layer (its order-token chain) against the serial gradients.
"""

from __future__ import annotations

import sys

import torch

import comm
import dbo


def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Outputs start as NaN, not as whatever memory empty_like reuses: a result read
    # before its collective wrote it (a missing stream wait) cannot then pass for right.
    reduced = x.clone()
    comm.all_reduce(reduced)
    moved = torch.full_like(x, float("nan"))
    comm.all_to_all_single(moved, x)
    gathered = torch.full_like(x, float("nan"))
    comm.all_gather_into_tensor(gathered, x)
    scattered = torch.full_like(x, float("nan"))
    comm.reduce_scatter_tensor(scattered, x.clone())
    late = x * 3
    work = comm.all_reduce(late, async_op=True)
    between = x.sum(dim=1, keepdim=True)  # compute placed between launch and wait
    assert work is not None
    work.wait()
    ids = (x[:, :2].abs() * 7).long() % 4
    recv, _, handle = comm.moe.dispatch(x, ids, num_experts=4)
    combined = comm.moe.combine(recv * 2, handle, torch.full(ids.shape, 0.5, device=x.device))
    return reduced, moved, gathered, scattered, late, between, combined


def backward_matches_serial(device: torch.device) -> bool:
    """Training through an overlapped MoE layer: the order-token chain (exchanges
    launched async inside the autograd Function, waited after) gives the serial
    gradients on the device's streams."""
    weight = torch.randn(64, 64, device=device, requires_grad=True)
    gates = torch.full((256, 2), 0.5, device=device)

    def layer(h: torch.Tensor) -> torch.Tensor:
        ids = (h[:, :2].detach().abs() * 7).long() % 4
        recv, _, handle = comm.moe.dispatch(h, ids, num_experts=4)
        out = torch.tanh(recv @ weight)
        return comm.moe.combine(out, handle, gates[: h.shape[0]])

    x = torch.randn(512, 64, device=device, requires_grad=True)
    serial = torch.cat([layer(part) for part in x.tensor_split(2)])
    expected = torch.autograd.grad(serial.pow(2).sum(), [x, weight])
    overlapped = dbo.overlap(layer, timeout_s=60)(x)
    got = torch.autograd.grad(overlapped.pow(2).sum(), [x, weight])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return torch.equal(overlapped, serial) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, expected)
    )


def main() -> int:
    rank, world_size, device = comm.init_distributed(backend="nccl")
    assert device.type == "cuda" and world_size == 1, (device, world_size)
    duplicates = comm.ubatch_groups(None, 2)
    assert len(duplicates) == 2
    x = torch.randn(4096, 64, device=device)
    expected = [step(part) for part in x.tensor_split(2)]
    got = dbo.overlap(step, merge=dbo.merge_parts, timeout_s=60)(x)
    torch.cuda.synchronize()
    for ubatch, (want, have) in enumerate(zip(expected, got)):
        for index, (a, b) in enumerate(zip(want, have)):
            if not torch.equal(a, b):
                print(f"ubatch {ubatch}, output {index}: overlapped != serial")
                return 1
    if not backward_matches_serial(device):
        print("MoE backward through an overlap: gradients differ from serial")
        return 1
    comm.destroy_distributed()
    print("nccl world: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
