"""The fixed-shape MoE path makes no synchronizing CUDA call: an overlapped MoE forward
on one NCCL rank under `torch.cuda.set_sync_debug_mode("error")` (which raises on any
`.item()`, `.tolist()`, device-to-host copy or synchronize in any thread), and its output
bitwise the serial run's. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from world_of_one import run_world_of_one

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)  # a cold start with CUDA and NCCL communicators
def test_an_overlapped_fixed_shape_moe_forward_makes_no_synchronizing_call() -> None:
    completed = run_world_of_one([ROOT / "benchmarks" / "moe_sync_debug.py", "--layers", "2",
                                  "--steps", "3", "--tokens", "64", "--json"])
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["device"] == "cuda" and result["sync_checked"] is True
    assert result["sync_error"] is None and result["bitwise_equal"] is True
