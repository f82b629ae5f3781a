"""`examples/quickstart.py` and `examples/tensor_parallel_mlp.py` run end to end.

Both exit non-zero when the overlapped result differs from the serial one, so a clean
exit also says their checks passed; the tests read the checks from the output too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_quickstart_prints_both_times_and_a_bitwise_match() -> None:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[-1] == "DBO == in turn (bitwise): True", completed.stdout
    in_turn = next(line for line in lines if line.startswith("two ubatches in turn"))
    overlapped = next(line for line in lines if line.startswith("two ubatches, DBO"))
    assert float(in_turn.split()[4]) > 0 and float(overlapped.split()[3]) > 0, lines
    assert "speedup" in overlapped, overlapped


def test_the_tensor_parallel_example_matches_serial_and_reports_json(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(EXAMPLES / "tensor_parallel_mlp.py"), "--spawn", "2",
            "--layers", "2", "--tokens", "64", "--hidden", "32", "--ffn", "64",
            "--steps", "2", "--timeout-s", "60", "--json", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    for key in (
        "world_size", "num_ubatches", "tokens", "serial_ms", "split_ms", "dbo_ms", "speedup",
        "speedup_vs_split", "blocked_split_ms", "blocked_dbo_ms", "bitwise_equal",
        "max_abs_diff_vs_unsplit", "max_abs_diff_vs_dense",
    ):
        assert key in result, key
    assert result["bitwise_equal"] is True
    assert (result["world_size"], result["num_ubatches"], result["tokens"]) == (2, 2, 64)
    assert result["max_abs_diff_vs_dense"] <= 1e-4  # the shards add up to the dense model
    assert result["dbo_ms"] > 0 and result["split_ms"] > 0
    for rank in (0, 1):
        events = json.loads((tmp_path / f"dbo_rank{rank}.json").read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert "wait all_reduce" in names, names
        assert (tmp_path / f"dbo_rank{rank}.png").stat().st_size > 0
