"""`benchmarks/comm_overlap.py` runs end to end on a tiny configuration, its --json too.

The benchmark checks that every mode (serial, DBO, DBO with hand-written collectives,
the hand-written pipeline, the bare two-thread schedule, one shared group) computes
exactly the serial result before it times anything, so a run that exits 0 also says the
modes agree.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_overlap.py"


def test_comm_overlap_benchmark_runs_and_prints_every_column() -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--rounds", "6", "--layers", "2",
            "--configs", "64:1.0", "--timeout-s", "60", "--json",
        ],
        capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    header = next(line for line in lines if line.startswith("per ubatch"))
    for column in ("DBO", "pipe", "thr", "DBO/pipe", "DBO/thr"):
        assert column in header.split(), column
    rows = [line for line in lines if line.startswith("16 KB, c~1m")]
    # the step times, the ratios' spread, and where DBO's time goes
    assert len(rows) == 3, completed.stdout
    assert rows[1].split()[-1] in ("faster", "tie", "slower"), rows[1]
    shares = next(line for line in lines if line.startswith("per ubatch") and "comm" in line)
    assert shares.split()[2:] == [
        "comm", "CI", "runtime", "CI", "threads", "CI", "thr", "vs", "pipe"
    ], shares
    comm_share, comm_ci, runtime_share, runtime_ci, thread_share, thread_ci, verdict = (
        rows[2].split()[3:]
    )
    for share, interval in (
        (comm_share, comm_ci), (runtime_share, runtime_ci), (thread_share, thread_ci)
    ):
        low, high = (float(bound) for bound in interval.split("-"))
        assert low <= float(share) <= high, rows[2]
    assert verdict in ("faster", "tie", "slower"), rows[2]
    (result,) = json.loads(lines[-1])["rows"]
    assert result["label"] == "16 KB, c~1m"
    assert result["serial"] > 0 and result["dbo"] > 0 and result["dbo/pipeline"] > 0, result


def _benchmark_module() -> Any:
    spec = importlib.util.spec_from_file_location("comm_overlap_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_median_interval_brackets_the_median_and_narrows_with_more_rounds() -> None:
    interval = _benchmark_module()._median_interval
    noisy = [1.0 + 0.1 * ((7 * i) % 11 - 5) / 5 for i in range(11)]  # 0.9 .. 1.1
    low, high = interval(noisy)
    assert low <= statistics.median(noisy) <= high
    assert 0.9 <= low < high <= 1.1
    wide = high - low
    low, high = interval(noisy * 9)  # the same spread, 9x the rounds
    assert high - low < wide
    assert interval([1.05] * 6) == (1.05, 1.05)


def test_the_median_interval_is_the_order_statistics_one_and_none_under_six() -> None:
    """[x_(k), x_(n+1-k)] covers the median with probability >= 95% whatever the
    distribution; under 6 rounds no such interval exists."""
    import math

    interval = _benchmark_module()._median_interval
    for n in range(1, 6):
        assert all(math.isnan(bound) for bound in interval([float(i) for i in range(n)]))
    assert interval([float(i) for i in range(6)]) == (0.0, 5.0)  # P(B <= 0) = 1/64
    values = [float(i) for i in range(20)][::-1]  # any order
    assert interval(values) == (5.0, 14.0)  # x_(6), x_(15): P(B <= 5) = 0.021
    assert interval([float(i) for i in range(100)]) == (39.0, 60.0)  # x_(40), x_(61)


def test_the_verdict_says_tie_only_when_the_interval_contains_one() -> None:
    verdict = _benchmark_module()._verdict
    assert verdict({"r lo": 0.95, "r hi": 0.99}, "r") == "faster"
    assert verdict({"r lo": 0.97, "r hi": 1.03}, "r") == "tie"
    assert verdict({"r lo": 1.01, "r hi": 1.08}, "r") == "slower"
    assert verdict({"r lo": float("nan"), "r hi": float("nan")}, "r") == "n/a"
