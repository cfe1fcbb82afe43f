"""Log lines a remote peer can trigger at will (a malformed batch, a stream that starts over, a
backend that fails every request), bounded per peer and kind: a publisher sending a flood of
bad frames wrote a warning per frame (137,000 lines in 3 s), enough to fill a disk. Shared by
the events subscriber, the indexer and the proxy; :func:`quiet_logs` bounds what uvicorn logs
for ``kvslots indexer`` and ``kvslots proxy``."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable
from typing import Any

#: Messages logged per key in each period; the rest are counted and reported with the next one.
BURST = 10
PERIOD_S = 60.0
_MAX_KEYS = 4096  # keys are (peer, kind): bounded, but workers come and go by name


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = BURST, period_s: float = PERIOD_S) -> None:
        self._log = logger
        self._burst = burst
        self._period = period_s
        self._lock = threading.Lock()
        self._state: dict[Hashable, list] = {}  # key -> [window start, logged, left out]

    def log(self, level: int, key: Hashable, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Logs ``msg % args`` unless ``key`` has used its burst in this period (then counts it);
        the first message of a new period says how many were left out. True if logged."""
        if not self._log.isEnabledFor(level):
            return False
        now = time.monotonic()
        with self._lock:
            st = self._state.get(key)
            left_out = 0
            if st is None or now - st[0] >= self._period:
                if st is None and len(self._state) >= _MAX_KEYS:
                    self._state.clear()
                left_out = st[2] if st is not None else 0
                st = self._state[key] = [now, 0, 0]
            if st[1] >= self._burst:
                st[2] += 1
                return False
            st[1] += 1
            if st[1] == self._burst:
                msg += " (further such messages for it are left out for up to %g s)"
                args = (*args, self._period)
        if left_out:
            msg += " (%d such messages were left out before this one)"
            args = (*args, left_out)
        self._log.log(level, msg, *args, exc_info=exc_info)
        return True


class RateLimitedRecords(logging.Filter):
    """A logger's records through a :class:`RateLimitedLog` keyed on their level and message
    template: uvicorn's lines a peer triggers at will ("ASGI callable returned without completing
    response." for each stream a worker broke off, "Invalid HTTP request received." for each
    malformed request) were one line each, not limited. A record with a traceback is keyed on its
    exception's type and innermost frame too: every one is "Exception in ASGI application", and
    ten of one bug a minute hid any other."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logs = RateLimitedLog(logger)
        self.inside = threading.local()  # the line RateLimitedLog writes comes back through here

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.inside, "on", False):
            return True
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        key: tuple = ("uvicorn", record.levelno, template)
        if record.exc_info and record.exc_info[0] is not None:
            key += _where(record.exc_info)
        self.inside.on = True
        try:
            self.logs.log(record.levelno, key, "%s", record.getMessage(),
                          exc_info=record.exc_info)  # type: ignore[arg-type]
        finally:
            self.inside.on = False
        return False


def _where(exc_info: Any) -> tuple[str, str]:
    """An exception's type and its innermost frame's file:line (where it was raised)."""
    kind, _, tb = exc_info
    last = None
    for _ in range(10_000):  # a traceback is finite; bounded all the same
        if tb is None:
            break
        last, tb = tb, tb.tb_next
    where = f"{os.path.basename(last.tb_frame.f_code.co_filename)}:{last.tb_lineno}" if last is not None else ""
    return f"{kind.__module__}.{kind.__qualname__}", where


def quiet_logs() -> None:
    """What ``kvslots indexer`` and ``kvslots proxy`` log, bounded: httpx's line for each request
    answered (INFO) off, and uvicorn's lines a peer can trigger rate-limited
    (:class:`RateLimitedRecords`). Once per logger, however often it is called."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RateLimitedRecords) for f in error.filters):
        error.addFilter(RateLimitedRecords(error))
