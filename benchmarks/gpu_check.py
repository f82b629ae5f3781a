"""The GPU checks in one run on one CUDA machine, written up as Markdown and JSON.

    bash benchmarks/gpu_check.sh OUTDIR                 # PYTHON=... picks the interpreter
    python benchmarks/gpu_check.py OUTDIR --only pytest,overlap   # a rerun of some steps

The steps (STEPS), each a subprocess with a timeout of its own: the preflight (torch sees
a CUDA device; if not, the report says so and nothing else runs), `pytest -m gpu`, the
fixed-shape MoE path under `set_sync_debug_mode("error")`, the MoE example on one NCCL
rank (dynamic and fixed-shape), the training examples, the demo MoE compiled, peak
memory (plain and under FSDP2), eager vs graph-replayed DBO at decode sizes, a captured
decode step of a Hugging Face MoE model against eager DBO generation, bf16 GEMMs against
`EmulatedLink` transfers, workspace views vs `torch.empty`; then the benchmarks'
`num_alloc_retries`. Before them, the wheels `benchmarks/gpu_wheels.py` downloads (a
tested `transformers`; bench-out/gpu-wheels, carried with the checkout) are installed into
OUTDIR/pylib for the steps; without a tested `transformers`, the steps that need one are
reported as skipped, with why, and do not fail the run. The run keeps to a budget of 7
minutes (`BUDGET_S`) whatever hangs: each step's limit is cut to what is left, a step
with no time left is reported as not run, and a preflight that timed out or crashed (a
cold start) runs once more. The NCCL steps run as rank 0 of a world of one (the env://
variables set here, no torchrun). Written to OUTDIR after every step (a killed run still
leaves a whole report, the steps not reached marked not run): gpu_check.md,
gpu_check.json (the same, with every step's result), <step>.log. Exit status 0 when every
step passed or was skipped, else 1: a step failed, timed out or did not run, a result was
wrong, or a goal was missed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Row = tuple[str, str, str]
"""(what is measured, the value, what it means / the goal)."""
Result = dict[str, Any]
HIDDEN_GOAL, HIDDEN_GOAL_FROM_MS = 0.95, 0.2
BUDGET_S = 420.0
"""The most the steps may take together (7 minutes): each step's limit is cut to what is
left of it, and the steps it leaves no time for are reported as not run."""
MIN_STEP_S = 5.0
"""A step is started only with at least this much of the budget left."""
KILL_GRACE_S = 3.0
"""After a timeout: SIGTERM to the step's process group, SIGKILL this much later
(torchrun ends its workers, which run in sessions of their own, on SIGTERM only)."""


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    argv: tuple[str, ...]  # after the interpreter; {out} is OUTDIR; may write {out}/<name>.xml
    timeout_s: float
    judge: Callable[[Result], tuple[list[Row], list[str]]]  # (rows, problems)
    parse: Callable[[str, Path], Result | None] = lambda output, out: last_json_line(output)
    world_of_one: bool = False
    """Run as rank 0 of a world of one: the env:// variables torchrun would set, set here
    (one interpreter, no torchrun agent to start or to outlive its timeout)."""
    needs_transformers: bool = False
    """Skipped, with why, when the preflight finds no `transformers` of dbo's tested
    releases (neither the machine's nor one carried as wheels)."""


def last_json_line(output: str) -> Result | None:
    """The last line of `output` that is a JSON object (torchrun may print after it)."""
    for line in reversed(output.splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(line) if line.startswith("{") else None
            if isinstance(value, dict):
                return value
    return None


PREFLIGHT = """
import json, os, platform, torch
import comm, dbo, workspace  # this checkout imports
facts = {"torch": torch.__version__, "python": platform.python_version(),
         "cpus": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
if facts["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    facts.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                 capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                 devices=torch.cuda.device_count(),
                 nccl=".".join(map(str, torch.cuda.nccl.version()))
                 if torch.distributed.is_nccl_available() else "none")
try:
    import transformers
    facts["transformers"] = transformers.__version__
except Exception as error:  # absent, or its own version checks refuse the machine's hub
    facts["transformers"] = None
    facts["transformers_error"] = f"{type(error).__name__}: {error}"[:300]
from dbo.hf.versions import is_tested
facts["transformers_tested"] = bool(facts["transformers"]) and is_tested(facts["transformers"])
print(json.dumps(facts))
"""


NCCL_SMOKE = """
import json, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
ok = bool((x == 1).all())
dist.destroy_process_group()
print(json.dumps({"nccl_ok": ok}))
"""

NCCL_RECIPE = {"NCCL_CUMEM_ENABLE": "0", "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}
"""What the check sets for every later step when NCCL does not start as it is (sandboxed
machines without cuMem, shared memory or peer access): `NCCL_SMOKE` runs again with it."""


def _nccl(result: Result) -> tuple[list[Row], list[str]]:
    return [], [] if result["nccl_ok"] else ["an all_reduce of ones over one rank was not ones"]


def _preflight(result: Result) -> tuple[list[Row], list[str]]:
    return [], [] if result["cuda_available"] else [
        f"no CUDA device (torch {result['torch']}: torch.cuda.is_available() is False); "
        "nothing was measured"]


def read_junit(output: str, out: Path) -> Result | None:
    """Passed, failed, errored and skipped tests from pytest's JUnit XML; when pytest did
    not write it (killed at its timeout), from the `-v` lines of its output."""
    try:
        root = ElementTree.parse(out / "pytest.xml").getroot()
    except (OSError, ElementTree.ParseError):  # not written, or cut short by the timeout
        return read_verbose_log(output)
    result: Result = {"passed": 0, "failed": [], "errors": [], "skipped": {}}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag: child for child in case}
        if "error" in tags:
            result["errors"].append(name)
        elif "failure" in tags:
            result["failed"].append(name)
        elif "skipped" in tags:
            result["skipped"][name] = tags["skipped"].get("message", "")
        else:
            result["passed"] += 1
    return result


_VERBOSE_LINE = re.compile(
    r"^(?P<test>\S+::\S+) (?P<status>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
    r"(?: \((?P<reason>.*)\))?"
)


def read_verbose_log(output: str) -> Result | None:
    """The per-test results `pytest -v` printed (None: no test line at all). A test whose
    line has no status yet was running when the step ended: it is listed as such."""
    result: Result = {"passed": 0, "failed": [], "errors": [], "skipped": {}, "running": []}
    seen = False
    for line in output.splitlines():
        match = _VERBOSE_LINE.match(line)
        if match is None:
            if "::" in line and line.startswith("tests/") and " " not in line.strip():
                result["running"] = [line.strip()]  # started, no status: the last one ran
            continue
        seen = True
        result["running"] = []
        test, status = match["test"], match["status"]
        if status in ("PASSED", "XFAIL", "XPASS"):
            result["passed"] += 1
        elif status == "FAILED":
            result["failed"].append(test)
        elif status == "ERROR":
            result["errors"].append(test)
        else:
            result["skipped"][test] = match["reason"] or ""
    return result if seen or result["running"] else None


def _pytest(result: Result) -> tuple[list[Row], list[str]]:
    failed, errors, skipped = result["failed"], result["errors"], result["skipped"]
    counts = (f"{result['passed']} passed, {len(failed)} failed, {len(errors)} errors, "
              f"{len(skipped)} skipped")
    reasons = "; ".join(sorted(set(skipped.values()))) or "none"
    problems = [f"failed: {name}" for name in failed] + [f"error: {name}" for name in errors]
    problems += [f"still running when the step ended: {name}" for name in result.get("running", [])]
    if result["passed"] == 0:
        problems.append("no gpu test passed")
    return [("`pytest -m gpu tests`", counts, f"every gpu test passes; skip reasons: {reasons}")
            ], problems


def _sync_debug(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if result["sync_error"]:
        problems.append(f"a synchronizing CUDA call: {result['sync_error']}")
    elif not result["bitwise_equal"]:
        problems.append("the overlapped steps differ from the serial ubatches")
    if not result["sync_checked"] or result["backend"] != "nccl":
        problems.append(f"ran on {result['device']} ({result['backend']}), not CUDA and NCCL")
    value = ("a sync" if result["sync_error"] else f"0 syncs in {result['steps']} steps"
             if result["sync_checked"] else "not checked")
    return [(f"fixed-shape MoE overlapped under `set_sync_debug_mode(\"error\")`, "
             f"{result['tokens']} tokens, capacity {result['capacity']}", value,
             "goal: no synchronizing CUDA call; outputs bitwise equal to the serial ubatches")
            ], problems


def _moe(path: str) -> Callable[[Result], tuple[list[Row], list[str]]]:
    def judge(result: Result) -> tuple[list[Row], list[str]]:
        problems = []
        if (result["backend"], result["device"]) != ("nccl", "cuda"):
            problems.append(f"ran with {result['backend']} on {result['device']}, not NCCL")
        if not (result["bitwise_equal"] and result["allclose_vs_unsplit"]):
            problems.append("DBO differs from the same ubatches in turn or the whole batch")
        reads = result.get("host_reads_per_step")
        if path == "fixed-shape" and reads:
            problems.append(f"{reads} host reads per step on the fixed-shape path (goal 0)")
        return [(f"`moe_overlap.py`, {path} path, one NCCL rank, {result['tokens']} tokens: "
                 "DBO vs the same ubatches in turn / vs the whole batch",
                 f"{result['speedup_vs_split']:.2f}x / {result['speedup']:.2f}x",
                 f"step-time speedups ({reads} host reads per step); one rank: every "
                 "all-to-all is a local copy")], problems
    return judge


def _graph(result: Result) -> tuple[list[Row], list[str]]:
    rows = result["rows"]
    tokens = " / ".join(str(row["tokens"]) for row in rows)

    def joined(key: str, unit: str = "") -> str:
        return " / ".join(f"{row[key]:.2f}{unit}" for row in rows)

    problems = [f"graph replay differs from eager DBO at {row['tokens']} tokens"
                for row in rows if not row["bitwise_equal"]]
    return [
        (f"eager DBO over graph-replayed DBO, {tokens} tokens", joined("graph_speedup", "x"),
         "time per step; > 1: the replay is faster (eager DBO is bound by the host)"),
        (f"graph of the whole batch over graph-replayed DBO, {tokens} tokens",
         joined("dbo_vs_whole", "x"), f"> 1: DBO pays at that size ({result['link_us']:g} us "
         "emulated transfer per layer)"),
    ], problems


def _overlap(result: Result) -> tuple[list[Row], list[str]]:
    rows = sorted((row for row in result["rows"] if row["c_nominal_ms"] == row["m_ms"]
                   and row["num_ubatches"] == 2), key=lambda row: row["m_ms"])
    goal_rows = [row for row in rows if row["m_ms"] >= HIDDEN_GOAL_FROM_MS]
    problems = [f"goal missed: hidden {row['hidden']:.2f} at c = m = {row['m_ms']:g} ms "
                f"(goal >= {HIDDEN_GOAL})" for row in goal_rows if row["hidden"] < HIDDEN_GOAL]
    if not goal_rows:
        problems.append(f"no 2-ubatch row with c = m >= {HIDDEN_GOAL_FROM_MS} ms")
    return [(f"overlap, {result.get('dtype', '')} GEMMs vs EmulatedLink, 2 ubatches, "
             f"{result['layers']} layers, c = m = "
             + " / ".join(f"{row['m_ms']:g}" for row in rows) + " ms",
             " / ".join(f"{row['hidden']:.2f}" for row in rows),
             f"hidden fraction; goal >= {HIDDEN_GOAL} at >= {HIDDEN_GOAL_FROM_MS * 1000:g} us")
            ], problems


def _workspace(result: Result) -> tuple[list[Row], list[str]]:
    rows = [row for row in result["rows"] if row["device"] == "cuda"]
    ratios = [row["workspace_us"] / row["empty_us"] for row in rows]
    problems = [] if rows else ["no CUDA rows"]
    problems += [f"goal missed: workspace/torch.empty {ratio:.2f} ({row['case']})"
                 for row, ratio in zip(rows, ratios) if ratio >= 1]
    return [("workspace `get_simultaneous` vs `torch.empty` on CUDA, 3 tensors, "
             + " / ".join(row["case"] for row in rows),
             " / ".join(f"{ratio:.2f}" for ratio in ratios),
             "time per call over torch.empty's; goal < 1")], problems


def _generate_graph(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if not result["captured"]:
        problems.append(f"ran on {result['device']}: the decode steps were not captured")
    if not result["tokens_equal"]:
        problems.append("the replayed decode steps gave other tokens than eager DBO generation")
    if not result["eager_loop_equal"]:
        problems.append("the eager decode loop gave other tokens than eager DBO generation")
    return [(f"a decode step of a HF MoE model ({result['rows']} rows, StaticCache, fixed-shape "
             "MoE, one NCCL rank): eager DBO over its graph replay",
             f"{result['graph_speedup']:.2f}x",
             f"time per decode step; tokens equal to eager DBO generation: "
             f"{result['tokens_equal']}")], problems


def _train(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if (result["backend"], result["device"]) != ("nccl", "cuda"):
        problems.append(f"ran on {result['backend']}/{result['device']}, not nccl/cuda")
    if not (result["losses_equal"] and result["weights_equal"]):
        problems.append("training with DBO diverged from the same ubatches in turn")
    return [("the MoE training example on NCCL (one rank): DBO over the same ubatches in "
             "turn, forward / backward / whole step",
             f"{result['forward_speedup_vs_split']:.2f}x / "
             f"{result['backward_speedup_vs_split']:.2f}x / {result['step_speedup_vs_split']:.2f}x",
             f"median ms per step; losses and weights equal bit for bit: "
             f"{result['losses_equal'] and result['weights_equal']}")], problems


def _train_fsdp(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if (result["backend"], result["device"]) != ("nccl", "cuda"):
        problems.append(f"ran on {result['backend']}/{result['device']}, not nccl/cuda")
    if not result["losses_close"]:
        problems.append("training with DBO under FSDP2 diverged from the ubatches in turn")
    return [("the MoE training example under FSDP2 on NCCL (one rank): DBO over the same "
             "ubatches in turn, forward / backward / whole step",
             f"{result['forward_speedup_vs_split']:.2f}x / "
             f"{result['backward_speedup_vs_split']:.2f}x / {result['step_speedup_vs_split']:.2f}x",
             f"median ms per step; losses allclose: {result['losses_close']}; reduce-scatters "
             f"per backward in turn / DBO: {result['reduce_scatters_split']:.0f} / "
             f"{result['reduce_scatters_dbo']:.0f}; backward's peak MiB in turn / DBO: "
             f"{result['backward_peak_split_mib']:.1f} / {result['backward_peak_dbo_mib']:.1f}")
            ], problems


def _compiled(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if result["graph_breaks"]:
        problems.append(f"{result['graph_breaks']} graph break(s) in the compiled MoE model")
    if not result["equal"]:
        problems.append("compiled DBO differs from the compiled model on the ubatches in turn")
    ms = result["ms"]
    return [("the demo MoE compiled (inductor, fullgraph) on NCCL (one rank): over eager in "
             "turn / under DBO; DBO over in turn, compiled",
             f"{ms['eager in turn'] / ms['compiled in turn']:.2f}x / "
             f"{ms['eager DBO'] / ms['compiled DBO']:.2f}x; "
             f"{ms['compiled in turn'] / ms['compiled DBO']:.2f}x",
             f"median ms per step; graph breaks {result['graph_breaks']}; equal to compiled "
             f"in turn: {result['equal']}")], problems


def _memory(result: Result) -> tuple[list[Row], list[str]]:
    problems = []
    if result["device"] != "cuda":
        problems.append(f"measured on {result['device']}, not cuda")
    cells = []
    for wrapper, peaks in result["wrappers"].items():
        unit = peaks["param_mib"] / 16  # one of the 16 linears
        for part in ("forward", "backward"):
            extra = peaks[f"dbo_{part}_mib"] - peaks[f"whole_{part}_mib"]
            if extra > 2 * unit:
                problems.append(f"{wrapper}: DBO's {part} peak is {extra:.1f} MiB over the whole "
                                f"batch's, more than two linears' {2 * unit:.1f} MiB")
        cells.append(f"{wrapper} {peaks['dbo_forward_mib'] / peaks['whole_forward_mib']:.2f} / "
                     f"{peaks['dbo_backward_mib'] / peaks['whole_backward_mib']:.2f}")
    return [("peak memory (one rank), plain and under FSDP2: DBO over the whole batch, "
             "forward / backward", "; ".join(cells),
             "the caching allocator's peaks above each pass's start; "
             f"parameters {peaks['param_mib']:.0f} MiB")], problems


_EXAMPLE = ("examples/moe_overlap.py", "--steps", "10", "--tokens", "256", "--json")
STEPS = (
    Step("preflight", "torch sees a CUDA device", ("-c", PREFLIGHT), 45, _preflight),
    Step("nccl", "NCCL starts: one all_reduce in a world of one", ("-c", NCCL_SMOKE), 25,
         _nccl, world_of_one=True),
    Step("pytest", "the gpu-marked tests",
         ("-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
          "--junitxml", "{out}/pytest.xml", "tests"), 140, _pytest, read_junit),
    Step("sync-debug", "no host sync in the fixed-shape MoE path under DBO",
         ("benchmarks/moe_sync_debug.py", "--json"), 35, _sync_debug, world_of_one=True),
    Step("moe-dynamic", "the MoE example on NCCL, dynamic path",
         (*_EXAMPLE, "--out", "{out}/moe-dynamic"), 32, _moe("dynamic"), world_of_one=True),
    Step("moe-fixed", "the MoE example on NCCL, fixed-shape path",
         (*_EXAMPLE, "--fixed-capacity", "256", "--out", "{out}/moe-fixed"), 32,
         _moe("fixed-shape"), world_of_one=True),
    Step("train", "the MoE training example on NCCL: forward and backward overlapped",
         ("examples/train_moe.py", "--steps", "8", "--tokens", "1024", "--json",
          "--out", "{out}/train"), 30, _train, world_of_one=True),
    Step("train-fsdp", "the MoE training example under FSDP2 on NCCL",
         ("examples/train_fsdp.py", "--steps", "8", "--tokens", "1024", "--json"), 25,
         _train_fsdp, world_of_one=True),
    Step("compiled", "the demo MoE compiled with inductor on NCCL, eager and under DBO",
         ("benchmarks/moe_compiled.py", "--steps", "10", "--json"), 45, _compiled,
         world_of_one=True),
    Step("memory", "peak memory of an overlapped call vs the whole batch, plain and FSDP2",
         ("benchmarks/backward_memory.py", "--wrapper", "none,fsdp", "--json"), 30, _memory,
         world_of_one=True),
    Step("graph", "eager vs graph-replayed DBO at decode sizes",
         ("benchmarks/graph_replay.py", "--json"), 30, _graph),
    Step("generate-graph", "a captured decode step of a HF MoE model vs eager DBO generation",
         ("benchmarks/generate_graph.py", "--json"), 30, _generate_graph, world_of_one=True,
         needs_transformers=True),
    Step("overlap", "communication hidden behind bf16 GEMMs",
         ("benchmarks/overlap_efficiency.py", "--device", "cuda", "--layers", "32",
          "--rounds", "7", "--configs", "0.1:0.1:2,0.2:0.2:2,0.5:0.5:2,1:1:2,2:2:2", "--json"),
         40, _overlap),
    Step("workspace", "workspace views vs torch.empty",
         ("benchmarks/workspace_alloc.py", "--rounds", "5", "--calls", "1000", "--json"), 20,
         _workspace),
)
"""In the order they run. A cold `import torch` can take seconds on the GPU machine's
file system: the preflight, the first to import it, has the most room for it."""


def _environment(out: Path, world_of_one: bool, extra: dict[str, str]) -> dict[str, str]:
    """The steps' environment: dbo, comm and workspace from this checkout (not installed),
    then the carried wheels (`install_wheels`); matplotlib drawing to files with a writable
    cache; NCCL warnings only (unless set); for a world of one, what torchrun would set,
    on a free port."""
    carried = out / PYLIB if (out / PYLIB).is_dir() else None
    path = os.pathsep.join(str(part) for part in (ROOT, carried, os.environ.get("PYTHONPATH"))
                           if part)
    (out / "mplconfig").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
           "DBO_IN_GPU_CHECK": "1",  # gpu tests that run a step's script skip: the step runs it
           "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(out / "mplconfig")}
    env.setdefault("NCCL_DEBUG", "WARN")
    env.update(extra)
    if world_of_one:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return env


PYLIB = "pylib"
"""OUTDIR's folder for the carried wheels, first on the steps' path after the checkout."""
WHEELS = Path("bench-out") / "gpu-wheels"
"""Where `benchmarks/gpu_wheels.py` puts the wheels (relative to the checkout)."""


def install_wheels(wheels: Path, out: Path) -> str:
    """Install every wheel in `wheels` into OUTDIR/pylib (no index, no dependencies: the
    folder holds what is needed), for the steps; what was done, for the report."""
    shutil.rmtree(out / PYLIB, ignore_errors=True)
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return f"none carried (no wheels in {wheels}; python benchmarks/gpu_wheels.py makes them)"
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
               "--no-deps", "--no-index", "--target", str(out / PYLIB), *map(str, found)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        shutil.rmtree(out / PYLIB, ignore_errors=True)
        why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{len(found)} wheels from {wheels} not installed ({why})"
    names = ", ".join(path.name.split("-")[0] + " " + path.name.split("-")[1] for path in found)
    return f"{len(found)} wheels installed from {wheels}: {names}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=KILL_GRACE_S)


def _record(name: str, title: str, status: str, why: str = "", **fields: Any) -> Result:
    """A step's record in the JSON file (`fields` override the empty defaults)."""
    return {"name": name, "title": title, "status": status, "why": why, "problems": [],
            "rows": [], "result": None, "seconds": 0.0, "log": "", "command": "", "tail": [],
            **fields}


def judge_step(
    step: Step, returncode: int | None, output: str, out: Path, limit_s: float | None = None
) -> Result:
    """The record of a step that ended with `returncode` (None: killed at its timeout,
    `limit_s` or its own) after printing `output`: its status, why, the rows and problems
    its judge found."""
    result = step.parse(output, out)
    rows: list[Row] = []
    problems: list[str] = []
    if result is not None:
        try:
            rows, problems = step.judge(result)
        except Exception as error:  # a result of another shape: report it, write the report
            problems = [f"unexpected result ({type(error).__name__}: {error})"]
    if returncode is None:
        status, why = "timed out", f"timed out after {limit_s or step.timeout_s:g} s"
    elif returncode != 0:
        status, why = "failed", f"exit status {returncode}"
    elif result is None:
        status, why = "failed", "no result (no JSON line at the end of its output)"
    else:
        status, why = ("failed", problems[0]) if problems else ("passed", "")
    crashed = returncode != 0 or result is None
    return _record(step.name, step.title, status, why, problems=problems, rows=rows,
                   result=result, tail=output.splitlines()[-20:] if crashed else [])


def run_step(
    step: Step, out: Path, timeout_s: float | None = None, extra_env: dict[str, str] | None = None
) -> Result:
    """Run one step in a process group of its own, its output in OUTDIR/<name>.log, for at
    most `timeout_s` (default: the step's own limit), with `extra_env` set."""
    limit_s = step.timeout_s if timeout_s is None else min(step.timeout_s, timeout_s)
    argv = [sys.executable, *(arg.replace("{out}", str(out)) for arg in step.argv)]
    log = out / f"{step.name}.log"
    (out / f"{step.name}.xml").unlink(missing_ok=True)  # a report of an earlier run
    begin = time.monotonic()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env=_environment(out, step.world_of_one, extra_env or {}),
        )
        try:
            returncode: int | None = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            returncode = None
            _kill_group(process)
    record = judge_step(step, returncode, log.read_text(errors="replace"), out, limit_s)
    command = shlex.join(["python", *argv[1:]]) if step.name != "preflight" else ""
    record.update(seconds=round(time.monotonic() - begin, 1), log=log.name, command=command)
    return record


def alloc_retries(records: list[Result]) -> Result:
    """The record of `num_alloc_retries` as the benchmarks reported it (goal 0)."""
    found = {record["name"]: record["result"]["cuda_alloc_retries"] for record in records
             if isinstance(record["result"], dict) and "cuda_alloc_retries" in record["result"]}
    title = "no cudaMalloc retried"
    if not found:
        return _record("memory", title, "not run", "no benchmark reported num_alloc_retries")
    bad = [f"{name}: {count} cudaMalloc retries" for name, count in found.items() if count]
    row = ("`torch.cuda.memory_stats()[\"num_alloc_retries\"]` after each benchmark",
           " / ".join(f"{name} {count}" for name, count in found.items()),
           "cudaMalloc calls that failed and were retried after freeing the cache; goal 0")
    return _record("memory", title, "failed" if bad else "passed", bad[0] if bad else "",
                   problems=bad, rows=[row])


def _machine(facts: Result) -> str:
    if not facts:
        return "Machine: unknown (the preflight did not report)"
    base = f"torch {facts['torch']}, Python {facts['python']}, {facts['cpus']} CPUs"
    if "transformers" in facts:
        tested = "tested" if facts.get("transformers_tested") else "not tested by dbo"
        base += (f", transformers {facts['transformers'] or 'none'} ({tested}; carried "
                 f"wheels: {facts.get('carried_wheels', 'none')})")
    if not facts.get("cuda_available"):
        return f"Machine: no CUDA device; {base}"
    return (f"GPU: {facts['gpu']}, {facts['gpu_memory_gib']} GiB, compute capability "
            f"{facts['capability']} ({facts['devices']} visible); CUDA {facts['cuda']}, NCCL "
            f"{facts['nccl']}; {base}")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def line(cells: tuple[str, ...]) -> str:  # an error message may hold | or newlines
        return "| " + " | ".join(" ".join(c.replace("|", "\\|").split()) for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


OK = ("passed", "skipped")
"""The statuses a passing run's steps have: a skipped step says why (a version the
machine lacks), and is not a failure of dbo."""

KEY_STEPS = ("overlap", "graph", "generate-graph", "moe-fixed", "moe-dynamic")
"""The steps whose first row is a key figure in the report's opening sentence."""


def _summary(records: list[Result]) -> str:
    """One sentence: which steps passed, which did not and why, and the key figures."""
    passed = [r["name"] for r in records if r["status"] == "passed"]
    others = [f"{r['name']} {r['status']} ({r['why']})" for r in records
              if r["status"] != "passed"]
    key = [f"{r['name']} {r['rows'][0][1]}" for name in KEY_STEPS for r in records
           if r["name"] == name and r["rows"]]
    sentence = f"{len(passed)} of {len(records)} steps passed"
    sentence += f" ({', '.join(passed)})" if passed else ""
    sentence += f"; {'; '.join(others)}" if others else ""
    return sentence + (f". Key figures: {'; '.join(key)}." if key else ".")


def report(records: list[Result], started: datetime.datetime, total_s: float,
           command: str) -> tuple[str, Result]:
    """The Markdown report and the JSON object of a run's step records."""
    preflight = records[0] if records and records[0]["name"] == "preflight" else None
    facts = (preflight["result"] or {}) if preflight else {}
    passed = bool(records) and all(record["status"] in OK for record in records)
    failing = [record for record in records if record["status"] not in OK]
    if passed:
        verdict = "passed"
    elif preflight and preflight["status"] != "passed":
        verdict = f"not run: {preflight['why']}"
    else:
        verdict = f"failed ({len(failing)} of {len(records)} steps did not pass)"
    lines = [f"# GPU check: {verdict}", "", _summary(records), "",
             f"Date: {started:%Y-%m-%d %H:%M} UTC  ",
             _machine(facts) + "  ", f"Command: `{command}`  ", f"Total: {total_s:.0f} s", ""]
    lines += _table(("step", "checks", "status", "s", "note"), [
        (r["name"], r["title"], r["status"], f"{r['seconds']:.0f}", r["why"]) for r in records])
    measured = [row for record in records for row in record["rows"]]
    if measured:
        lines += ["", *_table(("what", "value", "meaning / goal"), measured)]
    broken = [record for record in failing if record["status"] in ("failed", "timed out")]
    if broken:
        lines += ["", "## What did not pass"]
    for record in broken:
        lines += ["", f"- **{record['name']}** ({record['status']}): {record['why']}"]
        lines += [f"  - {problem}" for problem in record["problems"][1:]]
        if record["tail"]:
            lines += ["", f"  Last lines of {record['log']}:", "", "  ```",
                      *(f"  {line}" for line in record["tail"]), "  ```"]
    commands = [f"- {r['name']}: `{r['command']}`" for r in records if r["command"]]
    if commands:
        lines += ["", "Commands (from the repository root, PYTHONPATH=.):", "", *commands]
    data = {"passed": passed, "verdict": verdict, "date": started.isoformat(),
            "machine": facts, "command": command, "total_s": round(total_s, 1),
            "steps": records}
    return "\n".join(lines) + "\n", data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = [step.name for step in STEPS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUTDIR", help="where the report and the logs go")
    parser.add_argument("--wheels", metavar="DIR", default=str(ROOT / WHEELS),
                        help="wheels to install for the steps (default: %(default)s)")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated steps to run (preflight always): {','.join(names)}")
    args = parser.parse_args(argv)
    chosen = set(names if args.only is None else ["preflight", *args.only.split(",")])
    if chosen - set(names):
        parser.error(f"unknown steps {sorted(chosen - set(names))}; choose from {','.join(names)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started, begin = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    command = shlex.join(["python", "benchmarks/gpu_check.py", *argv])
    steps = [step for step in STEPS if step.name in chosen]
    records: list[Result] = []
    extra_env: dict[str, str] = {}
    nccl_failure = ""
    carried = install_wheels(Path(args.wheels), out)
    print(f"gpu_check: wheels: {carried}", file=sys.stderr, flush=True)
    for index, step in enumerate(steps):
        _write_report(out, records, steps[index:], started, begin, command)  # if killed now
        left_s = BUDGET_S - (time.monotonic() - begin)
        if records and records[0]["status"] != "passed":
            records.append(_record(step.name, step.title, "not run", "the preflight did not pass"))
            continue
        facts = (records[0]["result"] or {}) if records else {}
        if step.needs_transformers and not facts.get("transformers_tested"):
            records.append(_record(step.name, step.title, "skipped", _no_transformers(facts)))
            continue
        if nccl_failure and step.world_of_one:
            records.append(_record(step.name, step.title, "not run",
                                   f"NCCL did not start (see the nccl step): {nccl_failure}"))
            continue
        if left_s < MIN_STEP_S:
            records.append(_record(step.name, step.title, "not run",
                                   f"the {BUDGET_S:g} s budget of the check was spent"))
            continue
        print(f"[{index + 1}] {step.name}: {step.title} (at most {min(step.timeout_s, left_s):.0f}"
              " s) ...", file=sys.stderr, flush=True)
        record = run_step(step, out, left_s, extra_env)
        if step.name == "preflight" and record["result"] is None:  # timed out or crashed:
            print(f"    {record['status']}: {record['why']}; once more (a cold start)",
                  file=sys.stderr, flush=True)  # a cold import of torch and CUDA is slow
            record = run_step(step, out, BUDGET_S - (time.monotonic() - begin))
        if step.name == "preflight" and isinstance(record["result"], dict):
            record["result"]["carried_wheels"] = carried
        if step.name == "nccl" and record["status"] != "passed":
            recipe = " ".join(f"{key}={value}" for key, value in NCCL_RECIPE.items())
            print(f"    {record['status']}: {record['why']}; once more with {recipe}",
                  file=sys.stderr, flush=True)
            first = record
            record = run_step(step, out, BUDGET_S - (time.monotonic() - begin), NCCL_RECIPE)
            if record["status"] == "passed":  # every later step gets the recipe
                extra_env = dict(NCCL_RECIPE)
                record["why"] = (f"passed only with {recipe}, set for every later step (as it "
                                 f"was: {_failure_line(first)})")
            else:
                nccl_failure = _failure_line(first)
        records.append(record)
        print(f"    {record['status']} in {record['seconds']:.0f} s"
              + (f": {record['why']}" if record["why"] else ""), file=sys.stderr, flush=True)
    data = _write_report(out, records, [], started, begin, command)
    print((out / "gpu_check.md").read_text())
    if not data["passed"]:
        print(f"gpu_check: {data['verdict']}; report: {out / 'gpu_check.md'}", file=sys.stderr)
    return 0 if data["passed"] else 1


def _no_transformers(facts: Result) -> str:
    """Why a step that needs a tested `transformers` does not run."""
    from_dbo = "dbo.hf.versions.TESTED_TRANSFORMERS"
    found = (f"transformers {facts['transformers']} is not one of dbo's tested releases "
             f"({from_dbo})" if facts.get("transformers") else
             f"no transformers imports ({facts.get('transformers_error', 'not installed')})")
    return (f"{found}; carried wheels: {facts.get('carried_wheels', 'none')}; carry a tested "
            "one: python benchmarks/gpu_wheels.py, then bench-out/gpu-wheels with the checkout")


def _failure_line(record: Result) -> str:
    """The step's reason and the last error line of its log (what names an NCCL failure)."""
    errors = [line for line in record["tail"] if "Error" in line or "error" in line]
    return record["why"] + (f" ({errors[-1].strip()})" if errors else "")


def _write_report(out: Path, records: list[Result], pending: list[Step],
                  started: datetime.datetime, begin: float, command: str) -> Result:
    """Write gpu_check.md and .json for the steps run so far, the `pending` ones as not run
    (so that a run killed now still leaves a whole report); the JSON object."""
    stopped = [_record(step.name, step.title, "not run", "the check ended before this step")
               for step in pending]
    markdown, data = report([*records, *stopped, alloc_retries(records)], started,
                            time.monotonic() - begin, command)
    (out / "gpu_check.md").write_text(markdown)
    (out / "gpu_check.json").write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    sys.exit(main())
