"""Who a process is: its pid and its start time. A pid alone is reused by the kernel; a lock file or a
claim that records both names one process for good (the Train tab's run locks, the curation
server's owner record)."""

from __future__ import annotations


def process_start_time(pid: int) -> float | None:
    """The start time of process ``pid`` (seconds since the epoch, as psutil reports it), or None
    when there is no such process (or it cannot be read)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
