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


_TORCH_CALLS_PROBE = """
import torch
from torch.overrides import TorchFunctionMode
calls = []
class Counting(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))
with Counting():
    import dbo, workspace
print(calls)
"""


def test_importing_dbo_and_workspace_makes_no_tensor_and_calls_no_torch_function() -> None:
    """No tensor, autograd graph or device object is made at import: what dbo learns from
    torch (autograd's node types, the bindings' behaviour) it learns at first use."""
    completed = subprocess.run(
        [sys.executable, "-c", _TORCH_CALLS_PROBE], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]", completed.stdout


def test_dbo_imports_neither_workspace_nor_comm_nor_transformers() -> None:
    """The layering: workspace and comm build on dbo, never the reverse (no circle), and
    transformers is imported only once the user's code has."""
    probe = (
        "import sys, dbo, dbo.graphs, dbo.hf, dbo.split.rules\n"
        "print(sorted(m for m in ('workspace', 'comm', 'transformers') if m in sys.modules))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]", completed.stdout
    from pathlib import Path

    sources = (Path(__file__).resolve().parents[2] / "dbo").rglob("*.py")
    for source in sources:
        text = source.read_text()
        for needle in ("import workspace", "import comm", 'sys.modules.get("workspace")'):
            assert needle not in text, f"{source.name}: {needle}"


def test_comm_uses_dbo_only_through_its_public_names() -> None:
    """comm imports `dbo` and uses what `dbo/__init__.py` exports, never a private module."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "comm"
    for source in root.rglob("*.py"):
        text = source.read_text()
        assert not re.search(r"^\s*from dbo[ .]|^\s*import dbo\.", text, re.M), source.name
        assert not re.search(r"\bdbo\.(_\w+|runner|graphs|tracing|errors|split)\b", text), (
            source.name
        )


def test_workspace_uses_dbo_only_through_its_public_names() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "workspace"
    for source in root.rglob("*.py"):
        text = source.read_text()
        assert not re.search(r"^\s*from dbo[ .]|^\s*import dbo\.", text, re.M), source.name
        assert not re.search(r"\bdbo\._\w+", text), source.name
