"""`benchmarks/hf_families.py` tells families that generate the same tokens under DBO
(one with sliding-window layers among them) from one dbo refuses (DeepSeek-V4's cache
layers of its own), its --json too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_families.py"


@pytest.mark.timeout(180)
def test_the_families_survey_reports_equal_and_refused_families() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "qwen2_moe,gemma2,deepseek_v4", "--json"],
        capture_output=True, text=True, timeout=170,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    families = result["families"]
    assert families["qwen2_moe"] == {"outcome": "equal"}, families
    assert families["gemma2"] == {"outcome": "equal"}, families
    assert families["deepseek_v4"]["outcome"] == "refused", families
    assert "DeepseekV4HCACache" in families["deepseek_v4"]["why"], families
    assert result["counts"] == {"equal": 2, "refused": 1}
