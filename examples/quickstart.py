"""The smallest DBO program: one process, an emulated network link, no torchrun.

    python examples/quickstart.py

Each layer computes, then sends its activations over `comm.EmulatedLink` (a fixed
latency; no CPU is used while the data is "on the wire"). Inside `dbo.overlap` the
`dbo.yield_()` after the send lets the other ubatch compute while the transfer is in flight.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comm  # noqa: E402
import dbo  # noqa: E402

torch.manual_seed(0)
weights = [torch.randn(256, 256) / 16 for _ in range(8)]
link = comm.EmulatedLink(latency_s=0.002)  # every transfer takes 2 ms


def model(x: torch.Tensor) -> torch.Tensor:
    for w in weights:
        x = torch.tanh(x @ w)  # compute
        handle = link.transfer(x)  # send ...
        dbo.yield_()  # ... and let the other ubatch run meanwhile (a no-op outside an overlap)
        x = handle.wait()
    return x


def best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


x = torch.randn(2048, 256)
overlapped = dbo.overlap(model, num_ubatches=2)  # x split in 2 ubatches, run overlapped


def in_turn() -> torch.Tensor:  # the same 2 ubatches, one after the other
    return torch.cat([model(part) for part in x.tensor_split(2)])


with torch.inference_mode():
    same = torch.equal(overlapped(x), in_turn())
    serial_ms, dbo_ms = best_ms(in_turn), best_ms(lambda: overlapped(x))
print(f"two ubatches in turn {serial_ms:6.1f} ms (best of 5)")
print(f"two ubatches, DBO    {dbo_ms:6.1f} ms   speedup {serial_ms / dbo_ms:.2f}x")
print(f"DBO == in turn (bitwise): {same}")
sys.exit(0 if same else 1)
