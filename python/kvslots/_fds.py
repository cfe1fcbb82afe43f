"""File descriptors: how many the process may still open under its limit (``RLIMIT_NOFILE``,
``ulimit -n``), and a check made before opening ZMQ sockets.

libzmq does not return every failure to open a descriptor as an error: a context's first
socket starts its I/O and reaper threads, and when their ``epoll`` or ``eventfd`` cannot be
made it fails an assertion and aborts the whole process ('Too many open files
(src/epoll.cpp:38)'). So whatever makes a context or sockets checks here first and raises
:class:`~kvslots.errors.OutOfDescriptorsError` with nothing opened. The count races with other
threads opening files; it turns the common case (objects created in a loop until the limit)
into an error, it cannot reserve descriptors.
"""

from __future__ import annotations

import errno
import os

from .errors import OutOfDescriptorsError

try:
    import resource
except ImportError:  # not on Windows: no limit to derive anything from
    resource = None  # type: ignore[assignment]

#: Left free after a check passes, for what the sockets open later (accepted and outgoing TCP
#: connections, which libzmq retries or drops when refused) and for the rest of the process.
HEADROOM = 8
#: What a ZMQ context opens with its first socket: the context's mailbox, its reaper's and
#: one I/O thread's mailbox and epoll (measured: pyzmq 26, libzmq 4.3).
ZMQ_CONTEXT = 5


def limit() -> int | None:
    """The soft limit on open descriptors; None when there is none (or it cannot be read)."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


#: The soft limit a server raises its own to (never past the hard limit), as vLLM's API server does.
SERVER_LIMIT = 65536


def raise_limit(target: int = SERVER_LIMIT) -> int | None:
    """Raises the soft limit on open descriptors toward ``target``, at most to the hard limit,
    and returns the soft limit then (None: no limit). For the servers: their connection caps are
    derived from it, and a distribution's default soft limit (1024) would have refused clients
    past a few hundred at once while the hard limit allowed far more. Never lowers it; a limit
    that cannot be raised (a container's policy) is left as it is."""
    if resource is None:
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = target if hard == resource.RLIM_INFINITY or hard < 0 else min(target, hard)
        if soft != resource.RLIM_INFINITY and 0 <= soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        pass
    return limit()


def in_use() -> int:
    """Descriptors open now (0 where they cannot be counted)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(d)) - 1)  # less the one listdir opened
        except OSError:
            continue
    return 0


def out_of_fds_message() -> str:
    """Why a descriptor could not be opened, with the limit."""
    soft = limit()
    return "out of file descriptors" + ("" if soft is None else f" (the limit, ulimit -n, is {soft})")


def require(needed: int, what: str) -> None:
    """Raises :class:`OutOfDescriptorsError` naming ``what`` unless ``needed`` descriptors and
    :data:`HEADROOM` more can still be opened."""
    soft = limit()
    if soft is None:
        return
    available = max(0, soft - in_use())
    if available < needed + HEADROOM:
        raise OutOfDescriptorsError(
            f"{what} needs {needed} file descriptors and {available} are left under the limit "
            f"of {soft} (ulimit -n): raise the limit, or close what holds them",
            details={"errno": errno.EMFILE, "needed": needed, "available": available, "limit": soft},
        )
