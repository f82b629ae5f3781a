"""`examples/train_moe.py` (what `make demo-train` runs) works end to end on a tiny model:
equal losses and weights, the --json keys, each rank's trace of a training step with
the backward's turns in the ubatch threads, and its PNG. `examples/train_fsdp.py` (`make
demo-train-fsdp`) too: allclose losses and one reduce-scatter per sharded layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"

JSON_KEYS = {
    "losses_equal", "weights_equal", "forward_speedup_vs_split", "backward_speedup_vs_split",
    "step_speedup_vs_split", "blocked_backward_split_ms", "blocked_backward_dbo_ms",
    "forward_dbo_ms", "backward_dbo_ms", "step_dbo_ms", "world_size", "tokens",
}


def test_the_training_example_trains_alike_in_both_modes_and_reports_json(
    tmp_path: Path,
) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--spawn", "2", "--layers", "2", "--tokens", "64",
            "--steps", "2", "--warmup", "1", "--timeout-s", "60", "--json",
            "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=150,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert not JSON_KEYS - result.keys(), JSON_KEYS - result.keys()
    assert result["losses_equal"] is True and result["weights_equal"] is True
    assert (result["world_size"], result["tokens"]) == (2, 64)
    assert result["backward_speedup_vs_split"] > 0 and result["step_speedup_vs_split"] > 0
    assert "losses (DBO, first steps)" in completed.stdout
    for rank in (0, 1):
        events = json.loads((tmp_path / f"train_rank{rank}.json").read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert {"dbo.overlap", "dbo.overlap backward", "baton"} <= names, names
        picture = tmp_path / f"train_rank{rank}.png"
        assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


FSDP_SCRIPT = SCRIPT.with_name("train_fsdp.py")
FSDP_JSON_KEYS = {
    "losses_close", "largest_loss_difference", "forward_speedup_vs_split",
    "backward_speedup_vs_split", "step_speedup_vs_split", "reduce_scatters_split",
    "reduce_scatters_dbo", "reduce_scatter_dbo_ms", "world_size", "tokens",
}


def test_the_fsdp_training_example_trains_alike_and_reduces_each_unit_once() -> None:
    completed = subprocess.run(
        [
            sys.executable, str(FSDP_SCRIPT), "--spawn", "2", "--layers", "2", "--tokens",
            "64", "--steps", "2", "--warmup", "1", "--timeout-s", "60", "--json",
        ],
        capture_output=True, text=True, timeout=150,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert not FSDP_JSON_KEYS - result.keys(), FSDP_JSON_KEYS - result.keys()
    assert result["losses_close"] is True
    # Two sharded layers: one reduce-scatter each per backward, in both modes.
    assert result["reduce_scatters_split"] == result["reduce_scatters_dbo"] == 2, result
    assert "DBO losses allclose to in turn" in completed.stdout
