"""`examples/moe_overlap.py` (what `make demo` runs) works end to end on a tiny model.

The script exits non-zero when the overlapped forward differs from the serial one; the
--json line carries the checks and the timings, and every rank leaves its trace and PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "moe_overlap.py"

JSON_KEYS = {
    "world_size", "num_ubatches", "tokens", "serial_ms", "split_ms", "dbo_ms", "speedup",
    "speedup_vs_split", "blocked_split_ms", "blocked_dbo_ms", "bitwise_equal",
    "max_abs_diff_vs_unsplit",
}


def test_the_moe_demo_matches_serial_reports_json_and_writes_each_ranks_trace_and_png(
    tmp_path: Path,
) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--spawn", "2", "--layers", "1", "--tokens", "64",
            "--steps", "2", "--timeout-s", "60", "--json", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert not JSON_KEYS - result.keys(), JSON_KEYS - result.keys()
    assert result["bitwise_equal"] is True
    assert (result["world_size"], result["num_ubatches"], result["tokens"]) == (2, 2, 64)
    assert result["speedup"] > 0 and result["speedup_vs_split"] > 0
    assert result["max_abs_diff_vs_unsplit"] < 1e-4
    assert result["path"] == "dynamic" and result["host_reads_per_step"] == 1  # one layer
    assert "NCCL" not in completed.stdout  # a gloo run says what applies to gloo
    assert "the transfers use the same cores as the compute" in completed.stdout
    for rank in (0, 1):
        trace, picture = tmp_path / f"dbo_rank{rank}.json", tmp_path / f"dbo_rank{rank}.png"
        events = json.loads(trace.read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert {"baton", "dbo.overlap", "wait all_to_all_single"} <= names, names
        assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert str(picture) in completed.stdout  # the last lines name the files


@pytest.mark.parametrize("capacity", [64, 8], ids=["no-drops", "drops"])
def test_the_fixed_shape_path_reads_nothing_on_the_host_and_matches_its_ubatches(
    tmp_path: Path, capacity: int
) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--spawn", "2", "--layers", "2", "--tokens", "64",
            "--fixed-capacity", str(capacity), "--steps", "1", "--timeout-s", "60", "--json",
            "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["path"] == f"fixed-shape, capacity {capacity}"
    assert result["host_reads_per_step"] == 0 and result["bitwise_equal"] is True
    # Without drops all three modes compute the same thing; with them, the whole batch
    # (capacity 8 of 64 tokens) drops other tokens than the ubatches (8 of 32).
    assert result["allclose_vs_unsplit"] is (capacity == 64)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def test_under_torchrun_each_cpu_rank_pins_itself_to_cores_of_its_own(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--layers", "1", "--tokens", "64", "--steps", "1", "--json",
        "--out", str(tmp_path),
    ]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks on a GPU machine too
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=environment
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["bitwise_equal"] is True and result["backend"] == "gloo"
    assert result["pinned_cores_per_rank"] == (_cores() // 2 if _cores() >= 2 else None)


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "no-pin"])
def test_the_second_of_two_local_ranks_takes_the_second_half_of_the_cores(pin: bool) -> None:
    probe = (
        "import json, os, sys; sys.path.insert(0, sys.argv[1]); import _harness, torch; "
        "before = sorted(os.sched_getaffinity(0)); "
        f"pinned = _harness.pin_cpu_rank(pin={pin}); "
        "print(json.dumps([before, pinned, sorted(os.sched_getaffinity(0)), "
        "torch.get_num_threads()]))"
    )
    environment = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    completed = subprocess.run(
        [sys.executable, "-c", probe, str(SCRIPT.parent)], capture_output=True, text=True,
        timeout=60, env=environment,
    )
    assert completed.returncode == 0, completed.stderr
    before, pinned, after, threads = json.loads(completed.stdout)
    if len(before) < 2:
        pytest.skip("one core: nothing to share out")
    half = len(before) // 2
    assert threads == half
    assert pinned == (before[half:2 * half] if pin else None)
    assert after == (before[half:2 * half] if pin else before)


def test_without_torchrun_or_spawn_the_demo_says_how_to_launch_it() -> None:
    environment = {
        key: value for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    completed = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60,
        env=environment,
    )
    assert completed.returncode != 0
    assert "torchrun --nproc-per-node" in completed.stderr
    assert "--spawn 2" in completed.stderr
