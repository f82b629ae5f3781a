"""A decode step with a StaticCache and the fixed-shape MoE path, captured with
`dbo.capture_graph` and replayed, gives the tokens of eager DBO generation: one NCCL rank
runs `benchmarks/generate_graph.py`. Skipped without CUDA, and inside
`benchmarks/gpu_check.py`, which runs the script as a step of its own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from world_of_one import run_world_of_one

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_generation_checks import skip_unless_tested_transformers  # noqa: E402

skip_unless_tested_transformers()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("DBO_IN_GPU_CHECK") == "1",
                       reason="benchmarks/gpu_check.py runs generate_graph.py as a step"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)  # a cold start with CUDA, NCCL and transformers
def test_a_captured_decode_step_replays_the_tokens_of_eager_dbo_generation() -> None:
    completed = run_world_of_one([ROOT / "benchmarks" / "generate_graph.py", "--json"])
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["device"] == "cuda" and result["captured"] is True
    assert result["tokens_equal"] is True and result["eager_loop_equal"] is True
