"""`benchmarks/hf_families.py` runs families that generate the same tokens under DBO
(Gemma 2's sliding windows, Inkling's windows beside Mamba-like states in one layer,
MiniMax's cache class of its own), with either cache kind, and reports them in its
--json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_families.py"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_families_survey_reports_the_families_it_runs(cache: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "qwen2_moe,gemma2,inkling_text,minimax",
         "--cache", cache, "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    families = result["families"]
    for kind in ("qwen2_moe", "gemma2", "inkling_text", "minimax"):
        assert families[kind] == {"outcome": "equal"}, families
    assert result["counts"] == {"equal": 4}
