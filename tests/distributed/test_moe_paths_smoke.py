"""`benchmarks/moe_paths.py` runs both MoE paths side by side and counts their host reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_paths.py"


def test_both_paths_are_timed_and_only_the_dynamic_one_reads_the_host() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "8,16", "--layers", "2", "--steps", "2",
         "--timeout-s", "60", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rows = json.loads(completed.stdout.strip().splitlines()[-1])["rows"]
    assert [(row["tokens"], row["path"]) for row in rows] == [
        (8, "dynamic"), (8, "fixed"), (16, "dynamic"), (16, "fixed"),
    ]
    for row in rows:
        assert row["whole_ms"] > 0 and row["dbo_ms"] > 0
        assert row["host_reads_per_step"] == (2 if row["path"] == "dynamic" else 0)  # per layer
