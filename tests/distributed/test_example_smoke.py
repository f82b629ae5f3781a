"""`examples/moe_overlap.py` (what `make demo` runs) works end to end on a tiny model.

The script exits non-zero when the overlapped forward differs from the serial one, so
a clean exit also says DBO matched serial (bitwise on the same ubatch split).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "moe_overlap.py"


def test_the_moe_example_matches_serial_and_saves_each_ranks_timeline(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--spawn", "2", "--layers", "1", "--tokens", "64",
            "--steps", "1", "--timeout-s", "60", "--trace-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "(bitwise): True" in completed.stdout
    assert "host blocked in collective waits" in completed.stdout
    for rank in (0, 1):
        events = json.loads((tmp_path / f"dbo_rank{rank}.json").read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert {"baton", "dbo.overlap", "wait all_to_all_single"} <= names, names
