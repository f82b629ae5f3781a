"""`examples/moe_overlap.py` (what `make demo` runs) works end to end on a tiny model.

The script exits non-zero when the overlapped forward differs from the serial one; the
--json line carries the checks and the timings, and every rank leaves its trace and PNG.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "moe_overlap.py"

JSON_KEYS = {
    "world_size", "num_ubatches", "tokens", "serial_ms", "split_ms", "dbo_ms", "speedup",
    "speedup_vs_split", "blocked_split_ms", "blocked_dbo_ms", "bitwise_equal",
    "max_abs_diff_vs_unsplit",
}


def test_the_moe_demo_matches_serial_reports_json_and_writes_each_ranks_trace_and_png(
    tmp_path: Path,
) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--spawn", "2", "--layers", "1", "--tokens", "64",
            "--steps", "2", "--timeout-s", "60", "--json", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert not JSON_KEYS - result.keys(), JSON_KEYS - result.keys()
    assert result["bitwise_equal"] is True
    assert (result["world_size"], result["num_ubatches"], result["tokens"]) == (2, 2, 64)
    assert result["speedup"] > 0 and result["speedup_vs_split"] > 0
    assert result["max_abs_diff_vs_unsplit"] < 1e-4
    assert "NCCL" not in completed.stdout  # a gloo run says what applies to gloo
    for rank in (0, 1):
        trace, picture = tmp_path / f"dbo_rank{rank}.json", tmp_path / f"dbo_rank{rank}.png"
        events = json.loads(trace.read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert {"baton", "dbo.overlap", "wait all_to_all_single"} <= names, names
        assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert str(picture) in completed.stdout  # the last lines name the files
