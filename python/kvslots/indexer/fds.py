"""File descriptors: what ``kvslots indexer`` and ``kvslots proxy`` may use of the process's
limit (``RLIMIT_NOFILE``, ``ulimit -n``).

Both servers hold one descriptor per open HTTP connection; the indexer holds three to six per
worker besides (its ZMQ subscription: the SUB socket, the two sockets of its monitor, their
connections, and a replay socket), the proxy its pool of backend connections. Past the limit
nothing can be opened: new connections failed, and so did subscriptions. So the HTTP
connections are capped (``--max-connections``, :mod:`.httpguard`), by default at what the limit
leaves once the rest is set aside, and an indexer given more workers than the limit can hold is
refused at start-up (:func:`check_workers_fit`). Workers added later (``POST /workers``, or
over another replica's API and learned through Redis) take their descriptors from the
connections' share: :class:`ConnectionCap` lowers the cap as they come, and refuses one that
would leave the connections less than their least.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

# The count and the limit have one home, shared with the event sockets; the servers read them here.
from .. import _args
from .._fds import in_use, limit, out_of_fds_message  # noqa: F401
from ..config.loader import brief
from ..errors import ConfigError, OutOfDescriptorsError

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
    return _connections_of(_room(limit()), reserved)


def default_backend_connections(most: int) -> int:
    """The proxy's backend connections when none are given: ``most``, or half of what the limit
    leaves once those open now and :data:`SPARE` are set aside when that is less (each request
    being answered holds a client connection and a backend one), at least 1."""
    room = _room(limit())
    return most if room is None else max(1, min(most, room // 2))


def check_backend_connections(backend: int, side: int, what: str = "--backend-connections") -> None:
    """A ConfigError when ``backend`` connections, and ``side`` more, leave client connections
    less than :data:`MIN_DEFAULT_CONNECTIONS` under the limit: past it every new connection,
    a client's or a backend's, fails with 'Too many open files'."""
    room = _room(limit())
    if room is not None and room - backend - side < MIN_DEFAULT_CONNECTIONS:
        raise ConfigError(
            f"{what} {backend}: the limit of {limit()} (ulimit -n) leaves {max(room - side, 0)} file descriptors "
            f"for backend and client connections, and {MIN_DEFAULT_CONNECTIONS} are kept for clients: "
            "lower it or raise the limit")


def _room(soft: int | None) -> int | None:
    """Descriptors the limit ``soft`` leaves for connections and what they share with, once
    those open now and :data:`SPARE` are set aside (None: no limit)."""
    return None if soft is None else soft - in_use() - SPARE


def _connections_of(room: int | None, reserved: int) -> int:
    """The default cap: ``room`` less ``reserved``, within its least and most."""
    if room is None:
        return MAX_CONNECTIONS
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_CONNECTIONS, room - reserved))


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


class ConnectionCap:
    """The most HTTP connections the indexer keeps open at once, in step with its workers: what
    :func:`kvslots.indexer.httpguard.protocol_class` takes (it reads :attr:`value` as each
    connection opens). The descriptors the limit leaves once those open when it is made and
    :data:`SPARE` are set aside are shared between connections and workers, at most
    :data:`FDS_PER_WORKER` each: with no ``explicit`` cap, the connections get what the workers
    leave, at least :data:`MIN_DEFAULT_CONNECTIONS`; with one, they get it whatever the workers.

    Computed once at start-up, the cap had counted on the descriptors workers added later took:
    under ``ulimit -n 128`` (a cap of 58), 26 workers added over the API left 3 of 57 connections
    answered, the rest closed unanswered. Now :meth:`reserve` refuses a worker whose descriptors
    would come out of the connections' least (``POST /workers`` answers 503), and lowers the cap
    for one it lets in."""

    def __init__(self, explicit: int | None = None, workers: int = 0):
        if explicit is not None:
            explicit = check_max_connections(explicit, "explicit")
        workers = _args.integer(workers, "workers", 0)
        soft = limit()
        self.explicit = explicit
        self.limit = soft
        #: Descriptors for connections and workers (None: no limit).
        self.room = _room(soft)
        self._lock = threading.Lock()
        self._workers = workers  # subscribed now
        self._reserved = 0  # being added
        #: The cap now.
        self.value = self._cap(workers)

    def _least(self) -> int:
        return self.explicit if self.explicit is not None else MIN_DEFAULT_CONNECTIONS

    def _cap(self, workers: int) -> int:
        if self.explicit is not None:
            return self.explicit
        return _connections_of(self.room, FDS_PER_WORKER * workers)

    def workers_fit(self, workers: int) -> bool:
        """Whether ``workers`` leave the connections their least."""
        return self.room is None or self.room - FDS_PER_WORKER * workers >= self._least()

    def set_workers(self, workers: int) -> None:
        """The workers subscribed now (the cap follows)."""
        workers = _args.integer(workers, "workers", 0)
        with self._lock:
            self._workers = workers
            self.value = self._cap(workers + self._reserved)

    def check(self, workers: int, what: str = "the worker") -> None:
        """An :class:`OutOfDescriptorsError` (EMFILE, ``details["max_connections"]``) saying
        ``what`` does not fit when ``workers``, it included, would leave the connections less
        than their least (:meth:`workers_fit`)."""
        workers = _args.integer(workers, "workers", 0)
        if self.workers_fit(workers):
            return
        least = self._least()
        whose = (f"--max-connections {least}" if self.explicit is not None
                 else f"at least {least}, what --max-connections' default keeps")
        raise OutOfDescriptorsError(
            f"{what} would take {FDS_PER_WORKER} of the file descriptors set aside for HTTP "
            f"connections ({whose}): the limit of {self.limit} (ulimit -n) holds {workers - 1} workers "
            "beside them; remove workers, lower --max-connections or raise the limit",
            details={"errno": errno.EMFILE, "limit": self.limit, "workers": workers - 1, "max_connections": least})

    def reserve(self, what: str = "the worker") -> None:
        """Sets aside a worker's descriptors before it is subscribed, lowering the cap; an
        :class:`OutOfDescriptorsError` (EMFILE) when they would come out of the connections'
        least (:meth:`check`). Give them back with :meth:`release` once it is subscribed
        (:meth:`set_workers` counts it then) or not."""
        with self._lock:
            workers = self._workers + self._reserved + 1
            self.check(workers, what)
            self._reserved += 1
            self.value = self._cap(workers)

    def release(self) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - 1)
            self.value = self._cap(self._workers + self._reserved)
