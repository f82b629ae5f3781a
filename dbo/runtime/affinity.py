"""CPU affinity of the calling thread (Linux: per thread, inherited by threads it starts).

A ubatch worker thread gets its CPUs once, from the thread that creates its runner, and
keeps them: the intra-op (OpenMP) pool a worker starts inherits its CPUs at that moment
and never follows a later change. `dbo.overlap` leases runners by the caller's CPUs,
and a worker that `fn` re-pinned is put back after the job.
"""

from __future__ import annotations

import contextlib
import os

_get_affinity = getattr(os, "sched_getaffinity", None)
_set_affinity = getattr(os, "sched_setaffinity", None)


def cpus_of_this_thread() -> frozenset[int] | None:
    """The CPUs the calling thread may run on; None where that is unknown (not Linux,
    or the call is refused)."""
    if _get_affinity is None:
        return None
    try:
        return frozenset(_get_affinity(0))  # pid 0: the calling thread
    except OSError:
        return None


def restore(cpus: frozenset[int] | None) -> None:
    """Put the calling thread back on `cpus` if it is elsewhere (best effort: a cpuset
    that changed under the process may refuse, and then the thread stays put)."""
    if cpus is None or _set_affinity is None or cpus_of_this_thread() in (cpus, None):
        return
    with contextlib.suppress(OSError):
        _set_affinity(0, cpus)
