"""``kvslots indexer --backend redis`` looks its Redis host up with a bound (as the host it listens
on, kvslots._listen.RESOLVE_TIMEOUT_S): redis-py calls getaddrinfo, which has no timeout (its
connect timeout starts after), so a resolver that never answered hung the command at its first
tick, before it served. Now one line, exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

pytest.importorskip("redis")

from kvslots import _listen  # noqa: E402
from kvslots.errors import ConfigError  # noqa: E402
from ports import free_port  # noqa: E402

#: Run first in the child: a resolver that never answers for a name (an address needs none).
HUNG_RESOLVER = """
import socket, threading, kvslots._listen as listen
real = socket.getaddrinfo
def hung(host, *rest):
    numeric = len(rest) > 4 and rest[4] & socket.AI_NUMERICHOST
    if host in (None, "127.0.0.1", "::1") or numeric:
        return real(host, *rest)
    threading.Event().wait()
socket.getaddrinfo = hung
listen.RESOLVE_TIMEOUT_S = 0.5
"""


def test_the_command_says_so_in_one_line_and_exit_2():
    argv = ["indexer", "--backend", "redis", "--redis-url", "redis://slow.example:6379/0",
            "--port", str(free_port())]
    script = HUNG_RESOLVER + ("import sys, uvicorn\n"
                              "uvicorn.run = lambda *a, **k: sys.exit('uvicorn was started')\n"
                              f"from kvslots import cli\nsys.exit(cli.main({argv!r}))\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("kvslots indexer hung on the resolver")  # the old code
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("kvslots indexer: redis URL host 'slow.example': cannot resolve it (the resolver did "
                           "not answer within 0.5 s)\n"), proc.stderr


@pytest.fixture
def resolver(monkeypatch):
    """A resolver that never answers for slow.example and answers EAI_NONAME for nx.example."""
    release = threading.Event()
    real = socket.getaddrinfo

    def fake(host, *rest):
        if len(rest) > 4 and rest[4] & socket.AI_NUMERICHOST:  # answered without a resolver
            return real(host, *rest)
        if host == "slow.example":
            release.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "released by the test")
        if host == "nx.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.setattr(_listen, "RESOLVE_TIMEOUT_S", 0.3)
    yield
    release.set()


def test_check_redis_resolves(resolver):
    from kvslots.indexer.redis_backend import check_redis_resolves

    with pytest.raises(ConfigError, match=r"^redis URL host 'slow.example': cannot resolve it \(the resolver did "
                                          r"not answer within 0.3 s\)$"):
        check_redis_resolves("redis://slow.example:6379/0")
    # controls: an unknown name is left to the backend (Redis unreachable, answered stale), as
    # before; an address and a unix socket need no resolver
    for url in ("redis://nx.example:6379", "redis://127.0.0.1:6379/0", "redis://[::1]:6379", "unix:///tmp/r.sock"):
        check_redis_resolves(url)
