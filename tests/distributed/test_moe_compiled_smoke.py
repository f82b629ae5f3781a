"""`benchmarks/moe_compiled.py` times the demo MoE compiled and eager, in turn and under DBO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_compiled.py"


def test_the_compiled_demo_model_has_no_graph_break_and_overlaps_as_compiled_in_turn() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "16", "--layers", "2", "--steps", "2",
         "--backend", "aot_eager", "--timeout-s", "60", "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["graph_breaks"] == 0, result
    assert result["equal"] and result["close_to_eager"], result
    assert result["turns"] == {"0": 5, "1": 5}, result  # two exchanges per layer, then the end
    assert all(ms > 0 for ms in result["ms"].values()), result
