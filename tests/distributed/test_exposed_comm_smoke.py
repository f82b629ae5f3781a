"""`benchmarks/exposed_comm.py` times the backward under DDP and FSDP2 with and without
their gradient reduction, for the whole batch and under DBO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "exposed_comm.py"


def test_each_wrapper_and_mode_is_timed_with_and_without_its_reduction() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "2", "--width", "64", "--rows", "16",
         "--steps", "2", "--timeout-s", "60", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert sorted(result) == ["ddp", "fsdp"], result
    for wrapper in result.values():
        assert sorted(wrapper) == ["dbo", "whole"], result
        for times in wrapper.values():
            assert times["backward_ms"] > 0 and times["without_sync_ms"] > 0, result
            assert times["exposed_ms"] == times["backward_ms"] - times["without_sync_ms"]
