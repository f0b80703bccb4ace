"""Processes the proving ground starts end with the process that started them.

Stopping a run by killing its main process (``kill PID``, a job scheduler's timeout) must not leave
its pool workers (:mod:`proving.parallel`) or their ``krea2`` commands running: they would go on
spending the CPU and, once the run is resumed with ``--resume``, write into the same folders as the
resumed run. Ctrl-C already reaches the whole process group; a kill of the main process alone does
not, so each child asks Linux to send it SIGTERM when its parent ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """In a child process: SIGTERM when the parent ends (Linux; elsewhere nothing). A parent that
    ended before the request (the child now belongs to another process) ends the child at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
