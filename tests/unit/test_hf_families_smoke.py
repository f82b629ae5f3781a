"""`benchmarks/hf_families.py` tells families that generate the same tokens under DBO
(Gemma 2's sliding windows, Inkling's windows beside Mamba-like states in one layer) from
one dbo refuses (MiniMax's cache class of its own), with either cache kind, its
--json too."""

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
def test_the_families_survey_reports_equal_and_refused_families(cache: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "qwen2_moe,gemma2,inkling_text,minimax",
         "--cache", cache, "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    families = result["families"]
    for kind in ("qwen2_moe", "gemma2", "inkling_text"):
        assert families[kind] == {"outcome": "equal"}, families
    assert families["minimax"]["outcome"] == "refused", families  # a cache class of its own
    assert "MiniMaxCache" in families["minimax"]["why"], families
    assert result["counts"] == {"equal": 3, "refused": 1}
