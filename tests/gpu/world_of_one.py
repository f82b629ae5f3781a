"""Run a script as rank 0 of a world of one: the env:// variables torchrun would set, set
here (one interpreter, no torchrun agent to start or outlive a timeout), on a free port,
with this checkout on the path.

    completed = run_world_of_one([script, "--json"], timeout_s=120)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_world_of_one(
    argv: Sequence[object], timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python *argv` as rank 0 of 1 (NCCL where the script picks it); output captured."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
