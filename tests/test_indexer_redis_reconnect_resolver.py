"""The Redis backend's reconnects look the host up with a bound: redis-py resolves the name again
at each reconnect with getaddrinfo, which has no timeout (socket_connect_timeout starts after it),
so a resolver that hung while Redis was away hung the upkeep thread and every /score with it
(the start-up lookup was bounded already: test_indexer_redis_resolver.py). A real redis-server on
loopback, reached through a name the test's resolver answers, then stops answering."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

pytest.importorskip("redis")

import redis  # noqa: E402
from indexer_support import RedisServer, have_redis  # noqa: E402

from kvslots import _listen  # noqa: E402
from kvslots.indexer import IndexerConfig  # noqa: E402
from kvslots.indexer.redis_backend import RedisBackend  # noqa: E402

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server not installed (scripts/system-deps.txt)")

NAME = "redis.kvslots.test"


@pytest.fixture(scope="module")
def redis_server():
    srv = RedisServer()
    yield srv
    srv.close()


@pytest.fixture
def resolver(monkeypatch):
    """NAME resolves to 127.0.0.1 until ``hang`` is set; then the lookup never answers (until the
    test ends). ``calls`` counts the lookups of NAME."""
    real = socket.getaddrinfo
    state = type("State", (), {})()
    state.hang = threading.Event()
    state.release = threading.Event()
    state.calls = 0

    def fake(host, port, *rest):
        if host == NAME:
            if len(rest) > 3 and rest[3] & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "not an address")
            state.calls += 1
            if state.hang.is_set():
                state.release.wait()
                raise socket.gaierror(socket.EAI_AGAIN, "released by the test")
            return real("127.0.0.1", port, *rest)
        return real(host, port, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.setattr(_listen, "RESOLVE_TIMEOUT_S", 0.5)
    yield state
    state.release.set()


def _within(fn, seconds: float):
    """fn()'s result or exception, or a test failure when it has not returned within seconds."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting on the resolver after {seconds} s")
    return out[0]


def test_a_reconnect_whose_lookup_hangs_is_bounded(redis_server, resolver):
    cfg = IndexerConfig(workers=[], backend="redis", redis_url=f"redis://{NAME}:{redis_server.port}/0",
                        redis_namespace=f"kvslots:test:{uuid.uuid4().hex[:8]}", block_size=4)
    backend = RedisBackend(cfg)
    try:
        assert backend.r.ping() is True  # resolved and connected
        resolver.hang.set()
        backend.r.connection_pool.disconnect()  # Redis went away: the next command reconnects
        t0 = time.monotonic()
        # the reconnect waits for the lookup at most its connect timeout (1 s), then connects by
        # the name's last answer (the lookup runs on)
        assert _within(backend.r.ping, 10) is True
        assert time.monotonic() - t0 < 4
        # further connects do not start a lookup each: past its bound a hung lookup lets one
        # more start (MAX_LOOKUPS_PER_NAME run at once), then they use the one under way
        calls = resolver.calls
        assert calls == 2, calls  # the first connect's and the hung one
        for _ in range(3):
            time.sleep(0.6)  # past RESOLVE_TIMEOUT_S (0.5 s here) of the latest lookup
            backend.r.connection_pool.disconnect()
            assert _within(backend.r.ping, 5) is True
        assert resolver.calls == 1 + _listen.MAX_LOOKUPS_PER_NAME, resolver.calls
        # a /score while the resolver hangs is answered, not hung
        _within(lambda: backend.score(list(range(16)), 4, None, None), 5)
        # a name without an answer yet fails within the bound
        _listen._answered.clear()
        backend.r.connection_pool.disconnect()
        err = _within(backend.r.ping, 10)
        assert isinstance(err, redis.ConnectionError) and "did not answer" in str(err), err
        # the resolver answers again: the hung lookup ends, the next connect looks up afresh
        resolver.hang.clear()
        resolver.release.set()
        deadline = time.monotonic() + 5
        while True:
            try:
                assert backend.r.ping() is True
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "never reconnected once the resolver answered"
                time.sleep(0.05)
    finally:
        backend.r.close()


def test_tls_keeps_the_host_name_for_verification_and_unix_sockets_need_no_lookup(resolver, monkeypatch):
    from kvslots.indexer import redis_backend as rb

    # rediss://: connected by the looked-up address, TLS wrapped with the URL's host name (what
    # check_hostname verifies and SNI sends), as redis-py does
    wrapped = []
    monkeypatch.setattr(redis.SSLConnection, "_wrap_socket_with_ssl",
                        lambda self, sock: wrapped.append((self.host, sock.getpeername()[0])) or sock)
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        r = rb.redis_client(f"rediss://{NAME}:{srv.getsockname()[1]}/0", socket_connect_timeout=2)
        conn = r.connection_pool.make_connection()
        assert isinstance(conn, redis.SSLConnection) and conn.check_hostname is True
        sock = conn._connect()
        sock.close()
        assert wrapped == [(NAME, "127.0.0.1")]
        # ... and bounded as a plain connection (no answer kept)
        resolver.hang.set()
        monkeypatch.setattr(_listen, "_answered", {})
        err = _within(conn._connect, 5)
        assert isinstance(err, socket.gaierror) and "did not answer" in str(err), err
    finally:
        srv.close()
    conn = rb.redis_client("unix:///nonexistent/kvslots.sock").connection_pool.make_connection()
    assert type(conn) is redis.UnixDomainSocketConnection
