"""`benchmarks/host_overhead.py` runs end to end on a tiny configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


def test_host_overhead_benchmark_prints_one_row_per_call_kind() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "5", "--rounds", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rows = [line for line in completed.stdout.splitlines() if " us" not in line]
    for label in ("outside an overlap", "inside (1 handoff each)", "dbo.overlap(identity)"):
        (row,) = [line for line in rows if label in line]
        numbers = [float(value) for value in row.split()[-3:]]
        assert numbers[0] > 0 and numbers[1] > 0, row  # ours and the bare op were timed
