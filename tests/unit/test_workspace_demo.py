"""`examples/workspace_demo.py` (what `make demo-workspace` runs) tells its story, and
`--help` describes it without running it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "workspace_demo.py"


def test_the_workspace_demo_runs_to_its_end() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Done: after warmup and lock" in completed.stdout


def test_help_describes_the_demo_without_running_it() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    assert "A tour of the workspace manager" in completed.stdout
    assert "Workspace demo:" not in completed.stdout
