"""How much of the communication DBO hides, on an emulated link (one process, CPU or GPU).

    .venv/bin/python benchmarks/overlap_efficiency.py [--layers 8] [--rounds 5]
    .venv/bin/python benchmarks/overlap_efficiency.py --device cuda     # on a GPU
    .venv/bin/python benchmarks/overlap_efficiency.py --compare-pinning # caller pinned too
    .venv/bin/python benchmarks/overlap_efficiency.py --configs 1:1:2,1:1:4 --json

Model: each ubatch runs `--layers` layers; a layer is a compute segment of c ms (torch
matmuls) followed by a transfer of m ms on one shared `comm.EmulatedLink` (FIFO, no CPU
used while "on the wire"). Serial runs the ubatches one after the other; DBO launches
the transfer, yields, and waits when the baton comes back.

    hidden fraction = (T_serial - T_dbo) / (T_serial - T_ideal)
    T_ideal = max(C, M) + min(c, m)   (C, M: compute and transfer totals, all ubatches)

1.0 means all the hideable communication was hidden; 0 means none. C is measured in the
same rounds (the same loop on a zero-latency link), not taken from the nominal c: the
matmuls' real duration drifts with the machine's load. Rounds interleave compute-only,
serial and DBO runs; the table shows medians and the measured c.

On CUDA the compute is bf16 GEMMs (`--dtype`) large enough to fill an H100/H200 on the
ubatch's compute stream, and a transfer is `EmulatedLink`'s sleep kernel on its comm
stream; the host only enqueues, and times are taken after `torch.cuda.synchronize()`.
The GPU is warmed up before the link is calibrated (its clock rises under load, and the
sleep kernel counts clock cycles). m is each transfer as it ran in the DBO rounds, timed
by events on the comm stream around it (`TransferTimes`; beside the GEMMs the sleep
kernel runs at other clocks than alone, reported as m_alone). Transfers on different comm
streams run at the same time (the link is FIFO per stream), so rows with m > c may pass 1.

`--compare-pinning` also times DBO with the caller's thread pinned to one CPU in the
same rounds (`dbo.overlap` then uses ubatch threads created on that CPU): every handoff
then wakes a thread on the core the previous one leaves.

The merge column is the cost of the default merge (torch.cat of the outputs) as a
fraction of T_dbo, measured separately. `--configs C:M:U,...` picks the rows (c ms, m ms,
ubatches); `--json` ends the output with one JSON line of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

import dbo
from comm import EmulatedLink

MATMUL_SHAPE = {"cpu": (96, 96, 96), "cuda": (4096, 1024, 4096)}
"""(M, K, N) of one matmul per device type: small enough that c is made of several, and
on CUDA large enough to fill the GPU (so that the two compute streams do not overlap)."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate_matmuls(target_s: float, a: torch.Tensor, b: torch.Tensor) -> int:
    """How many `a @ b` take about `target_s` in this thread."""
    for _ in range(20):
        torch.mm(a, b)
    synchronize(a.device)
    count = 200
    start = time.perf_counter()
    for _ in range(count):
        torch.mm(a, b)
    synchronize(a.device)
    per_matmul = (time.perf_counter() - start) / count
    return max(1, round(target_s / per_matmul))


def operands(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of one matmul on `device` (MATMUL_SHAPE)."""
    m, k, n = MATMUL_SHAPE[device.type]
    a = torch.randn(m, k, device=device).to(dtype)
    return a, (torch.randn(k, n, device=device) / k).to(dtype)


def warm_up_gpu(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> None:
    """Run matmuls for `seconds`, so that the GPU's clock has risen before calibrating."""
    a, b = operands(device, dtype)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            torch.mm(a, b)
        synchronize(device)


class TransferTimes:
    """Each transfer's time as it ran, bracketed by two timing events on its stream (the
    comm stream in an overlap): beside the other ubatch's GEMMs the sleep kernel runs at
    other clocks than alone, so the ideal uses these, not a transfer-only loop's."""

    def __init__(self, event_type: Callable[..., object] | None = None) -> None:
        self._event_type = event_type or (lambda: torch.cuda.Event(enable_timing=True))
        self._pairs: list[tuple[object, object]] = []

    def start(self) -> object:
        event = self._event_type()
        event.record()  # type: ignore[attr-defined]
        return event

    def stop(self, start: object) -> None:
        end = self._event_type()
        end.record()  # type: ignore[attr-defined]
        self._pairs.append((start, end))

    def take_mean_s(self) -> float:
        """The mean transfer time in seconds since the last call (after a synchronize)."""
        times = [start.elapsed_time(end) / 1000 for start, end in self._pairs]  # type: ignore[attr-defined]
        self._pairs = []
        return sum(times) / len(times) if times else float("nan")


def make_layer_loop(
    num_layers: int, num_matmuls: int, link: EmulatedLink, device: torch.device,
    dtype: torch.dtype = torch.float32, times: TransferTimes | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model: per layer, compute then a transfer (timed into `times` if given). The
    same code runs serially and in an overlap (every dbo call is a no-op outside one)."""
    a, b = operands(device, dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for _ in range(num_layers):
            for _ in range(num_matmuls):
                torch.mm(a, b)
            x = x + 1
            dbo.switch_to_comm()
            start = times.start() if times is not None else None
            handle = link.transfer(x)
            if times is not None:
                times.stop(start)
            dbo.yield_and_switch_to_compute()  # the other ubatch computes meanwhile
            x = handle.wait()
        return x

    return forward


def measure(
    c_ms: float,
    m_ms: float,
    num_ubatches: int,
    num_layers: int,
    rounds: int,
    num_matmuls: int,
    device: torch.device,
    compare_pinning: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    link = EmulatedLink(latency_s=m_ms / 1000)
    if device.type == "cuda":
        link.calibrate(device)  # not inside the first overlapped round
    compute_only_fn = make_layer_loop(num_layers, num_matmuls, EmulatedLink(0.0), device, dtype)
    serial_fn = make_layer_loop(num_layers, num_matmuls, link, device, dtype)
    transfer_only_fn = make_layer_loop(num_layers, 0, link, device, dtype)
    in_dbo = TransferTimes() if device.type == "cuda" else None
    dbo_fn = dbo.overlap(make_layer_loop(num_layers, num_matmuls, link, device, dtype, in_dbo),
                         num_ubatches=num_ubatches)
    x = torch.zeros(num_ubatches * 64, 256, device=device)
    parts = torch.tensor_split(x, num_ubatches)
    dbo_fn(x)  # warm up threads
    synchronize(device)
    if in_dbo is not None:
        in_dbo.take_mean_s()  # not the warm-up's

    def timed(run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        synchronize(device)
        return time.perf_counter() - start

    def pinned(run: Callable[[], object]) -> float:
        """`run` timed with the caller's thread pinned to one CPU (`dbo.overlap` then
        leases ubatch threads created there), the caller's CPUs restored after."""
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(cpus)})
        try:
            return timed(run)
        finally:
            os.sched_setaffinity(0, cpus)

    compute_times, serial_times, dbo_times, pinned_times, transfer_times = [], [], [], [], []
    transfers_in_dbo = []
    for _ in range(rounds):
        compute_times.append(timed(lambda: [compute_only_fn(p) for p in parts]))
        if device.type == "cuda":  # the sleep kernel's length follows the GPU's clock
            transfer_times.append(timed(lambda: [transfer_only_fn(p) for p in parts]))
        serial_times.append(timed(lambda: [serial_fn(p) for p in parts]))
        dbo_times.append(timed(lambda: dbo_fn(x)))
        if in_dbo is not None:  # synchronized by timed()
            transfers_in_dbo.append(in_dbo.take_mean_s())
        if compare_pinning:
            pinned_times.append(pinned(lambda: dbo_fn(x)))
    outputs = [serial_fn(p) for p in parts]
    merge = statistics.median(timed(lambda: torch.cat(outputs)) for _ in range(rounds))
    t_serial, t_dbo = statistics.median(serial_times), statistics.median(dbo_times)
    total_c = statistics.median(compute_times)
    c = total_c / (num_layers * num_ubatches)
    m = m_ms / 1000  # a CPU transfer lasts exactly m: a timer
    m_alone = m
    if transfer_times:
        m_alone = statistics.median(transfer_times) / (num_layers * num_ubatches)
    if transfers_in_dbo:  # as the transfers ran beside the GEMMs, by events
        m = statistics.median(transfers_in_dbo)
    total_m = m * num_layers * num_ubatches
    t_ideal = max(total_c, total_m) + min(c, m)
    t_pinned = statistics.median(pinned_times) if pinned_times else float("nan")
    return {
        "hidden_pinned": (t_serial - t_pinned) / (t_serial - t_ideal),
        "c_ms": c * 1000,
        "m_real_ms": m * 1000,
        "m_alone_ms": m_alone * 1000,
        "serial_ms": t_serial * 1000,
        "dbo_ms": t_dbo * 1000,
        "ideal_ms": t_ideal * 1000,
        "speedup": t_serial / t_dbo,
        "hidden": (t_serial - t_dbo) / (t_serial - t_ideal),
        "merge": merge / t_dbo,
    }


DEFAULT_CONFIGS = (
    [(c, c, 2) for c in (0.25, 0.5, 1.0, 2.0, 4.0)]
    + [(1.0, 2.0, 2), (2.0, 1.0, 2), (0.5, 2.0, 2), (2.0, 0.5, 2)]
    + [(1.0, 1.0, 3), (1.0, 1.0, 4), (2.0, 2.0, 3), (2.0, 2.0, 4)]
)
"""(c ms, m ms, ubatches) of each row by default."""


def parse_configs(text: str) -> list[tuple[float, float, int]]:
    """`C:M:U,...` as [(c ms, m ms, ubatches), ...]."""
    configs = []
    for item in text.split(","):
        c_ms, m_ms, num_ubatches = item.split(":")
        configs.append((float(c_ms), float(m_ms), int(num_ubatches)))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"),
        help="the matmuls' dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--compare-pinning", action="store_true",
        help="also time DBO with the caller's thread pinned to one CPU (Linux)",
    )
    parser.add_argument(
        "--configs", type=parse_configs, default=DEFAULT_CONFIGS, metavar="C:M:U,...",
        help="rows to measure: compute ms, transfer ms, ubatches (default: a sweep)",
    )
    parser.add_argument(
        "--json", action="store_true", help="end with one JSON line of the results"
    )
    args = parser.parse_args()
    if args.compare_pinning and not hasattr(os, "sched_setaffinity"):
        parser.error("--compare-pinning needs os.sched_setaffinity (Linux)")
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(1)
    if device.type == "cuda":
        warm_up_gpu(device, dtype)
    matmuls_per_ms = calibrate_matmuls(0.001, *operands(device, dtype)) or 1
    shape = "x".join(map(str, MATMUL_SHAPE[device.type]))
    print(
        f"{device}: {args.layers} layers per ubatch, {shape} {dtype_name} matmuls; "
        "c = compute, m = transfer per ubatch per layer"
    )
    header = (
        f"{'ubatches':>8} {'c ms':>6} {'real c':>6} {'m ms':>6} {'real m':>6} "
        f"{'serial ms':>10} {'dbo ms':>8} {'ideal ms':>9} {'speedup':>8} {'hidden':>7} {'merge':>6}"
        + (f" {'hidden, caller pinned':>22}" if args.compare_pinning else "")
    )
    print(header)
    rows = []
    for c_ms, m_ms, num_ubatches in args.configs:
        num_matmuls = max(1, round(c_ms * matmuls_per_ms))
        r = measure(
            c_ms, m_ms, num_ubatches, args.layers, args.rounds, num_matmuls, device,
            args.compare_pinning, dtype,
        )
        row = {"c_nominal_ms": c_ms, "m_ms": m_ms, "num_ubatches": num_ubatches, **r}
        if not args.compare_pinning:
            del row["hidden_pinned"]  # NaN: not measured
        rows.append(row)
        print(
            f"{num_ubatches:>8} {c_ms:>6.2f} {r['c_ms']:>6.2f} {m_ms:>6.2f} "
            f"{r['m_real_ms']:>6.2f} {r['serial_ms']:>10.2f} {r['dbo_ms']:>8.2f} "
            f"{r['ideal_ms']:>9.2f} {r['speedup']:>7.2f}x "
            f"{r['hidden']:>7.2f} {r['merge']:>6.1%}"
            + (f" {r['hidden_pinned']:>22.2f}" if args.compare_pinning else "")
        )
    dbo.close_default_runners()
    result: dict[str, object] = {
        "device": device.type, "dtype": dtype_name, "layers": args.layers, "rows": rows
    }
    if device.type == "cuda":
        result["cuda_alloc_retries"] = torch.cuda.memory_stats(device)["num_alloc_retries"]
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
