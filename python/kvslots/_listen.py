"""Whether a server can listen on ``host:port``: checked before a command starts one (the
indexer, the proxy, ``kvslots serve``), so that a port in use or a host that does not resolve is
one line and exit status 2 rather than the server's own log and exit status."""

from __future__ import annotations

import socket

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
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
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
