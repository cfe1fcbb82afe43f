"""File descriptors: what ``kvslots indexer`` may use of the process's limit
(``RLIMIT_NOFILE``, ``ulimit -n``).

The indexer holds three to six descriptors per worker (its ZMQ subscription: the SUB socket,
the two sockets of its monitor, their connections, and a replay socket). Past the limit nothing
can be opened, so an indexer given more workers than the limit can hold is refused at start-up
(:func:`check_workers_fit`).
"""

from __future__ import annotations

import os
from typing import Any

from ..config.loader import brief
from ..errors import ConfigError

try:
    import resource
except ImportError:  # not on Windows: no limit to derive anything from
    resource = None  # type: ignore[assignment]

#: Descriptors left for HTTP connections, however many workers there are.
MIN_DEFAULT_CONNECTIONS = 16
#: Descriptors a worker's subscription takes at the fewest (the SUB socket and its monitor's
#: two; one more with a replay socket).
MIN_FDS_PER_WORKER = 3


def limit() -> int | None:
    """The soft limit on open descriptors; None when there is none (or it cannot be read)."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def in_use() -> int:
    """Descriptors open now (0 where they cannot be counted)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(d)) - 1)  # less the one listdir opened
        except OSError:
            continue
    return 0


def check_workers_fit(workers: int, replays: int = 0) -> None:
    """A ConfigError when ``workers`` subscriptions (``replays`` of them with a replay socket)
    cannot all be opened under the limit, even at the fewest descriptors each takes, with
    :data:`MIN_DEFAULT_CONNECTIONS` left for HTTP: the first one past it failed with 'Too many
    open files', after as many as fitted were opened."""
    soft = limit()
    if soft is None or workers <= 0:
        return
    need = MIN_FDS_PER_WORKER * workers + replays
    left = soft - in_use() - MIN_DEFAULT_CONNECTIONS
    if need > left:
        raise ConfigError(
            f"{workers} workers need at least {need} file descriptors, and the limit of {soft} (ulimit -n) "
            f"leaves {max(left, 0)}: raise the limit, or split the workers between indexers")


def out_of_fds_message() -> str:
    """Why a descriptor could not be opened, with the limit."""
    soft = limit()
    return "out of file descriptors" + ("" if soft is None else f" (the limit, ulimit -n, is {soft})")
