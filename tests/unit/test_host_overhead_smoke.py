"""`benchmarks/host_overhead.py` runs end to end on a tiny configuration, its --json too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


def test_host_overhead_benchmark_prints_one_row_per_call_kind() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "5", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    rows = [line for line in lines[:-1] if " us" not in line]  # the table, not the JSON
    for label in ("outside an overlap", "inside (1 handoff each)", "dbo.overlap(identity)"):
        (row,) = [line for line in rows if label in line]
        numbers = [float(value) for value in row.split()[-3:]]
        assert numbers[0] > 0 and numbers[1] > 0, row  # ours and the bare op were timed
    result = json.loads(lines[-1])
    assert [row["label"] for row in result["rows"]] == [
        "all_to_all_single, outside an overlap", "all_to_all_single, inside (1 handoff each)",
        "dbo.overlap(identity), 2 ubatches",
    ]
    assert all(row["ours_us"] > 0 and row["bare_us"] > 0 for row in result["rows"]), result
