"""What the torchrun examples share: starting the ranks, the checks, the timing table, the traces.

    parser = argparse.ArgumentParser(description=...)
    _harness.add_common_args(parser, default_out="dbo-demo")
    args = parser.parse_args()
    _harness.launch(rank_main, args)        # rank_main(args) on every rank

    def rank_main(args):
        rank, world_size, device = comm.init_distributed()   # already up: same answer
        ...
        _harness.compare("MoE forward", whole=..., split=..., overlapped=..., args=args,
                         device=device, facts={"tokens": 1024, "num_ubatches": 2, ...})

Under torchrun each process is a rank as it stands; with `--spawn N` this machine starts
N gloo ranks on a free loopback port itself. On CPU each rank keeps cores of its own
(`--no-pin` opts out), as each GPU rank has a GPU of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import comm  # noqa: E402
import dbo  # noqa: E402

TRACED_STEPS = 3
"""Steps of each mode recorded with `dbo.trace()` for the blocked time."""

RankMain = Callable[[argparse.Namespace], None]


def add_common_args(parser: argparse.ArgumentParser, *, default_out: str) -> None:
    """The flags every example takes: --spawn, --steps, --timeout-s, --out, --json, --no-pin."""
    parser.add_argument(
        "--spawn", type=int, metavar="N",
        help="start N gloo ranks on this machine (a free loopback port), without torchrun",
    )
    parser.add_argument(
        "--steps", type=int, default=15, help="timed steps per mode (default %(default)s)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=120.0,
        help="seconds a collective waits for its peers, and --spawn for the ranks (default 120)",
    )
    parser.add_argument(
        "--out", metavar="DIR", default=default_out,
        help=f"where each rank's Chrome trace and PNG timeline go (default {default_out}/)",
    )
    parser.add_argument(
        "--json", action="store_true",
        help="end rank 0's output with one JSON line of the results",
    )
    parser.add_argument(
        "--no-pin", action="store_true",
        help="on CPU, leave each rank on every core instead of cores of its own",
    )


# ---------------------------------------------------------------------- starting the ranks
def launch(rank_main: RankMain, args: argparse.Namespace) -> None:
    """Run `rank_main(args)` on every rank, with the world initialized around it.

    Under torchrun: this process is one rank (NCCL on its GPU where CUDA is available,
    else gloo); without the torchrun environment it exits with a hint to use --spawn.
    With `args.spawn` N: N processes, gloo on CPU. Exits non-zero when a rank fails.
    """
    if args.spawn is None:
        _rank(rank_main, args, backend=None)
        return
    if args.spawn < 1:
        raise SystemExit(f"--spawn needs at least 1 rank, got {args.spawn}")
    import torch.multiprocessing as mp

    # Port 0: the OS picks a free port, and it stays ours while the ranks join: the
    # socket is bound and listening before they start, and the store serves on it after.
    listener = socket.create_server(("127.0.0.1", 0))
    # Forked, the ranks start with this process's imports instead of importing torch
    # again (seconds each). The parent has run no tensor op and started no thread of its
    # own yet: the store's server thread starts only once the ranks exist.
    context = mp.start_processes(
        _spawned_rank, args=(rank_main, args, listener.getsockname()[1]), nprocs=args.spawn,
        join=False, start_method="fork",
    )
    store = dist.TCPStore(  # noqa: F841 - serves the ranks' rendezvous while it lives
        "127.0.0.1", listener.getsockname()[1], args.spawn, is_master=True,
        wait_for_workers=False, master_listen_fd=listener.fileno(),
    )
    limit_s = args.timeout_s + 60  # start-up and the checks on top of the collectives
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise SystemExit(f"the ranks did not finish within {limit_s:g} s")
    except mp.ProcessRaisedException as error:
        raise SystemExit(f"a rank failed:\n{error}") from None
    except mp.ProcessExitedException as error:
        raise SystemExit(error.exit_code or 1) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _spawned_rank(
    local_rank: int, rank_main: RankMain, args: argparse.Namespace, port: int
) -> None:
    """Entry of a process `--spawn` started: the environment torchrun would give it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
        WORLD_SIZE=str(args.spawn), LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(args.spawn),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store, as torchrun does
    )
    _rank(rank_main, args, backend="gloo")  # CPU ranks, even where a GPU is present


def _rank(rank_main: RankMain, args: argparse.Namespace, backend: str | None) -> None:
    on_cuda = backend is None and torch.cuda.is_available()  # init_distributed's own choice
    args.pinned_cores = None if on_cuda else pin_cpu_rank(pin=not args.no_pin)
    try:
        comm.init_distributed(backend=backend, timeout_s=args.timeout_s)
    except comm.TorchrunEnvironmentError as error:
        raise SystemExit(f"{error}\nor, without torchrun: python {sys.argv[0]} --spawn 2") from None
    try:
        rank_main(args)
    finally:
        comm.destroy_distributed()


def pin_cpu_rank(pin: bool = True) -> list[int] | None:
    """Give this CPU rank cores of its own: an equal slice of the process's cores by
    LOCAL_RANK when there are at least LOCAL_WORLD_SIZE of them (unless `pin` is False),
    and as many intra-op threads as that slice has; returns the cores it pinned to (None:
    not pinned). Call before any thread starts: threads started later inherit the cores."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        return None  # fewer cores than ranks: leave the OS to share them
    torch.set_num_threads(per_rank)
    if not pin:
        return None
    mine = cores[local_rank * per_rank:(local_rank + 1) * per_rank]
    os.sched_setaffinity(0, mine)
    return mine


# ---------------------------------------------------------------------- comparing the modes
def step_ms(fn: Callable[[], Any], device: torch.device) -> float:
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _blocked_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, dbo.Trace]:
    """Host time per step blocked in collective waits over TRACED_STEPS steps, and the trace."""
    with dbo.trace() as timeline:
        for _ in range(TRACED_STEPS):
            step_ms(fn, device)
    blocked_s = sum(total.blocked_s for total in timeline.totals().values())
    return blocked_s * 1e3 / TRACED_STEPS, timeline


def gather(values: list[float], device: torch.device) -> torch.Tensor:
    """`values` of every rank, [world_size, len(values)] on the CPU."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered).cpu()


def compare(
    title: str,
    *,
    whole: Callable[[], torch.Tensor],
    split: Callable[[], torch.Tensor],
    overlapped: Callable[[], torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
    facts: dict[str, Any],
    exact_whole: bool = True,
) -> dict[str, Any]:
    """Check, time and trace the three modes on every rank (a collective); report on rank 0.

    `whole()`: the model on the whole batch; `split()`: the same ubatches one after the
    other; `overlapped()`: the `dbo.overlap` call. `facts` (must hold "tokens" and
    "num_ubatches") describe the run: printed after `title` and kept in the result.
    Checks `overlapped()` bitwise equal to `split()` and allclose to `whole()` on every
    rank (`exact_whole=False`: the whole batch is reported, not required, when it
    computes something else, such as other dropped tokens); times the modes interleaved
    over `args.steps` steps (per step the slowest rank);
    writes `args.out`/dbo_rank{r}.json and .png; returns the results (the --json object)
    on every rank. Raises SystemExit on every rank when a check fails.
    """
    for key in ("tokens", "num_ubatches"):
        if key not in facts:
            raise KeyError(f"compare() needs facts[{key!r}]")
    rank = dist.get_rank()
    modes = {"whole": whole, "split": split, "dbo": overlapped}
    with torch.inference_mode():
        reference, in_turn, result = whole(), split(), overlapped()
        bitwise = torch.equal(result, in_turn)
        max_diff = (result.double() - reference.double()).abs().max().item()
        close = torch.allclose(result, reference, rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(args.steps):  # interleaved, so all modes see the same conditions
            for name, fn in modes.items():
                times[name].append(step_ms(fn, device))
        blocked, timelines = {}, {}
        for name, fn in modes.items():
            blocked[name], timelines[name] = _blocked_ms(fn, device)
        with dbo.trace() as picture:  # one step: the alternation is readable
            step_ms(overlapped, device)
    files, plot_error = write_traces(args.out, rank, timelines["dbo"], picture)
    # Per step and mode the slowest rank; the blocked time of the rank blocked longest.
    slowest_ms = gather([t for name in modes for t in times[name]], device).max(dim=0).values
    per_mode = dict(zip(modes, slowest_ms.view(len(modes), args.steps).tolist(), strict=True))
    checks = gather([float(bitwise), float(close), max_diff], device)
    blocked_max = gather([blocked[name] for name in modes], device).max(dim=0).values.tolist()
    summary = _summarize(per_mode, blocked_max, checks, args, device, facts)
    if rank == 0:
        _report(title, summary, per_mode, files, plot_error, args)
    if not (summary["bitwise_equal"] and (summary["allclose_vs_unsplit"] or not exact_whole)):
        raise SystemExit("the overlapped forward does not match the serial one")
    return summary


def _summarize(
    per_mode: dict[str, list[float]], blocked_max: list[float], checks: torch.Tensor,
    args: argparse.Namespace, device: torch.device, facts: dict[str, Any],
) -> dict[str, Any]:
    """The --json object: the world, the medians and speedups, the blocked times, the checks."""
    pinned = getattr(args, "pinned_cores", None)  # set by launch()
    medians = {name: statistics.median(values) for name, values in per_mode.items()}
    return {
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "pinned_cores_per_rank": len(pinned) if pinned else None,
        "num_ubatches": facts["num_ubatches"], "tokens": facts["tokens"],
        "steps": args.steps,
        "serial_ms": medians["whole"], "split_ms": medians["split"], "dbo_ms": medians["dbo"],
        "speedup": medians["whole"] / medians["dbo"],
        "speedup_vs_split": medians["split"] / medians["dbo"],
        "blocked_serial_ms": blocked_max[0], "blocked_split_ms": blocked_max[1],
        "blocked_dbo_ms": blocked_max[2],
        "bitwise_equal": bool(checks[:, 0].all()), "allclose_vs_unsplit": bool(checks[:, 1].all()),
        "max_abs_diff_vs_unsplit": checks[:, 2].max().item(),
        **facts,
    }


def write_traces(
    out: str, rank: int, timeline: dbo.Trace, picture: dbo.Trace, *, name: str = "dbo",
    title: str = "one DBO step",
) -> tuple[list[str], str]:
    """This rank's Chrome trace of `timeline` (`out`/{name}_rank{r}.json) and a PNG of
    `picture` titled `title`. Returns the paths rank 0 names (every rank's, by the same
    pattern: traces, then PNGs) and, where matplotlib is missing, why there are no PNGs
    (the checks and the table go on)."""
    os.makedirs(out, exist_ok=True)
    timeline.save(os.path.join(out, f"{name}_rank{rank}.json"), f"rank {rank}")
    ranks = range(dist.get_world_size())
    files = [os.path.join(out, f"{name}_rank{r}.json") for r in ranks]
    try:
        picture.plot(os.path.join(out, f"{name}_rank{rank}.png"), f"{title}, rank {rank}")
    except ImportError as error:
        return files, str(error)
    return files + [os.path.join(out, f"{name}_rank{r}.png") for r in ranks], ""


def _spread(values: list[float]) -> str:
    """The interquartile range of the steps."""
    if len(values) < 2:
        return f"{values[0]:.1f}-{values[0]:.1f}"
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return f"{low:.1f}-{high:.1f}"


def _report(
    title: str, summary: dict[str, Any], per_mode: dict[str, list[float]], files: list[str],
    plot_error: str, args: argparse.Namespace,
) -> None:
    facts = {key: value for key, value in summary.items() if key not in _RESULT_KEYS}
    print(f"{title}: " + ", ".join(f"{key} {value}" for key, value in facts.items()))
    cores = summary["pinned_cores_per_rank"]
    placement = f", each rank pinned to {cores} core(s) of its own" if cores else ""
    print(
        f"  world: {summary['world_size']} ranks, {summary['backend']} on {summary['device']}"
        f"{placement}"
    )
    print(f"  DBO == the same ubatches in turn (bitwise): {summary['bitwise_equal']}")
    print(
        f"  DBO ~= the whole batch (allclose):          {summary['allclose_vs_unsplit']} "
        f"(max abs diff {summary['max_abs_diff_vs_unsplit']:.2e})"
    )
    n = len(next(iter(per_mode.values())))
    print(f"  {n} steps per mode, slowest rank per step; blocked: host time in collective waits")
    print(f"    {'mode':<28}{'median ms':>10}{'IQR ms':>14}{'speedup':>9}{'blocked ms':>12}")
    labels = {"whole": "whole batch", "split": "same ubatches in turn", "dbo": "DBO (dbo.overlap)"}
    blocked = {"whole": "blocked_serial_ms", "split": "blocked_split_ms", "dbo": "blocked_dbo_ms"}
    for name, label in labels.items():
        median = statistics.median(per_mode[name])
        print(
            f"    {label:<28}{median:>10.1f}{_spread(per_mode[name]):>14}"
            f"{summary['serial_ms'] / median:>8.2f}x{summary[blocked[name]]:>12.1f}"
        )
    print(
        f"  DBO: {summary['speedup_vs_split']:.2f}x over the same ubatches in turn, "
        f"{summary['speedup']:.2f}x over the whole batch"
    )
    print("  " + _interpretation(summary))
    print_files(files, plot_error)
    if args.json:
        print(json.dumps(summary))


def print_files(files: list[str], plot_error: str) -> None:
    """Name the traces and PNG timelines written (or why no PNG was drawn)."""
    traces = [path for path in files if path.endswith(".json")]
    pictures = [path for path in files if path.endswith(".png")]
    print(f"  traces (ui.perfetto.dev or chrome://tracing): {', '.join(traces)}")
    print(f"  timelines (PNG): {', '.join(pictures) or 'not drawn: ' + plot_error}")


_RESULT_KEYS = {  # the --json keys that are results, not facts of the run
    "world_size", "backend", "device", "pinned_cores_per_rank", "steps", "serial_ms",
    "split_ms", "dbo_ms", "speedup", "speedup_vs_split", "blocked_serial_ms",
    "blocked_split_ms", "blocked_dbo_ms", "bitwise_equal", "allclose_vs_unsplit",
    "max_abs_diff_vs_unsplit",
}


def _interpretation(summary: dict[str, Any]) -> str:
    """One sentence on what the numbers mean on this device and backend."""
    hidden = f"{summary['blocked_split_ms']:.1f} -> {summary['blocked_dbo_ms']:.1f} ms"
    if summary["backend"] == "nccl":
        return (
            "On GPUs with NCCL the transfers run on their own stream beside the other "
            "ubatch's kernels and the host does not block in their waits, so the gain "
            f"shows in the step time (blocked {hidden})."
        )
    if summary["device"] == "cpu":
        return (
            f"On a CPU with {summary['backend']} the transfers use the same cores as the "
            "compute, so the gain over the whole batch is small; the blocked time shows "
            f"what DBO hid ({hidden} per step)."
        )
    return f"Blocked time per step {hidden}: the communication DBO hid."
