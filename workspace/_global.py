"""The process-wide workspace manager, behind accessor functions.

Modules deep inside a model reach their scratch memory through
`current_workspace_manager()` instead of having a manager passed through every call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

import dbo
from workspace.manager import WorkspaceManager

_holder_lock = threading.Lock()
_manager: WorkspaceManager | None = None
_capture_hook_added = False


def _lock_for_capture() -> Callable[[], None] | None:
    """`dbo.capture_graph`'s hook: lock the process-wide manager (if any, and unlocked)
    before the capture, so that the graph holds final addresses (a slot realized later
    would free a buffer the graph writes) and growth fails the capture; what undoes it."""
    manager = _manager
    if manager is None or manager.is_locked():
        return None
    manager.lock(by_capture=True)
    return manager.unlock


def init_workspace_manager(
    device: torch.device | str | int, num_ubatches: int | None = None
) -> WorkspaceManager:
    """Create the process-wide manager, or return the existing one if it matches.

    `num_ubatches=None` creates a one-slot manager, or returns the existing manager on
    `device` whatever its slot count (for library code that does not know how many
    ubatches the application overlaps with). Raises RuntimeError if a manager with another
    device or slot count exists: call `reset_workspace_manager()` first.
    """
    global _manager, _capture_hook_added
    wanted = WorkspaceManager(device, num_ubatches)  # validates; allocates nothing
    with _holder_lock:
        if not _capture_hook_added:  # on first use, not at import
            dbo.add_capture_hook(_lock_for_capture)
            _capture_hook_added = True
        if _manager is None:
            _manager = wanted
        elif _manager.device != wanted.device or (
            num_ubatches is not None and _manager.num_ubatches != wanted.num_ubatches
        ):
            raise RuntimeError(
                f"a workspace manager already exists ({_manager!r}); call "
                "reset_workspace_manager() before initializing one with "
                f"device={wanted.device}, num_ubatches={wanted.num_ubatches}"
            )
        return _manager


def is_workspace_manager_initialized() -> bool:
    """Whether `init_workspace_manager` has been called (and not reset since)."""
    return _manager is not None


def current_workspace_manager() -> WorkspaceManager:
    """The process-wide manager. Raises RuntimeError if none is initialized."""
    manager = _manager
    if manager is None:
        raise RuntimeError(
            "the workspace manager is not initialized; call "
            "workspace.init_workspace_manager(device, num_ubatches) first"
        )
    return manager


def lock_workspace() -> None:
    """`current_workspace_manager().lock()`."""
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    """`current_workspace_manager().unlock()`."""
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Forget the process-wide manager (no thread may still use it); its buffers are
    freed once no view refers to them."""
    global _manager
    with _holder_lock:
        _manager = None
