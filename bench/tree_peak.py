"""The peak memory of a process tree, for ``bench/full_size.py``: the anonymous RSS of this process
and its descendants sampled every 0.2 s, and the kernel's per-process high-water marks (see
:class:`TreePeak`). ``peak_at`` and the timeline are seconds since ``clock_start`` (the bench's clock)."""

from __future__ import annotations

import threading
import time


def _memory_field(path: str, field: str) -> int:
    """``field`` (kB) of /proc/PID/status or smaps_rollup, in bytes; 0 once the process has ended."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # the process ended between listing and reading
    return 0


class TreePeak:
    """Samples the anonymous memory of this process and all its descendants (every 0.2 s), and
    reads the kernel's per-process high-water marks, which no sampling interval can miss.

    ``peak`` (sampled): one process: its anonymous RSS. Several (the trainer's data-loader workers
    are forked after the model is loaded and share its pages copy-on-write, so their RSS repeats
    the parent's): the sum of each one's proportional share (``Pss_Anon``, shared pages divided
    among the sharers), which counts every page once; reading it walks the page tables, so only
    then. A spike shorter than the interval (a dequantized matrix) can fall between two samples.

    ``max_hwm`` (exact per process, not a sum): the largest ``VmHWM`` of any process of the tree
    during the run, i.e. its peak RSS (anonymous and file-backed pages: mapped checkpoint pages
    count). This process's own at the end; the children's polled each interval (the mark only
    grows, so a poll misses only a child's last interval) and, for those that ended and were waited
    for, the kernel's ``ru_maxrss`` of ``RUSAGE_CHILDREN`` (the largest waited-for descendant's peak
    RSS; it includes children that ended before the run, so it counts only when it grew during it)."""

    def __init__(self, interval: float = 0.2, every: float = 5.0, clock_start: float | None = None):
        self.clock_start = time.monotonic() if clock_start is None else clock_start
        self.interval, self.peak, self.max_hwm = interval, 0, 0
        self.peak_at = 0.0  # seconds on clock_start (the child's log lines carry the same clock)
        self.timeline: list[tuple[float, int]] = []  # (seconds, bytes) every ``every`` s: where the peak sits
        self._every = every
        self._done = threading.Event()
        self._waited_before = 0

    def _tree(self) -> list[int]:
        import psutil

        me = psutil.Process()
        return [me.pid] + [c.pid for c in me.children(recursive=True)]

    def _sample(self) -> None:
        while not self._done.is_set():
            pids = self._tree()
            rss = {pid: _memory_field(f"/proc/{pid}/status", "RssAnon:") for pid in pids}
            self.max_hwm = max([self.max_hwm] + [_memory_field(f"/proc/{pid}/status", "VmHWM:") for pid in pids])
            if sum(1 for size in rss.values() if size > 64 * 2**20) > 1:
                total = sum(_memory_field(f"/proc/{pid}/smaps_rollup", "Pss_Anon:") for pid in pids)
            else:
                total = sum(rss.values())
            now = time.monotonic() - self.clock_start
            if total > self.peak:
                self.peak, self.peak_at = total, now
            if not self.timeline or now - self.timeline[-1][0] >= self._every:
                self.timeline.append((round(now, 1), total))
            self._done.wait(self.interval)

    def __enter__(self):
        self._waited_before = _waited_children_peak()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        waited = _waited_children_peak()
        own = _memory_field("/proc/self/status", "VmHWM:")
        self.max_hwm = max(self.max_hwm, own, waited if waited > self._waited_before else 0)


def _waited_children_peak() -> int:
    """Peak RSS (bytes) of the largest descendant that ended and was waited for (Linux: kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
