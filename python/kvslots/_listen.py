"""Whether a server can listen on ``host:port``: checked before a command starts one (the
indexer, the proxy, ``kvslots serve``), so that a port in use or a host that does not resolve is
one line and exit status 2 rather than the server's own log and exit status."""

from __future__ import annotations

import socket
import threading
from typing import Any

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


def _resolve(host: str | None, port: int) -> list[Any]:
    """getaddrinfo for a passive TCP socket, bounded by :data:`RESOLVE_TIMEOUT_S` (a
    gaierror EAI_AGAIN past it). An address (or no host) needs no resolver and is answered at once;
    a name is looked up in a daemon thread, which a resolver that never answers leaves behind
    (the command then ends with the error, the thread with it)."""
    args = (host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    try:
        return socket.getaddrinfo(*args[:5], socket.AI_PASSIVE | socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name, not an address
    answer: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(*args))
        except BaseException as e:  # handed to the caller
            answer.append(e)
        finally:
            done.set()

    threading.Thread(target=lookup, name="kvslots-resolve", daemon=True).start()
    if not done.wait(RESOLVE_TIMEOUT_S):  # a Ctrl-C still ends the wait (the caller's to report)
        raise socket.gaierror(socket.EAI_AGAIN, f"the resolver did not answer within {RESOLVE_TIMEOUT_S:g} s")
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return answer[0]
