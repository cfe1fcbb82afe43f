"""Whether a server can listen on ``host:port``: checked before a command starts one (the
indexer, the proxy, ``kvslots serve``), so that a port in use or a host that does not resolve is
one line and exit status 2 rather than the server's own log and exit status."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, cast

from .errors import ConfigError

__all__ = ["check_listen"]


def check_listen(host: str, port: int) -> None:
    """A ConfigError unless ``host:port`` can be listened on, checked the way asyncio's server
    will bind it (every address the host resolves to), so that a port in use or a host that
    does not resolve is one line, not uvicorn's log and exit status 3."""
    # getaddrinfo wraps a port past 65535 (99999 passed, to fail in the server's bind) and
    # raises OverflowError past a C long: the range is checked first.
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port {port!r} is not a port number in 0..65535")
    try:
        infos = _resolve(host or None, port)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        raise ConfigError(f"host {host!r}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


#: Longest wait, in seconds, for the resolver to answer for a host name: getaddrinfo has no
#: timeout of its own, and a hung NSS module (LDAP, sssd) or a resolv.conf with very long
#: timeouts made the command hang before it started. A dead DNS server under glibc's defaults
#: gives up by itself (5 s per try, 2 tries, per server: at most 30 s for three), so 30 s
#: refuses no lookup the resolver would have answered.
RESOLVE_TIMEOUT_S = 30.0


#: Last answers kept (one per host, port and kind asked), for the next lookup of a name that a
#: slow resolver answered too late.
_MAX_KEPT = 64
#: A kept answer older than this, in seconds, is not used: a name that moved, looked up while a
#: lookup hangs, must not keep its old address for good.
KEPT_MAX_AGE_S = 300.0
#: Lookups of one name running at once, at most: a lookup past RESOLVE_TIMEOUT_S lets the next
#: caller start a new one (it stayed the name's only one for good, its kept answer used forever),
#: and this caps the threads a resolver that hangs for good holds per name.
MAX_LOOKUPS_PER_NAME = 2


class _Lookup:
    """One getaddrinfo under way in a daemon thread, shared by every caller that needs it."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.answer: Any = None


_lookups: dict[tuple, _Lookup] = {}  # under way: the latest of each name
_running: dict[tuple, int] = {}  # lookup threads running per name (stuck ones included)
#: the last answer of each name (a late one included): (its lookup's start, when it came, answer)
_answered: dict[tuple, tuple[float, float, list[Any]]] = {}
_lock = threading.Lock()


def resolve(host: str | None, port: int, family: int = socket.AF_UNSPEC, kind: int = socket.SOCK_STREAM,
            flags: int = 0, *, wait: float | None = None) -> list[Any]:
    """socket.getaddrinfo, bounded: the one rule for every lookup kvslots makes on its own.

    An address (or no host) needs no resolver and is answered at once. A name is looked up in one
    daemon thread per (host, port, family, kind, flags), shared by the callers that want it
    meanwhile, so a resolver that never answers leaves one thread behind, not one per call. A
    caller waits at most ``wait`` seconds (:data:`RESOLVE_TIMEOUT_S` when None; no longer than
    that bound from the lookup's start either) and the lookup runs on: when it is not done, the
    name's last answer is used (one a lookup gave after its callers stopped waiting included, so a
    resolver always slower than a caller's wait still serves the next one) if it is at most
    :data:`KEPT_MAX_AGE_S` old, else a gaierror EAI_AGAIN "did not answer". A lookup past its
    bound lets the next caller start a new one (at most :data:`MAX_LOOKUPS_PER_NAME` of a name
    run at once). A resolver's own error is raised as it is."""
    args = (host, port, family, kind, 0, flags)
    try:
        return socket.getaddrinfo(*args[:5], flags | socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name, not an address
    bound = RESOLVE_TIMEOUT_S
    key = args
    with _lock:
        look = _lookups.get(key)
        now = time.monotonic()
        if look is None or (now - look.started >= bound and _running.get(key, 0) < MAX_LOOKUPS_PER_NAME):
            look = _Lookup()
            thread = threading.Thread(target=_lookup, args=(key, look), name="kvslots-resolve", daemon=True)
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had: this call fails, the next one tries again
                raise socket.gaierror(socket.EAI_AGAIN, f"cannot look {host!r} up: {e}") from None
            _lookups[key] = look  # after the start: a failed one leaves nothing behind
            _running[key] = _running.get(key, 0) + 1
    left = look.started + bound - now
    asked = bound if wait is None else min(bound, wait)
    # a Ctrl-C still ends the wait (the caller's to report)
    if not look.done.wait(max(0.0, min(left, asked))):
        with _lock:
            kept = _answered.get(key)
        if kept is not None and time.monotonic() - kept[1] <= KEPT_MAX_AGE_S:
            return kept[2]
        if left < asked:  # joined a lookup already under way that long: say so, not our wait
            raise socket.gaierror(socket.EAI_AGAIN, (
                f"the resolver did not answer within {bound:g} s ({_running.get(key, 0)} lookup(s) of "
                f"{host!r} under way, the latest for {time.monotonic() - look.started:.3g} s)"))
        raise socket.gaierror(socket.EAI_AGAIN, f"the resolver did not answer within {asked:g} s")
    if isinstance(look.answer, BaseException):
        raise look.answer
    return cast(list, look.answer)


def _lookup(key: tuple, look: _Lookup) -> None:
    try:
        look.answer = socket.getaddrinfo(*key)
    except BaseException as e:  # handed to the callers
        look.answer = e
    finally:
        with _lock:
            if _lookups.get(key) is look:  # the next call looks the name up again (a changed address)
                del _lookups[key]
            n = _running.pop(key, 1) - 1
            if n > 0:
                _running[key] = n
            kept = _answered.get(key)
            # a stuck lookup's late answer does not replace a later lookup's
            if not isinstance(look.answer, BaseException) and (kept is None or kept[0] <= look.started):
                _answered.pop(key, None)
                if len(_answered) >= _MAX_KEPT:
                    del _answered[next(iter(_answered))]
                _answered[key] = (look.started, time.monotonic(), look.answer)
        look.done.set()


def _resolve(host: str | None, port: int) -> list[Any]:
    """getaddrinfo for a passive TCP socket, bounded by :data:`RESOLVE_TIMEOUT_S` (:func:`resolve`)."""
    return resolve(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, socket.AI_PASSIVE)
