"""What an aborted run leaves at interpreter exit, and how the exit waits for it.

A ubatch the watchdog gave up on (or a collective an aborted ubatch left in flight) runs
on in a daemon thread. Interpreter finalization would kill it inside a torch op (SIGABRT),
so the exit waits for it, bounded: `wait_at_exit` registers what to wait for, and one
atexit handler waits for all of it, `EXIT_WAIT_S` in all. Past that the process says so on
stderr and ends unfinalized.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_WAIT_S = 2.0
"""At exit, how long to wait in all for what aborted runs left running (`wait_at_exit`)."""

_left_running: list[Callable[[float], object]] = []  # `wait_at_exit`'s, still running
_left_running_lock = threading.Lock()


def wait_at_exit(still_running: Callable[[float], object]) -> None:
    """Have the exit (atexit: after the non-daemon threads are joined, before finalization
    kills the daemon ones in a torch op: SIGABRT) wait for `still_running(s)`, which waits
    up to s seconds and is truthy while it runs. Past `EXIT_WAIT_S` in all, the process
    says so and ends unfinalized: by SIGINT after an uncaught KeyboardInterrupt, else 1."""
    with _left_running_lock:
        kept = [it for it in _left_running if it is not still_running and it(0)]
        _left_running[:] = [*kept, still_running]
    atexit.unregister(_wait_at_exit)  # once, and before the handlers registered earlier
    atexit.register(_wait_at_exit)


def _wait_at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    last = None if hasattr(sys, "ps1") else getattr(sys, "last_value", None)  # not a prompt's
    interrupted = isinstance(last, KeyboardInterrupt)
    try:
        if not any(it(max(0.0, deadline - time.monotonic())) for it in list(_left_running)):
            return
    except KeyboardInterrupt:  # Ctrl-C again: stop waiting
        interrupted = True
    try:
        sys.stdout.flush()
        logging.shutdown()  # the atexit handlers registered before this one do not run
        print(f"dbo: a ubatch or collective of an aborted run still runs {EXIT_WAIT_S} s into "
              "the exit; the process ends now, without finalization", file=sys.stderr, flush=True)
    finally:
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(130 if interrupted else 1)


def reset_after_fork() -> None:
    """In a forked child: the parent's ubatch threads are not there to wait for."""
    global _left_running_lock
    _left_running_lock = threading.Lock()
    _left_running.clear()
