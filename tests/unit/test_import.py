"""Importing dbo has no side effects but its at-fork registration: no thread started,
no file descriptor opened (not even one closed again before the import returns)."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import os, threading
import torch
calls = []
def counting(name, original):
    def call(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    return call
threading.Thread.start = counting("Thread.start", threading.Thread.start)
os.open = counting("os.open", os.open)
if hasattr(os, "eventfd"):
    os.eventfd = counting("os.eventfd", os.eventfd)
import dbo
print(calls)
"""


def test_importing_dbo_opens_no_fd_and_starts_no_thread() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]", completed.stdout
