"""File descriptors: what ``kvslots indexer`` and ``kvslots proxy`` may use of the process's
limit (``RLIMIT_NOFILE``, ``ulimit -n``).

Both servers hold one descriptor per open HTTP connection; the indexer holds three to six per
worker besides (its ZMQ subscription: the SUB socket, the two sockets of its monitor, their
connections, and a replay socket), the proxy its pool of backend connections. Past the limit
nothing can be opened: new connections failed, and so did subscriptions. So the HTTP
connections are capped (``--max-connections``, :mod:`.httpguard`), by default at what the limit
leaves once the rest is set aside, and an indexer given more workers than the limit can hold is
refused at start-up (:func:`check_workers_fit`).
"""

from __future__ import annotations

from typing import Any

# The count and the limit have one home, shared with the event sockets; the servers read them here.
from .._fds import in_use, limit, out_of_fds_message  # noqa: F401
from ..config.loader import brief
from ..errors import ConfigError

#: Largest ``--max-connections``: Linux's default cap on any process's descriptors (fs.nr_open).
MAX_CONNECTIONS = 1 << 20
#: Fewest connections a default cap allows, however little the limit leaves.
MIN_DEFAULT_CONNECTIONS = 16
#: Descriptors set aside for everything but connections and subscriptions (the listening socket,
#: logs, the Python runtime, Redis, a ZMQ context's own), beyond those open at start-up.
SPARE = 64
#: Descriptors a worker's subscription may take (SUB socket, its monitor's two, a replay
#: DEALER, and their TCP connections), and the fewest it takes (the three sockets; one more
#: with a replay socket).
FDS_PER_WORKER = 6
MIN_FDS_PER_WORKER = 3


def default_max_connections(reserved: int) -> int:
    """The cap on HTTP connections when none is given: what the limit leaves once those open
    now, :data:`SPARE` and ``reserved`` (subscriptions, backend connections) are set aside, at
    least :data:`MIN_DEFAULT_CONNECTIONS`, at most :data:`MAX_CONNECTIONS`."""
    soft = limit()
    if soft is None:
        return MAX_CONNECTIONS
    left = soft - in_use() - SPARE - reserved
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_CONNECTIONS, left))


def check_max_connections(value: Any, what: str = "max_connections") -> int:
    """``value`` when it is an integer in 1..:data:`MAX_CONNECTIONS`; a ConfigError naming
    ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONNECTIONS:
        raise ConfigError(f"{what} {brief(value)}: must be an integer in [1, {MAX_CONNECTIONS}]")
    return value


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
