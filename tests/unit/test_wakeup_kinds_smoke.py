"""`benchmarks/wakeup_kinds.py` runs end to end on a tiny configuration, its --json too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dbo.runtime import wakeup

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "wakeup_kinds.py"


@pytest.mark.skipif(
    wakeup.EventfdWakeup not in wakeup.kinds(), reason="only one wake-up kind here"
)
def test_wakeup_kinds_benchmark_prints_both_kinds_for_each_call() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for label in ("identity", "100 handoffs", "+ 1 matmul", "+ 5 matmuls"):
        (row,) = [line for line in completed.stdout.splitlines() if line.startswith(label)]
        lock_us, eventfd_us, ratio, lock_switches, eventfd_switches = (
            float(value) for value in row.split()[-5:]
        )
        assert lock_us > 0 and eventfd_us > 0 and ratio > 0, row
        assert lock_switches >= 0 and eventfd_switches >= 0, row
    result = json.loads(completed.stdout.splitlines()[-1])
    assert [row["call"] for row in result["rows"]] == [
        "identity", "100 handoffs", "+ 1 matmul", "+ 5 matmuls"
    ]
    assert all(row["eventfd_over_lock"] > 0 for row in result["rows"]), result
