"""One NCCL rank (run by tests/gpu/test_cuda_streams.py under torchrun --standalone).

Exercises what only NCCL does: per-ubatch duplicate communicators (created and connected
outside the overlap), collectives launched on the comm stream and waited on the device,
`record_stream` of their tensors, and MoE dispatch/combine, each compared bitwise with
the same calls made serially on the same ubatch split; then a backward through an
overlapped MoE layer (its order-token chain) against the serial gradients; a collective
made on a side stream; a collective an aborted ubatch never waited. Producers run late
(`torch.cuda._sleep` first) and outputs start as NaN: a missing wait reads wrong data.
"""

from __future__ import annotations

import sys

import torch

import comm
import dbo

_LATE = 20_000_000  # cycles a late producer spins first: milliseconds on any GPU


def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Outputs start as NaN, not as whatever memory empty_like reuses: a result read
    # before its collective wrote it (a missing stream wait) cannot then pass for right.
    if x.is_cuda:
        torch.cuda._sleep(_LATE)  # the producers below are late
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


def side_stream_collective_matches(device: torch.device) -> bool:
    """A collective inside `with torch.cuda.stream(side)` reads what `side` produced, and
    the rest of the block stays on `side`."""
    stayed: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        produced = torch.full_like(x, float("nan"))
        out = torch.full_like(x, float("nan"))
        with torch.cuda.stream(side):
            torch.cuda._sleep(_LATE)
            produced.copy_(x * 3)
            comm.all_to_all_single(out, produced)
            stayed.append(torch.cuda.current_stream() == side)
            out.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        return out

    x = torch.randn(4096, 64, device=device)
    y = dbo.overlap(fn, timeout_s=60)(x)
    torch.cuda.synchronize()
    return stayed == [True, True] and torch.equal(y, x * 3 + 1)


def aborted_collective_is_joined(device: torch.device) -> bool:
    """Ubatch 1 fails while ubatch 0's all-to-all is in flight: the caller's stream, right
    after the error, reads the whole transfer (it waits for NCCL's work)."""
    source = torch.arange(1 << 26, dtype=torch.float32, device=device)  # 256 MB
    out = torch.full_like(source, float("nan"))

    def fn(x: torch.Tensor) -> torch.Tensor:
        if dbo.current_ubatch_id() == 1:
            raise ValueError("ubatch 1 fails")
        torch.cuda._sleep(_LATE)  # the transfer starts late, as the caller's read would
        comm.all_to_all_single(out, source)  # yields while in flight: ubatch 1 fails
        return x

    try:
        dbo.overlap(fn, timeout_s=60)(torch.zeros(2, device=device))
    except ValueError:
        pass
    else:
        return False
    seen = out.clone()  # on the caller's stream
    torch.cuda.synchronize()
    return torch.equal(seen, source)


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
    if not side_stream_collective_matches(device):
        print("a collective on a side stream: wrong data, or the block left its stream")
        return 1
    if not aborted_collective_is_joined(device):
        print("a collective an aborted ubatch left in flight: the caller read it unfinished")
        return 1
    comm.destroy_distributed()
    print("nccl world: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
