"""Stopping a run by a signal: SIGTERM / SIGINT ask for a clean stop, in every phase of a run.

One mechanism for ``krea2 train``, ``posttrain`` and ``pretrain``: the command's entry point enters
a :class:`StopRequest` first thing (before the heavy imports) and the trainer's own ``with
StopRequest()`` shares it, so a stop that arrives while the run imports, caches or loads is seen by
the loop instead of killing the process. What a stop does depends on when it arrives:

- before the first step: the run ends without training (nothing new to save);
- during or between steps: the run checkpoints after the current step and ends ``interrupted``
  (exit code 130, :data:`STOPPED_CODE`);
- after the last step (final checkpoint, validation, export): it is noted and ignored, the exports
  get written and the run ends as done (exit code 0).

Entering also unblocks SIGTERM / SIGINT in this thread: the Train tab starts ``krea2 train`` with
SIGTERM blocked, so a stop sent before anyone listens (the interpreter starting) is held by the
kernel and delivered here, to the handler, instead of ending the process by the default action.
This module imports nothing heavy, for that reason.
"""

from __future__ import annotations

import logging
import signal

__all__ = ["STOPPED_CODE", "StopRequest"]

logger = logging.getLogger("finetune")

STOPPED_CODE = 130  # the commands' exit code after a stop: a checkpoint (if any step ran) was written
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """``with StopRequest() as stop:`` ... ``stop.requested``. The outermost one in the process
    installs the handlers (restored on leaving it); nested ones return that one, so the flag is
    shared. A second SIGINT aborts at once (KeyboardInterrupt). Outside the main thread (no
    signals there) it only holds its flag."""

    _active: StopRequest | None = None  # the one whose handlers are installed

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}
        self._outer: StopRequest | None = None

    def __enter__(self) -> StopRequest:
        if StopRequest._active is not None:
            self._outer = StopRequest._active
            return self._outer
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                return self
        StopRequest._active = self
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # a stop held until now is handled here
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("signal %s: stopping (a checkpoint after the current step; after the last step "
                       "the run finishes its export)", signum)

    def __exit__(self, *exc) -> None:
        if self._outer is not None:
            self._outer = None
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if StopRequest._active is self:
            StopRequest._active = None
