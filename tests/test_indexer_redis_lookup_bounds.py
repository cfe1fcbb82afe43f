"""The Redis connections' host lookups (kvslots._listen.resolve, the one home of the bounded
lookup): a connect waits at most its socket_connect_timeout for the resolver, not the whole
RESOLVE_TIMEOUT_S (every /score in the first 30 s hung to the 30 s mark); an answer that comes
after the callers stopped waiting serves the next connect (a resolver always slower than the
bound never let the backend reconnect); a lookup thread that cannot start leaves nothing behind.
No redis-server: a plain listening socket stands for it (_connect only connects)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

pytest.importorskip("redis")

from kvslots import _listen  # noqa: E402
from kvslots.indexer import redis_backend as rb  # noqa: E402

NAME = "lookup.kvslots.test"


@pytest.fixture(autouse=True)
def fresh_lookups(monkeypatch):
    """No answer kept from another test (a port can come again)."""
    monkeypatch.setattr(_listen, "_answered", {}, raising=False)
    monkeypatch.setattr(_listen, "_lookups", {}, raising=False)
    monkeypatch.setattr(_listen, "_running", {}, raising=False)


@pytest.fixture
def server():
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv.getsockname()[1]
    srv.close()


@pytest.fixture
def resolver(monkeypatch):
    """NAME resolves to 127.0.0.1 after ``delay`` seconds (None: only when released)."""
    real = socket.getaddrinfo
    state = type("State", (), {})()
    state.delay = None
    state.release = threading.Event()
    state.calls = 0

    def fake(host, port, *rest):
        if host == NAME:
            if len(rest) > 3 and rest[3] & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "not an address")
            state.calls += 1
            state.release.wait(state.delay)
            return real("127.0.0.1", port, *rest)
        return real(host, port, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    yield state
    state.release.set()


def _timed(fn):
    t0 = time.monotonic()
    try:
        out = fn()
    except BaseException as e:
        out = e
    return out, time.monotonic() - t0


def _within(fn, seconds):
    out: list = []
    t = threading.Thread(target=lambda: out.append(_timed(fn)), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting on the resolver after {seconds} s")
    return out[0]


def test_a_connect_waits_for_the_lookup_at_most_its_connect_timeout(server, resolver):
    # the default bound (30 s): the old code held this connect (and each /score) that long
    conn = rb.redis_client(f"redis://{NAME}:{server}/0", socket_connect_timeout=0.5).connection_pool.make_connection()
    err, took = _within(conn._connect, 5)
    assert isinstance(err, socket.gaierror) and "did not answer" in str(err), err
    assert took < 2, took
    # the lookup ran on; once it answers, the next connect is served
    resolver.release.set()
    sock, _ = _within(conn._connect, 5)
    assert isinstance(sock, socket.socket), sock
    sock.close()


def test_a_late_answer_serves_the_next_connect(server, resolver, monkeypatch):
    # a resolver always slower than the bound: each lookup answers after its callers gave up
    monkeypatch.setattr(_listen, "RESOLVE_TIMEOUT_S", 0.3)
    resolver.delay = 0.8
    conn = rb.redis_client(f"redis://{NAME}:{server}/0", socket_connect_timeout=2).connection_pool.make_connection()
    err, took = _within(conn._connect, 5)
    assert isinstance(err, socket.gaierror) and took < 1.5, (err, took)
    time.sleep(1.0)  # the late answer comes in
    sock, took = _within(conn._connect, 5)
    assert isinstance(sock, socket.socket) and took < 1.5, (sock, took)
    sock.close()


def test_a_lookup_thread_that_cannot_start_poisons_nothing(server, resolver, monkeypatch):
    resolver.delay = 0
    real_start = threading.Thread.start
    fail = [True]

    def start(self):
        if fail[0] and self.name.startswith("kvslots-"):
            fail[0] = False
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    conn = rb.redis_client(f"redis://{NAME}:{server}/0", socket_connect_timeout=1).connection_pool.make_connection()
    err, _ = _within(conn._connect, 5)
    assert isinstance(err, socket.gaierror), err  # what redis-py reports as ConnectionError
    sock, took = _within(conn._connect, 5)  # the next connect looks the name up afresh
    assert isinstance(sock, socket.socket) and took < 0.5, (sock, took)
    sock.close()


def test_redis_py_5_0_is_not_accepted():
    # _BoundedSSLConnection wraps with SSLConnection._wrap_socket_with_ssl, which redis-py has
    # from 5.1.0 on: rediss:// failed on 5.0.x, which pyproject's "redis>=5" let in
    from packaging.requirements import Requirement

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    from pathlib import Path

    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    reqs = [Requirement(r) for deps in extras.values() for r in deps if Requirement(r).name == "redis"]
    assert reqs and all(not r.specifier.contains("5.0.8") and r.specifier.contains("5.1.0") for r in reqs), reqs
    import redis

    assert hasattr(redis.SSLConnection, "_wrap_socket_with_ssl")
