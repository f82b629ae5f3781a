"""workspace: scratch memory as views of one preallocated buffer per ubatch slot.

    from workspace import init_workspace_manager, current_workspace_manager, lock_workspace

    init_workspace_manager("cuda", num_ubatches=2)
    q, idx = current_workspace_manager().get_simultaneous(((T, H), torch.bfloat16),
                                                           ((T, K), torch.int32))
    ...warmup with the largest batch...
    lock_workspace()          # from here on: no allocation, fixed addresses

Set DBO_DEBUG_WORKSPACE=1 to log resizes, lock and unlock.
"""

from workspace._global import (
    current_workspace_manager,
    init_workspace_manager,
    is_workspace_manager_initialized,
    lock_workspace,
    reset_workspace_manager,
    unlock_workspace,
)
from workspace.manager import (
    ALIGNMENT_BYTES,
    WorkspaceAllocationError,
    WorkspaceLockedError,
    WorkspaceManager,
    WorkspaceStats,
)

__all__ = [
    "ALIGNMENT_BYTES",
    "WorkspaceAllocationError",
    "WorkspaceLockedError",
    "WorkspaceManager",
    "WorkspaceStats",
    "current_workspace_manager",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
]
