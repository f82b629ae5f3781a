"""Every benchmark and example in one run, summed up in one Markdown table of ratios.

    .venv/bin/python benchmarks/run_all.py                 # the full run (make bench): minutes
    .venv/bin/python benchmarks/run_all.py --quick         # fewer rounds: a couple of minutes
    .venv/bin/python benchmarks/run_all.py --only handoff,overlap --out DIR

Each item runs as a subprocess with `--json` and a timeout; a progress line per item goes
to stderr. Printed: the date, the machine and the command, then the table (what is
compared, the ratio, what the ratio means and the goal where there is one), ready to
paste into the README. Written into `--out` (default bench-out/): each item's output
(`<item>.log`) and result (`<item>.json`), the table (`table.md`), and
`overlap_efficiency.png`, the fraction of the hideable communication hidden against the
segment size c = m, one line per ubatch count, the ideal marked. A failed item leaves a
row saying so and makes the exit status 1; an example that is not there is skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OVERLAP_SIZES_MS = (0.25, 1.0, 4.0)
OVERLAP_UBATCHES = (2, 3, 4)
Row = tuple[str, str, str]
"""(what is compared, the ratio, what the ratio means / the goal)."""


@dataclass(frozen=True)
class Item:
    name: str
    script: str  # relative to the repository root
    full: tuple[str, ...]  # arguments of the full run, --json added
    quick: tuple[str, ...]  # arguments of --quick
    rows: Callable[[dict[str, Any]], list[Row]]


def _workspace_rows(result: dict[str, Any]) -> list[Row]:
    by_device: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_device.setdefault(row["device"], []).append(row)
    return [
        (
            "workspace `get_simultaneous` vs `torch.empty`, 3 tensors, "
            + " / ".join(row["case"] for row in rows) + f" ({device})",
            " / ".join(f"{row['workspace_us'] / row['empty_us']:.2f}" for row in rows),
            "time per call over torch.empty's; < 1: cheaper than allocating (goal)",
        )
        for device, rows in by_device.items()
    ]


def _handoff_rows(result: dict[str, Any]) -> list[Row]:
    us = result["us_per_handoff"]
    return [(
        "baton handoff (`dbo.yield_`) vs a raw `_thread` lock ping-pong / a `threading.Event` "
        "ring", f"{us['dbo'] / us['raw_lock']:.2f} / {us['dbo'] / us['event_ring']:.2f}",
        "time per handoff over theirs; goal <= 1 against the lock",
    )]


def _wakeup_rows(result: dict[str, Any]) -> list[Row]:
    if "skipped" in result:
        return [("eventfd vs lock wake-ups", "skipped", result["skipped"])]
    rows = [row for row in result["rows"] if row["call"] in ("identity", "100 handoffs")]
    return [(
        "baton wake-ups, eventfd vs `_thread` lock: " + " / ".join(row["call"] for row in rows),
        " / ".join(f"{row['eventfd_over_lock']:.2f}" for row in rows),
        "time per call, eventfd (the Linux default) over locks; < 1: eventfd faster",
    )]


def _overlap_rows(result: dict[str, Any]) -> list[Row]:
    """One row: per ubatch count (separated by ';'), the hidden fraction at each size."""
    counts = sorted({row["num_ubatches"] for row in result["rows"]})
    per_count = []
    for num_ubatches in counts:
        hidden = {
            row["m_ms"]: row["hidden"] for row in result["rows"]
            if row["num_ubatches"] == num_ubatches and row["c_nominal_ms"] == row["m_ms"]
        }
        per_count.append(" / ".join(f"{hidden[size]:.2f}" for size in sorted(hidden)))
    sizes = sorted({row["m_ms"] for row in result["rows"] if row["c_nominal_ms"] == row["m_ms"]})
    return [(
        "overlap on an emulated link, " + " ; ".join(map(str, counts)) + " ubatches, c = m = "
        + " / ".join(f"{size:g}" for size in sizes) + " ms",
        " ; ".join(per_count),
        "hidden fraction (serial - DBO) / (serial - ideal); 1 = all hideable comm hidden",
    )]


def _host_rows(result: dict[str, Any]) -> list[Row]:
    rows = result["rows"]
    return [(
        "host cost per call: " + " / ".join(row["label"] for row in rows),
        " / ".join(f"{row['ours_us'] / row['bare_us']:.2f}" for row in rows),
        "host time over the bare op's (1 = nothing added; "
        + " / ".join(f"{row['added_us']:+.1f}" for row in rows) + " us per call)",
    )]


def _comm_rows(result: dict[str, Any]) -> list[Row]:
    rows = result["rows"]
    labels = " / ".join(row["label"] for row in rows)
    intervals = ", ".join(
        f"{row['dbo/pipeline lo']:.2f}-{row['dbo/pipeline hi']:.2f}"
        for row in rows if row.get("dbo/pipeline lo") is not None
    )
    return [
        (f"gloo all-to-all loop, {labels}: DBO vs the hand-written pipeline",
         " / ".join(f"{row['dbo/pipeline']:.2f}" for row in rows),
         "DBO's step time over the pipeline's, same rounds; goal ~1"
         + (f" (95% CI {intervals})" if intervals else " (no CI under 6 rounds)")),
        (f"gloo all-to-all loop, {labels}: DBO vs serial",
         " / ".join(f"{row['serial'] / row['dbo']:.2f}x" for row in rows),
         "speedup over the ubatches one after the other, blocking collectives"),
    ]


def _moe_path_rows(result: dict[str, Any]) -> list[Row]:
    by_path: dict[str, dict[int, dict[str, Any]]] = {"dynamic": {}, "fixed": {}}
    for row in result["rows"]:
        by_path[row["path"]][row["tokens"]] = row
    sizes = sorted(by_path["fixed"])
    reads = {path: by_path[path][sizes[0]]["host_reads_per_step"] for path in by_path}
    return [(
        "MoE example at " + " / ".join(map(str, sizes)) + " tokens per rank: fixed-shape vs "
        "dynamic path, whole batch; DBO",
        " / ".join(f"{by_path['fixed'][t]['whole_ms'] / by_path['dynamic'][t]['whole_ms']:.2f}"
                   for t in sizes) + "; " +
        " / ".join(f"{by_path['fixed'][t]['dbo_ms'] / by_path['dynamic'][t]['dbo_ms']:.2f}"
                   for t in sizes),
        f"step time over the dynamic path's; host reads per whole-batch step {reads['fixed']} "
        f"(fixed) vs {reads['dynamic']} (dynamic): on a GPU each read waits for the device",
    )]


def _example_rows(name: str, goals: bool) -> Callable[[dict[str, Any]], list[Row]]:
    def rows(result: dict[str, Any]) -> list[Row]:
        blocked = result["blocked_split_ms"] / max(result["blocked_dbo_ms"], 1e-9)
        return [(
            f"{name}: DBO vs the same ubatches in turn / blocked time, in turn over DBO / "
            "DBO vs the whole batch",
            f"{result['speedup_vs_split']:.2f}x / {blocked:.1f}x / {result['speedup']:.2f}x",
            "speedups and communication hidden" + ("; goals >= 1.3x / >= 3x" if goals else "")
            + "; the whole-batch gain is small on a CPU (gloo's transfers share the cores)",
        )]

    return rows


def _example(name: str, script: str, steps: str, goals: bool = False) -> Item:
    return Item(
        name, script, ("--spawn", "2"), ("--spawn", "2", "--steps", steps),
        _example_rows(f"`{script.split('/')[-1]}`", goals),
    )


def _generate_rows(result: dict[str, Any]) -> list[Row]:
    copies = result.get("cache_bytes_per_decode_step") or {}
    copied = (f"; KV cache bytes written per decode step: {copies['dbo'] / 1e3:.0f} kB vs "
              f"transformers' {copies['transformers'] / 1e3:.0f} kB" if copies else "")
    return [(
        f"`generate.py`, {result['batch']} prompts per rank, {result['new_tokens']} tokens: "
        "decode DBO vs the same ubatches in turn / vs the whole batch; prefill vs in turn",
        f"{result['decode_speedup_vs_split']:.2f}x / {result['decode_speedup']:.2f}x / "
        f"{result['prefill_speedup_vs_split']:.2f}x",
        f"per-token decode time ratios, tokens equal: {result['tokens_equal']}; goal >= 1.3x "
        f"over the ubatches in turn{copied}",
    )]


def _train_rows(result: dict[str, Any]) -> list[Row]:
    blocked = result["blocked_backward_split_ms"] / max(result["blocked_backward_dbo_ms"], 1e-9)
    equal = result["losses_equal"] and result["weights_equal"]
    return [(
        "`train_moe.py`, SGD steps: DBO vs the same ubatches in turn, forward / backward / "
        "whole step; blocked time in backward, in turn over DBO",
        f"{result['forward_speedup_vs_split']:.2f}x / {result['backward_speedup_vs_split']:.2f}x"
        f" / {result['step_speedup_vs_split']:.2f}x; {blocked:.1f}x",
        f"losses and weights equal bit for bit: {equal}; goals >= 1.8x for the backward and "
        "the step",
    )]


def _train_fsdp_rows(result: dict[str, Any]) -> list[Row]:
    return [(
        "`train_fsdp.py`, SGD steps under FSDP2: DBO vs the same ubatches in turn, forward / "
        "backward / whole step; reduce-scatters per backward, in turn / DBO",
        f"{result['forward_speedup_vs_split']:.2f}x / {result['backward_speedup_vs_split']:.2f}x"
        f" / {result['step_speedup_vs_split']:.2f}x; {result['reduce_scatters_split']:.0f} / "
        f"{result['reduce_scatters_dbo']:.0f}",
        f"losses allclose: {result['losses_close']} (largest difference "
        f"{result['largest_loss_difference']:.1e}); one reduce-scatter per sharded layer",
    )]


def _memory_rows(result: dict[str, Any]) -> list[Row]:
    """The backward's peaks; under FSDP2 the forward's too (a plain forward's is tiny)."""
    def over(peaks: dict[str, float], part: str) -> str:
        return (f"{peaks[f'dbo_{part}_mib'] / peaks[f'whole_{part}_mib']:.2f} / "
                f"{peaks[f'dbo_{part}_mib'] / peaks[f'in_turn_{part}_mib']:.2f}")

    plain, sharded = result["wrappers"]["none"], result["wrappers"]["fsdp"]
    return [(
        "`backward_memory.py`: peak memory, DBO over the whole batch / over the same ubatches "
        "in turn: backward; under FSDP2, forward, backward",
        f"{over(plain, 'backward')}; {over(sharded, 'forward')}, {over(sharded, 'backward')}",
        f"resident-set peaks above each pass's start, parameters {plain['param_mib']:.0f} MiB; "
        "1 = as much as without DBO, a second copy of the gradients would be ~2 (backward)",
    )]


def _exposed_rows(result: dict[str, Any]) -> list[Row]:
    cells = [f"{result[w]['whole']['exposed_ms']:.1f} / {result[w]['dbo']['exposed_ms']:.1f}"
             for w in ("ddp", "fsdp")]
    return [(
        "`exposed_comm.py`: gradient communication left exposed by the backward, ms, the whole "
        "batch / DBO: DDP; FSDP2",
        "; ".join(cells),
        "backward time with the wrapper's reduction minus without it (medians); under DBO "
        "DDP's buckets reduce after the overlapped backward, FSDP2's units as they finish",
    )]


def _compiled_rows(result: dict[str, Any]) -> list[Row]:
    ms = result["ms"]
    return [(
        f"`moe_compiled.py`, the demo MoE compiled ({result['backend']}, fullgraph) vs eager: "
        "in turn / DBO; DBO vs the same ubatches in turn: eager / compiled",
        f"{ms['eager in turn'] / ms['compiled in turn']:.2f}x / "
        f"{ms['eager DBO'] / ms['compiled DBO']:.2f}x; "
        f"{ms['eager in turn'] / ms['eager DBO']:.2f}x / "
        f"{ms['compiled in turn'] / ms['compiled DBO']:.2f}x",
        f"host time per step; graph breaks {result['graph_breaks']} (goal 0); compiled DBO "
        f"equal to compiled in turn bit for bit: {result['equal']}",
    )]


_OVERLAP_CONFIGS = ",".join(
    f"{size:g}:{size:g}:{u}" for u in OVERLAP_UBATCHES for size in OVERLAP_SIZES_MS
)
ITEMS = (
    Item("workspace", "benchmarks/workspace_alloc.py", (), ("--rounds", "3", "--calls", "500"),
         _workspace_rows),
    Item("handoff", "benchmarks/handoff.py", (), ("--handoffs", "4000", "--rounds", "3"),
         _handoff_rows),
    Item("wakeup", "benchmarks/wakeup_kinds.py", (), ("--rounds", "3"), _wakeup_rows),
    Item("overlap", "benchmarks/overlap_efficiency.py", ("--configs", _OVERLAP_CONFIGS),
         ("--configs", _OVERLAP_CONFIGS, "--layers", "4", "--rounds", "5"), _overlap_rows),
    Item("host", "benchmarks/host_overhead.py", (), ("--calls", "100", "--rounds", "7"),
         _host_rows),
    Item("comm", "benchmarks/comm_overlap.py", (),
         ("--rounds", "6", "--layers", "8", "--configs", "1024:1.0"), _comm_rows),
    _example("demo", "examples/moe_overlap.py", "5", goals=True),
    Item("moe-paths", "benchmarks/moe_paths.py", (), ("--tokens", "64", "--steps", "5"),
         _moe_path_rows),
    Item("compiled", "benchmarks/moe_compiled.py", (), ("--steps", "5"), _compiled_rows),
    Item("memory", "benchmarks/backward_memory.py", ("--wrapper", "none,fsdp"),
         ("--wrapper", "none,fsdp", "--rounds", "1"), _memory_rows),
    Item("exposed", "benchmarks/exposed_comm.py", ("--steps", "20"), ("--steps", "5"),
         _exposed_rows),
    _example("tp", "examples/tensor_parallel_mlp.py", "5"),
    _example("hf", "examples/hf_moe.py", "5"),
    Item("generate", "examples/generate.py", ("--spawn", "2"),
         ("--spawn", "2", "--repeats", "2", "--new-tokens", "8"), _generate_rows),
    Item("train", "examples/train_moe.py", ("--spawn", "2"), ("--spawn", "2", "--steps", "4"),
         _train_rows),
    Item("train-fsdp", "examples/train_fsdp.py", ("--spawn", "2"),
         ("--spawn", "2", "--steps", "4"), _train_fsdp_rows),
)
"""The items in the order they run."""


def _run(argv: list[str], timeout_s: float, log: Path) -> tuple[dict[str, Any] | None, str]:
    """Run `argv` in its own process group (the examples' ranks die with it on a
    timeout); (the JSON of its last stdout line or None, why there is none)."""
    process = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        log.write_text(output)
        return None, f"timed out after {timeout_s:g} s"
    log.write_text(output)
    if process.returncode != 0:
        return None, f"failed (exit status {process.returncode})"
    lines = output.strip().splitlines()
    try:
        return json.loads(lines[-1]), ""
    except (IndexError, json.JSONDecodeError):
        return None, "no JSON line at the end of its output"


def plot_overlap(result: dict[str, Any], path: Path) -> str:
    """Draw the hidden fraction against c = m, one line per ubatch count; returns what
    was written (or why nothing was)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no overlap plot: matplotlib is missing (pip install -e '.[plot]')"
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for num_ubatches in sorted({row["num_ubatches"] for row in result["rows"]}):
        points = sorted(
            (row["m_ms"], row["hidden"]) for row in result["rows"]
            if row["num_ubatches"] == num_ubatches and row["c_nominal_ms"] == row["m_ms"]
        )
        axes.plot(*zip(*points), marker="o", label=f"{num_ubatches} ubatches")
    axes.axhline(1.0, color="grey", linestyle="--", label="ideal: all hideable comm hidden")
    axes.set_xscale("log")
    axes.minorticks_off()
    axes.set_xticks(OVERLAP_SIZES_MS, [f"{size:g}" for size in OVERLAP_SIZES_MS])
    low, high = axes.get_ylim()
    axes.set_ylim(min(0.0, low), max(1.15, high))  # 0 and the ideal always in view
    axes.set_xlabel("segment size c = m (ms of compute and of transfer per ubatch per layer)")
    axes.set_ylabel("hidden fraction")
    axes.set_title(f"DBO on an emulated link ({result['device']}, {result['layers']} layers)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return f"overlap-efficiency curve: {path}"


def machine() -> str:
    """Cores, CPU model, OS, torch (and its GPU) and Python, in one line."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(
                line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    usable_note = "" if usable == cores else f", {usable} usable"
    return (
        f"{cores} cores{usable_note} ({model}), {platform.system()} {platform.machine()}, "
        f"torch {torch.__version__} ({gpu}), Python {platform.python_version()}"
    )


def _table(rows: list[Row]) -> str:
    lines = ["| what | ratio | what the ratio means / goal |", "|---|---|---|"]
    lines += [f"| {what} | {ratio} | {meaning} |" for what, ratio, meaning in rows]
    return "\n".join(lines)


def _run_item(
    item: Item, progress: str, args: argparse.Namespace, out: Path, timeout_s: float
) -> tuple[list[Row], list[str], bool]:
    """Run one item: (its table rows, notes to print under the table, whether it failed)."""
    if not (ROOT / item.script).exists():
        print(f"{progress} is not there: skipped", file=sys.stderr)
        return [(f"`{item.script}`", "skipped", "the script is not in this checkout")], [], False
    extra = ("--out", str(out / item.name)) if item.script.startswith("examples/") else ()
    command = [sys.executable, item.script, *(item.quick if args.quick else item.full),
               *extra, "--json"]
    print(f"{progress} ...", file=sys.stderr, flush=True)
    begin = time.monotonic()
    result, why = _run(command, timeout_s, out / f"{item.name}.log")
    print(f"{progress} {why or 'done'} in {time.monotonic() - begin:.0f} s",
          file=sys.stderr, flush=True)
    if result is None:
        return [(f"`{item.script}`", "failed", f"{why}; see {out / item.name}.log")], [], True
    (out / f"{item.name}.json").write_text(json.dumps(result, indent=1))
    notes = []
    if item.name == "overlap":
        notes.append(plot_overlap(result, out / "overlap_efficiency.png"))
        if any(not -0.1 <= row["hidden"] <= 1.2 for row in result["rows"]):
            notes.append(
                "hidden fractions far outside 0-1: the compute's speed changed between "
                "the rounds (a busy machine); rerun on a quiet one"
            )
    return item.rows(result), notes, False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = [item.name for item in ITEMS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument(
        "--only", metavar="NAMES", help=f"comma-separated items to run, of: {','.join(names)}"
    )
    parser.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    parser.add_argument(
        "--timeout-s", type=float, help="limit per item (default 300 with --quick, else 1800)"
    )
    args = parser.parse_args(argv)
    chosen = names if args.only is None else args.only.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown items {unknown}; choose from {','.join(names)}")
    timeout_s = args.timeout_s or (300.0 if args.quick else 1800.0)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: list[Row] = []
    notes: list[str] = []
    failed = False
    selected = [item for item in ITEMS if item.name in chosen]
    for index, item in enumerate(selected, 1):
        progress = f"[{index}/{len(selected)}] {item.name}: {item.script}"
        item_rows, item_notes, item_failed = _run_item(item, progress, args, out, timeout_s)
        rows, notes, failed = rows + item_rows, notes + item_notes, failed or item_failed
    header = [
        f"Date: {started:%Y-%m-%d %H:%M} UTC",
        f"Machine: {machine()}",
        f"Command: `{shlex.join(['python', 'benchmarks/run_all.py', *argv])}`",
    ]
    report = "\n".join(header) + "\n\n" + _table(rows) + "\n"
    (out / "table.md").write_text(report)
    print(report)
    for note in [*notes, f"table, logs and JSON results: {out}/"]:
        print(note)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
