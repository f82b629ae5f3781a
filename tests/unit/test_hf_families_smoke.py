"""`benchmarks/hf_families.py` tells families that generate the same tokens under DBO
(Gemma 2's sliding windows, Inkling's windows beside Mamba-like states in one layer) from
one dbo refuses (DeepSeek-V4's cache layers of its own), with either cache kind, its
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
    refused = ",deepseek_v4" if cache == "dynamic" else ""  # it has no StaticCache at all
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", f"qwen2_moe,gemma2,inkling_text{refused}",
         "--cache", cache, "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    families = result["families"]
    for kind in ("qwen2_moe", "gemma2", "inkling_text"):
        assert families[kind] == {"outcome": "equal"}, families
    if refused:
        assert families["deepseek_v4"]["outcome"] == "refused", families
        assert "DeepseekV4HCACache" in families["deepseek_v4"]["why"], families
    assert result["counts"] == {"equal": 3, **({"refused": 1} if refused else {})}
