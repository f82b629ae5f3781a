"""`benchmarks/gpu_check.py`: each step judged from what it printed, the report and the exit
status, fake steps run under their timeouts, and the wrapper on a machine without CUDA."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
FACTS = {
    "torch": "2.11.0+cu130", "python": "3.12.3", "cpus": 16, "cuda_available": True,
    "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "capability": "9.0", "devices": 1,
    "cuda": "13.0", "nccl": "2.27.7",
}
STARTED = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check_benchmarks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


gpu_check = _module()
JUDGES = {step.name: step for step in gpu_check.STEPS}


def _x_rows(result: dict[str, Any]) -> tuple[list[tuple[str, str, str]], list[str]]:
    problems = ["goal missed: x below 1"] if result["x"] < 1 else []
    return [("the x ratio", f"{result['x']:.2f}", "goal >= 1")], problems


def _step(name: str, *argv: str, timeout_s: float = 10.0) -> Any:
    return gpu_check.Step(name, f"checks {name}", argv, timeout_s, _x_rows)


def _preflight_record(tmp_path: Path) -> dict[str, Any]:
    return gpu_check.judge_step(JUDGES["preflight"], 0, json.dumps(FACTS), tmp_path)


def test_the_steps_are_named_once_and_the_budget_is_seven_minutes() -> None:
    names = [step.name for step in gpu_check.STEPS]
    assert names[0] == "preflight" and len(set(names)) == len(names)
    assert gpu_check.BUDGET_S <= 7 * 60
    nccl = {step.name for step in gpu_check.STEPS if step.world_of_one}
    assert {"sync-debug", "moe-dynamic", "moe-fixed", "generate-graph"} <= nccl
    assert not any("torch.distributed.run" in step.argv for step in gpu_check.STEPS)


def test_a_run_keeps_to_the_budget_whatever_hangs_and_reports_the_steps_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, {"preflight.py": f"print({json.dumps(FACTS)!r})",
                      "hang.py": "import time; time.sleep(60)"})
    steps = (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10, JUDGES["preflight"].judge),
             *(_step(f"hang{i}", "hang.py", timeout_s=30) for i in range(3)))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    monkeypatch.setattr(gpu_check, "BUDGET_S", 3.0)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1.0)
    begin = time.monotonic()
    assert gpu_check.main([str(tmp_path / "out")]) == 1
    assert time.monotonic() - begin < 3.0 + 2 * gpu_check.KILL_GRACE_S + 5
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    statuses = {step["name"]: (step["status"], step["why"]) for step in data["steps"]}
    assert statuses["hang0"][0] == "timed out"
    assert statuses["hang2"] == ("not run", "the 3 s budget of the check was spent")


def test_a_killed_run_leaves_a_whole_report_of_the_steps_so_far(tmp_path: Path) -> None:
    _write(tmp_path, {
        "preflight.py": f"print({json.dumps(FACTS)!r})",
        "good.py": 'print(\'{"x": 2.0}\')',
        "hang.py": "import time; open('hanging', 'w'); time.sleep(60)",
        "driver.py": (
            f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import gpu_check, test_gpu_check as t\n"
            f"gpu_check.ROOT = __import__('pathlib').Path({str(tmp_path)!r})\n"
            "gpu_check.STEPS = (gpu_check.Step('preflight', 'CUDA', ('preflight.py',), 10,"
            " t.JUDGES['preflight'].judge), t._step('good', 'good.py'),"
            " t._step('hang', 'hang.py', timeout_s=60), t._step('after', 'good.py'))\n"
            "gpu_check.main([sys.argv[1]])\n"
        ),
    })
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(out)],
                               cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "hanging").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "hanging").exists(), "the hanging step never started"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the whole run, as a device lease ending would
        process.wait(timeout=10)
    data = json.loads((out / "gpu_check.json").read_text())
    statuses = {step["name"]: step["status"] for step in data["steps"]}
    assert statuses == {"preflight": "passed", "good": "passed", "hang": "not run",
                        "after": "not run", "memory": "not run"}
    assert data["passed"] is False
    markdown = (out / "gpu_check.md").read_text()
    assert "| the x ratio | 2.00 | goal >= 1 |" in markdown
    assert "the check ended before this step" in markdown


def test_a_preflight_that_crashes_once_runs_again_and_one_without_cuda_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, {
        "flaky.py": "import os, sys\n"
                    "if not os.path.exists('tried'):\n"
                    "    open('tried', 'w'); sys.exit(1)\n"
                    f"print({json.dumps(FACTS)!r})\n",
        "nocuda.py": "open('runs', 'a').write('x')\n"
                     f"print({json.dumps({**FACTS, 'cuda_available': False})!r})\n",
    })
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", (
        gpu_check.Step("preflight", "CUDA", ("flaky.py",), 10, JUDGES["preflight"].judge),))
    gpu_check.main([str(tmp_path / "a")])
    (preflight, *_) = json.loads((tmp_path / "a" / "gpu_check.json").read_text())["steps"]
    assert preflight["status"] == "passed"
    monkeypatch.setattr(gpu_check, "STEPS", (
        gpu_check.Step("preflight", "CUDA", ("nocuda.py",), 10, JUDGES["preflight"].judge),))
    assert gpu_check.main([str(tmp_path / "b")]) == 1
    assert (tmp_path / "runs").read_text() == "x"


def test_the_steps_get_a_file_drawing_matplotlib_quiet_nccl_and_a_world_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ("MPLBACKEND", "MPLCONFIGDIR", "NCCL_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK",
             "MASTER_ADDR", "MASTER_PORT", "DBO_IN_GPU_CHECK")
    _write(tmp_path, {"env.py": "import json, os\n"
                                f"print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))"})
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    plain = gpu_check.run_step(_step("plain", "env.py"), tmp_path)["result"]
    world = gpu_check.run_step(
        gpu_check.Step("world", "w", ("env.py",), 10, _x_rows, world_of_one=True), tmp_path
    )["result"]
    assert plain["MPLBACKEND"] == "Agg" and plain["NCCL_DEBUG"] == "WARN"
    assert Path(plain["MPLCONFIGDIR"]).is_dir() and plain["RANK"] is None
    assert plain["DBO_IN_GPU_CHECK"] == "1"
    assert (world["RANK"], world["WORLD_SIZE"], world["LOCAL_RANK"]) == ("0", "1", "0")
    assert world["MASTER_ADDR"] == "127.0.0.1" and int(world["MASTER_PORT"]) > 0


def test_a_run_where_every_step_passes_reports_its_rows_and_passes(tmp_path: Path) -> None:
    records = [_preflight_record(tmp_path), gpu_check.judge_step(
        _step("bench"), 0, 'human line\n{"x": 2.0, "cuda_alloc_retries": 0}\n', tmp_path)]
    records.append(gpu_check.alloc_retries(records))
    markdown, data = gpu_check.report(records, STARTED, 12.3, "python benchmarks/gpu_check.py O")
    lines = markdown.splitlines()
    assert lines[0] == "# GPU check: passed", lines[0]
    assert lines[2] == "3 of 3 steps passed (preflight, bench, memory).", lines[2]
    assert "Date: 2026-01-02 03:04 UTC" in markdown
    assert "GPU: NVIDIA H200, 139.8 GiB, compute capability 9.0" in markdown
    assert "torch 2.11.0+cu130, Python 3.12.3" in markdown
    assert "| bench | checks bench | passed |" in markdown
    assert "| the x ratio | 2.00 | goal >= 1 |" in lines
    assert any(line.startswith("| `torch.cuda.memory_stats()") and "bench 0" in line
               for line in lines), markdown
    assert "did not pass" not in markdown
    decoded = json.loads(json.dumps(data))  # the JSON file holds exactly this
    assert decoded["passed"] is True and decoded["machine"] == FACTS
    assert [step["status"] for step in decoded["steps"]] == ["passed"] * 3
    assert decoded["steps"][1]["result"] == {"x": 2.0, "cuda_alloc_retries": 0}


@pytest.mark.parametrize(
    ("returncode", "output", "status", "why"),
    [
        (None, "started\nstill working\n", "timed out", "timed out after 10 s"),
        (3, "Traceback (most recent call last):\nRuntimeError: boom\n", "failed", "exit status 3"),
        (0, "a table and no JSON line\n", "failed", "no result"),
        (0, '{"x": 0.5}\n', "failed", "goal missed: x below 1"),
        (0, '{"y": 1}\n', "failed", "unexpected result (KeyError"),
        (0, '{"x": 2.0, "cuda_alloc_retries": 3}\n', "passed", ""),  # memory fails instead
    ],
)
def test_a_step_that_fails_times_out_or_misses_a_goal_fails_the_run(
    tmp_path: Path, returncode: int | None, output: str, status: str, why: str
) -> None:
    record = gpu_check.judge_step(_step("bench"), returncode, output, tmp_path)
    assert record["status"] == status and record["why"].startswith(why), record
    records = [_preflight_record(tmp_path), record]
    records.append(gpu_check.alloc_retries(records))
    markdown, data = gpu_check.report(records, STARTED, 1.0, "cmd")
    assert data["passed"] is False
    assert markdown.startswith("# GPU check: failed (") and "## What did not pass" in markdown
    if status != "passed":
        assert f"- **bench** ({status}): {why}" in markdown
    else:
        assert "- **memory** (failed): bench: 3 cudaMalloc retries" in markdown
    if returncode != 0 or status == "failed" and why == "no result":
        assert "  " + output.splitlines()[-1] in markdown.splitlines()  # the log's tail


def _write(directory: Path, scripts: dict[str, str]) -> None:
    for name, text in scripts.items():
        (directory / name).write_text(text)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no longer runs


def test_main_runs_each_step_under_its_timeout_and_exits_1_when_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, {
        "preflight.py": f"print({json.dumps(FACTS)!r})",
        "good.py": 'print("human output"); print(\'{"x": 2.0, "cuda_alloc_retries": 0}\')',
        "bad.py": "raise SystemExit(3)",
        "slow.py": "import subprocess, sys, time\n"
                   "child = subprocess.Popen(['sleep', '60'])\n"
                   "open(sys.argv[1], 'w').write(str(child.pid))\ntime.sleep(60)\n",
    })
    out = tmp_path / "out"
    steps = (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10, JUDGES["preflight"].judge),
             _step("good", "good.py"), _step("bad", "bad.py"),
             _step("slow", "slow.py", "{out}/child.pid", timeout_s=1.0))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    begin = time.monotonic()
    assert gpu_check.main([str(out)]) == 1
    assert time.monotonic() - begin < 30
    data = json.loads((out / "gpu_check.json").read_text())
    assert {step["name"]: step["status"] for step in data["steps"]} == {
        "preflight": "passed", "good": "passed", "bad": "failed", "slow": "timed out",
        "memory": "passed",
    }
    child = int((out / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the timed-out step's process group was not killed"
    assert "human output" in (out / "good.log").read_text()
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.startswith("# GPU check: failed (2 of 5 steps did not pass)")
    assert markdown.splitlines()[2].startswith(
        "3 of 5 steps passed (preflight, good, memory); bad failed (exit status 3); slow timed")
    assert "- good: `python good.py`" in markdown
    assert "report: " in capsys.readouterr().err
    assert gpu_check.main([str(out), "--only", "good"]) == 0  # a rerun of one step
    assert [step["name"] for step in json.loads((out / "gpu_check.json").read_text())["steps"]
            ] == ["preflight", "good", "memory"]


def test_without_cuda_nothing_but_the_preflight_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, {
        "preflight.py": f"print({json.dumps({**FACTS, 'cuda_available': False})!r})",
        "never.py": "open('ran', 'w')",
    })
    steps = (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10, JUDGES["preflight"].judge),
             _step("never", "never.py"))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main([str(tmp_path / "out")]) == 1
    assert not (tmp_path / "ran").exists()
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [step["status"] for step in data["steps"]] == ["failed", "not run", "not run"]
    assert data["verdict"].startswith("not run: no CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_wrapper_without_cuda_exits_1_quickly_and_says_so_in_the_report(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    begin = time.monotonic()
    completed = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert time.monotonic() - begin < 30
    assert "gpu_check: not run: no CUDA device" in completed.stderr
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("# GPU check: not run: no CUDA device (torch ")
    assert json.loads((tmp_path / "gpu_check.json").read_text())["passed"] is False
    usage = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
                           capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage: " in usage.stderr


def _overlap_row(size_ms: float, hidden: float) -> dict[str, Any]:
    return {"c_nominal_ms": size_ms, "m_ms": size_ms, "num_ubatches": 2, "hidden": hidden}


def test_the_overlap_goal_counts_from_200_us() -> None:
    result = {"dtype": "bfloat16", "layers": 32, "rows": [
        _overlap_row(0.1, 0.5), _overlap_row(0.2, 0.96), _overlap_row(0.5, 0.93),
        {**_overlap_row(1.0, 0.2), "num_ubatches": 3},  # not a 2-ubatch row: not judged
    ]}
    (row,), problems = JUDGES["overlap"].judge(result)
    assert row[1] == "0.50 / 0.96 / 0.93" and "c = m = 0.1 / 0.2 / 0.5 ms" in row[0]
    assert problems == ["goal missed: hidden 0.93 at c = m = 0.5 ms (goal >= 0.95)"]


def test_pytest_results_come_from_its_junit_xml(tmp_path: Path) -> None:
    (tmp_path / "pytest.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.t" name="test_a"/>'
        '<testcase classname="tests.gpu.t" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.gpu.t" name="test_c"><skipped message="2 GPUs"/></testcase>'
        '<testcase classname="tests.unit.w" name="test_d"><error message="e"/></testcase>'
        "</testsuite></testsuites>"
    )
    step = JUDGES["pytest"]
    record = gpu_check.judge_step(step, 1, "", tmp_path)
    assert record["status"] == "failed" and record["problems"] == [
        "failed: tests.gpu.t::test_b", "error: tests.unit.w::test_d"]
    assert record["rows"][0][1] == "1 passed, 1 failed, 1 errors, 1 skipped"
    assert "2 GPUs" in record["rows"][0][2]
    (tmp_path / "pytest.xml").write_text("<testsuites><testsuite>")  # cut short by a kill
    assert step.parse("", tmp_path) is None


def test_without_its_junit_file_the_pytest_step_reads_the_verbose_log(tmp_path: Path) -> None:
    """pytest writes its JUnit file at the end: a step killed at its timeout has only the
    `-v` lines, which name each test's status and the one still running."""
    log = "\n".join([
        "============ test session starts ============",
        "tests/gpu/test_a.py::test_one PASSED                         [ 20%]",
        "tests/gpu/test_a.py::test_two FAILED                         [ 40%]",
        "tests/gpu/test_b.py::test_three SKIPPED (needs 2 GPUs)       [ 60%]",
        "tests/gpu/test_b.py::test_four ERROR                         [ 80%]",
        "tests/gpu/test_c.py::test_slow ",
    ])
    step = JUDGES["pytest"]
    record = gpu_check.judge_step(step, None, log, tmp_path)
    assert record["status"] == "timed out"
    assert record["result"]["passed"] == 1
    assert record["result"]["skipped"] == {"tests/gpu/test_b.py::test_three": "needs 2 GPUs"}
    assert record["problems"] == [
        "failed: tests/gpu/test_a.py::test_two", "error: tests/gpu/test_b.py::test_four",
        "still running when the step ended: tests/gpu/test_c.py::test_slow"]
    assert step.parse("no test line\n", tmp_path) is None


@pytest.mark.parametrize(
    ("name", "result", "problem"),
    [
        ("graph", {"link_us": 30, "rows": [{"tokens": 16, "graph_speedup": 3.0,
                                            "dbo_vs_whole": 1.1, "bitwise_equal": False}]},
         "graph replay differs from eager DBO at 16 tokens"),
        ("sync-debug", {"sync_error": "RuntimeError: called a synchronizing CUDA operation",
                        "bitwise_equal": False, "sync_checked": True, "backend": "nccl",
                        "device": "cuda", "steps": 10, "tokens": 128, "capacity": 128},
         "a synchronizing CUDA call: RuntimeError"),
        ("moe-fixed", {"backend": "gloo", "device": "cpu", "bitwise_equal": True,
                       "allclose_vs_unsplit": True, "tokens": 256, "speedup": 1.0,
                       "speedup_vs_split": 1.2}, "ran with gloo on cpu, not NCCL"),
        ("compiled", {"graph_breaks": 2, "equal": True, "ms": dict.fromkeys(
            ("eager in turn", "eager DBO", "compiled in turn", "compiled DBO"), 1.0)},
         "2 graph break(s) in the compiled MoE model"),
        ("memory", {"device": "cuda", "wrappers": {"fsdp": {
            "param_mib": 64.0, "whole_forward_mib": 15.0, "whole_backward_mib": 42.0,
            "dbo_forward_mib": 74.0, "dbo_backward_mib": 44.0}}},
         "fsdp: DBO's forward peak is 59.0 MiB over the whole batch's"),
        ("workspace", {"rows": [{"device": "cpu", "case": "small", "workspace_us": 1.0,
                                 "empty_us": 2.0}]}, "no CUDA rows"),
    ],
)
def test_each_benchmark_step_names_what_is_wrong(
    name: str, result: dict[str, Any], problem: str
) -> None:
    rows, problems = JUDGES[name].judge(result)
    assert rows and problems and problems[0].startswith(problem), problems


def _benchmark(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_graph_benchmarks_model_overlaps_bitwise_equal_to_serial_on_cpu() -> None:
    import dbo
    from comm import EmulatedLink

    graph_replay = _benchmark("graph_replay.py")
    fn = graph_replay.make_model(2, 32, 64, EmulatedLink(0.0005), torch.device("cpu"))
    x = torch.randn(16, 32).to(torch.bfloat16)
    expected = torch.cat([fn(part) for part in x.tensor_split(2)])
    try:
        assert torch.equal(dbo.overlap(fn, timeout_s=30)(x), expected)
    finally:
        dbo.close_default_runners()


@pytest.mark.distributed
def test_the_sync_debug_script_runs_the_fixed_shape_path_on_one_gloo_rank() -> None:
    """On CPU there is no sync check; this keeps the script's model and checks working."""
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         str(ROOT / "benchmarks" / "moe_sync_debug.py"), "--layers", "2", "--steps", "2",
         "--tokens", "32", "--capacity", "8", "--json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["backend"] == "gloo" and result["sync_checked"] is False
    assert result["sync_error"] is None and result["bitwise_equal"] is True


def test_when_nccl_does_not_start_the_check_retries_with_the_recipe_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, {
        "preflight.py": f"print({json.dumps(FACTS)!r})",
        "nccl.py": "import os, sys\n"
                   "if os.environ.get('NCCL_SHM_DISABLE') != '1':\n"
                   "    sys.exit('RuntimeError: NCCL error: unhandled system error')\n"
                   "print('{\"nccl_ok\": true}')\n",
        "never.py": "raise SystemExit('RuntimeError: ncclInternalError')",
        "env.py": "import json, os\n"
                  "print(json.dumps({'x': 2.0, 'shm': os.environ.get('NCCL_SHM_DISABLE')}))",
    })
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)

    def steps(nccl_script: str) -> tuple[Any, ...]:
        return (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10,
                               JUDGES["preflight"].judge),
                gpu_check.Step("nccl", "NCCL", (nccl_script,), 10, JUDGES["nccl"].judge,
                               world_of_one=True),
                gpu_check.Step("world", "w", ("env.py",), 10, _x_rows, world_of_one=True),
                _step("plain", "env.py"))

    monkeypatch.setattr(gpu_check, "STEPS", steps("nccl.py"))
    gpu_check.main([str(tmp_path / "a")])
    data = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    by_name = {step["name"]: step for step in data["steps"]}
    assert by_name["nccl"]["status"] == "passed"
    assert by_name["nccl"]["why"].startswith("passed only with NCCL_CUMEM_ENABLE=0")
    assert "unhandled system error" in by_name["nccl"]["why"]
    assert by_name["world"]["result"]["shm"] == "1" and by_name["plain"]["result"]["shm"] == "1"
    monkeypatch.setattr(gpu_check, "STEPS", steps("never.py"))
    gpu_check.main([str(tmp_path / "b")])
    data = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    by_name = {step["name"]: step for step in data["steps"]}
    assert by_name["nccl"]["status"] == "failed"
    assert by_name["world"]["status"] == "not run"
    assert "NCCL did not start" in by_name["world"]["why"]
    assert "ncclInternalError" in by_name["world"]["why"]
    assert by_name["plain"]["status"] == "passed" and by_name["plain"]["result"]["shm"] is None


def test_the_opening_sentence_names_the_failures_and_the_key_figures() -> None:
    records = [
        gpu_check._record("overlap", "o", "passed", rows=[("hidden", "0.97 / 0.98", "goal")]),
        gpu_check._record("graph", "g", "failed", "graph replay differs from eager DBO",
                          rows=[("eager over replay", "3.10x", "")]),
        gpu_check._record("workspace", "w", "not run", "the 420 s budget of the check was spent"),
    ]
    assert gpu_check._summary(records) == (
        "1 of 3 steps passed (overlap); graph failed (graph replay differs from eager DBO); "
        "workspace not run (the 420 s budget of the check was spent). Key figures: overlap "
        "0.97 / 0.98; graph 3.10x."
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_wrapper_picks_a_python_whose_torch_sees_cuda_and_names_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, sees in (("python3", 1), ("python", 0)):  # only `python` "sees" CUDA
        script = bin_dir / name
        script.write_text(
            "#!/usr/bin/env bash\n"
            f'if [ "$1" = "-c" ] && [[ "$2" == *is_available* ]]; then exit {sees}; fi\n'
            f'exec {sys.executable} "$@"\n'
        )
        script.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    completed = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out"),
         "--only", "nccl"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert f"gpu_check: using {bin_dir / 'python'} (Python 3." in completed.stderr, completed.stderr
    assert (tmp_path / "out" / "gpu_check.md").exists()


def test_the_overlap_benchmark_times_each_transfer_as_it_runs_in_the_overlap() -> None:
    """On CUDA the ideal uses each transfer's time as it ran beside the other ubatch's
    GEMMs (two timing events around it on its stream), not a transfer-only loop's."""
    import dbo
    from comm import EmulatedLink

    overlap_efficiency = _benchmark("overlap_efficiency.py")
    clock = iter(range(1000))

    class FakeEvent:  # records a tick; elapsed_time in ms between two records
        def record(self) -> None:
            self.at = next(clock)

        def elapsed_time(self, end: "FakeEvent") -> float:
            return float(end.at - self.at) * 3.0

    times = overlap_efficiency.TransferTimes(FakeEvent)
    loop = overlap_efficiency.make_layer_loop(
        3, 1, EmulatedLink(0.0), torch.device("cpu"), times=times)
    try:
        dbo.overlap(loop, timeout_s=30)(torch.zeros(8, 4))
    finally:
        dbo.close_default_runners()
    assert len(times._pairs) == 3 * 2  # every transfer of both ubatches, bracketed
    assert times.take_mean_s() == pytest.approx(0.003)  # consecutive ticks, 3 ms apart
    assert times._pairs == [] and times.take_mean_s() != times.take_mean_s()  # nan: none


def _wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of one module `name` holding `source`."""
    import zipfile

    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": source,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{file},,\n" for file in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def test_the_carried_wheels_are_installed_for_the_steps_and_named_in_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "carriedpkg", "1.2", "VERSION = '1.2'\n")
    _write(tmp_path, {"preflight.py": f"print({json.dumps(FACTS)!r})",
                      "uses.py": "import carriedpkg, json\n"
                                 "print(json.dumps({'x': float(carriedpkg.VERSION), "
                                 "'cuda_alloc_retries': 0}))"})
    steps = (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10, JUDGES["preflight"].judge),
             _step("uses", "uses.py", timeout_s=30))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main([str(tmp_path / "out"), "--wheels", str(wheels)]) == 0
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["steps"][1]["result"] == {"x": 1.2, "cuda_alloc_retries": 0}
    assert data["machine"]["carried_wheels"].startswith("1 wheels installed from")
    assert "carriedpkg 1.2" in data["machine"]["carried_wheels"]
    assert gpu_check.install_wheels(tmp_path / "none", tmp_path / "out").startswith("none carried")
    assert not (tmp_path / "out" / gpu_check.PYLIB).exists()  # an earlier run's is gone


@pytest.mark.parametrize(("version", "why"), [
    ("5.17.0", "transformers 5.17.0 is not one of dbo's tested releases"),
    (None, "no transformers imports (ImportError: huggingface-hub>=2.4.0 is required"),
])
def test_a_step_needing_transformers_is_skipped_with_why_and_the_run_passes_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str | None, why: str
) -> None:
    facts = {**FACTS, "transformers": version, "transformers_tested": False,
             "transformers_error": "ImportError: huggingface-hub>=2.4.0 is required"}
    _write(tmp_path, {"preflight.py": f"print({json.dumps(facts)!r})",
                      "good.py": 'print(\'{"x": 2.0, "cuda_alloc_retries": 0}\')',
                      "never.py": "open('ran', 'w')"})
    steps = (gpu_check.Step("preflight", "CUDA", ("preflight.py",), 10, JUDGES["preflight"].judge),
             _step("good", "good.py"),
             gpu_check.Step("hf", "needs transformers", ("never.py",), 10, _x_rows,
                            needs_transformers=True))
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main([str(tmp_path / "out")]) == 0
    assert not (tmp_path / "ran").exists()
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    hf = data["steps"][2]
    assert hf["status"] == "skipped" and hf["why"].startswith(why), hf["why"]
    assert "python benchmarks/gpu_wheels.py" in hf["why"]
    assert data["verdict"] == "passed"
    assert "hf skipped (" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_the_preflight_reports_the_transformers_it_imports_and_whether_dbo_tested_it(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    from dbo.hf.versions import is_tested

    facts = gpu_check.run_step(JUDGES["preflight"], tmp_path, 60)["result"]
    assert facts["transformers"] == transformers.__version__
    assert facts["transformers_tested"] is is_tested(transformers.__version__)
    generate = [step for step in gpu_check.STEPS if step.needs_transformers]
    assert [step.name for step in generate] == ["generate-graph"]


def test_the_wheels_carried_to_the_gpu_machine_are_pinned_and_hold_a_tested_transformers() -> None:
    from dbo.hf.versions import is_tested

    path = ROOT / "benchmarks" / "gpu_wheels.py"
    spec = importlib.util.spec_from_file_location("gpu_wheels", path)
    assert spec is not None and spec.loader is not None
    gpu_wheels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_wheels)
    wanted = gpu_wheels.requirements(gpu_wheels.pins())
    assert len(wanted) == len(gpu_wheels.CARRIED) and wanted[0].startswith("transformers==")
    assert is_tested(wanted[0].split("==")[1])
    with pytest.raises(SystemExit, match="pins no transformers"):
        gpu_wheels.requirements({})
