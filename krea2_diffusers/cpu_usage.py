"""Where a stretch of time went in this process: wall seconds, CPU seconds in user and in system
mode (all threads together) and minor page faults, from ``getrusage``.

On a shared machine wall time depends on the neighbours; CPU time much less: user CPU over wall
near the thread count means every thread computed, well below it that they waited (descheduled, or
idle between parallel regions). System time and minor faults are the kernel handing out fresh
pages: a layer that allocates its dequantized weight anew at every call spends as much there as on
the arithmetic (bench/bench_dequant.py's user and system seconds per call). One :class:`Usage` is
a snapshot; subtracting two gives the interval's.

:class:`SplitTimer` adds intervals up under names (a training step's data / forward / backward /
optimizer); ``finetune``'s trainer and ``bench/full_size.py`` use it.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Usage:
    """Seconds of wall clock, user CPU and system CPU, and minor page faults (cumulative, or an interval's)."""

    wall: float = 0.0
    user: float = 0.0
    system: float = 0.0
    minor_faults: int = 0

    @classmethod
    def now(cls) -> "Usage":
        r = resource.getrusage(resource.RUSAGE_SELF)
        return cls(time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt)

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __truediv__(self, n: float) -> "Usage":
        """The mean of ``n`` intervals that add up to this one."""
        return Usage(*(getattr(self, f.name) / n for f in fields(self)))

    @property
    def cpu(self) -> float:
        return self.user + self.system

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """``{prefix + "wall": ..., "user", "system", "minor_faults"}`` (seconds rounded to 0.1 ms)."""
        return {prefix + f.name: round(getattr(self, f.name), 4 if f.name != "minor_faults" else 1) for f in fields(self)}


class SplitTimer:
    """Adds each interval between :meth:`mark` calls to the named part.

        split = SplitTimer()          # starts the clock
        ...; split.mark("data")       # the time since the start (or the last mark) is data's
        ...; split.mark("forward")
        split.parts                   # {"data": Usage, "forward": Usage}; a name marked twice adds up
    """

    def __init__(self):
        self.parts: dict[str, Usage] = {}
        self.last = Usage.now()

    def mark(self, name: str) -> None:
        now = Usage.now()
        self.parts[name] = self.parts.get(name, Usage()) + (now - self.last)
        self.last = now

    def total(self) -> Usage:
        return sum(self.parts.values(), Usage())
