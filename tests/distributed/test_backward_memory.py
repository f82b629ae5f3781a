"""An overlapped call keeps the memory of the same model without DBO: one copy of the
parameters' gradients at the backward's peak, and under FSDP2 about one unit's worth of
parameters and gradients gathered more than the whole batch's step, forward and backward
(`benchmarks/backward_memory.py`: the resident set's high-water mark on Linux, in
processes of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc"),
]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "backward_memory.py"


@pytest.fixture(scope="module")
def peaks() -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--wrapper", "none,fsdp", "--layers", "8", "--rounds",
         "2", "--timeout-s", "60", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert all(peaks["param_mib"] == 32.0 for peaks in result["wrappers"].values()), result
    return result["wrappers"]


def test_the_overlapped_backward_holds_one_copy_of_the_parameters_gradients(
    peaks: dict[str, Any],
) -> None:
    result = peaks["none"]
    param = result["param_mib"]
    # In turn: the gradients (one copy) and little else. A copy per ubatch would be 2x.
    assert 0.8 * param < result["in_turn_backward_mib"] < 1.4 * param, result
    assert result["dbo_backward_mib"] < result["in_turn_backward_mib"] + 0.25 * param, result


def test_under_fsdp2_the_ubatches_take_turns_per_unit_and_gather_little_more(
    peaks: dict[str, Any],
) -> None:
    result = peaks["fsdp"]
    unit = result["param_mib"] / 8  # one linear, gathered
    # Were every unit gathered before the other ubatch left the first: 8 units more in
    # the forward, and their gradients too in the backward.
    assert result["dbo_forward_mib"] < result["whole_forward_mib"] + unit, result
    assert result["dbo_backward_mib"] < result["whole_backward_mib"] + 2 * unit, result
