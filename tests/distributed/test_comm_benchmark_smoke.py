"""`benchmarks/comm_overlap.py` runs end to end on a tiny configuration.

The benchmark checks that every mode (serial, DBO, the hand-written pipeline, the bare
two-thread schedule, one shared group) computes exactly the serial result before it
times anything, so a run that exits 0 also says the modes agree.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_overlap.py"


def test_comm_overlap_benchmark_runs_and_prints_every_column() -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--rounds", "1", "--layers", "2",
            "--configs", "64:1.0", "--timeout-s", "60",
        ],
        capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    header = next(line for line in lines if line.startswith("per ubatch"))
    for column in ("DBO", "pipe", "thr", "DBO/pipe", "DBO/thr"):
        assert column in header.split(), column
    assert any(line.startswith("16 KB, c~1m") for line in lines), completed.stdout
