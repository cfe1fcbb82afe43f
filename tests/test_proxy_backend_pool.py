"""``kvslots proxy``'s pool of backend connections: 1024 by default (``--backend-connections``, or
half of what the descriptor limit leaves when that is less), not httpx's 100, so that a benchmark
at concurrency 256 is not queued in the proxy while vLLM takes 256 requests at once; the indexer's
/score and ``GET /v1/models`` have a small pool of their own, not waiting behind held requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from ports import free_port  # noqa: E402
from proxy_support import started  # noqa: E402,F401 - a fixture

AT_ONCE = 150  # past httpx's default pool of 100


class _Backend:
    """A worker on a real socket: prefills at once; holds each decode request until ``AT_ONCE``
    are in (or ``release`` is set, or 10 s pass), counting the most held at once."""

    def __init__(self, at_once: int = AT_ONCE):
        self.at_once = at_once
        self.held = 0
        self.most = 0
        self.release = threading.Event()
        self.go: asyncio.Event | None = None  # (made in the server's loop)

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            body = b""
            while True:
                msg = await receive()
                body += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            doc = json.loads(body) if body else {}
            if scope["path"] == "/v1/models":
                answer = {"data": []}
            elif doc.get("kv_transfer_params", {}).get("do_remote_decode"):
                answer = {"kv_transfer_params": {"do_remote_prefill": True}}
            else:
                if self.go is None:
                    self.go = asyncio.Event()
                self.held += 1
                self.most = max(self.most, self.held)
                if self.most >= self.at_once or self.release.is_set():
                    self.go.set()
                deadline = time.monotonic() + 10
                while not self.go.is_set() and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.go.wait(), 0.2)  # (release is set from another thread)
                    if self.release.is_set():
                        self.go.set()
                self.held -= 1
                answer = {"held_with": self.most}
            out = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": out})

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    lifespan="off", backlog=4096))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "backend did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def backend():
    b = _Backend()
    yield b
    b.close()


async def _through(app, calls):
    """``calls(client)`` against the proxy app in this loop (ASGI, no socket), its lifespan run."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as c:
            return await calls(c)


def test_more_requests_than_httpx_default_pool_reach_the_workers_at_once(backend):
    app = create_app([backend.url], [DecodeWorker(backend.url)])  # (prefilled there too)

    async def calls(c):
        return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                                      for _ in range(AT_ONCE)))

    answers = asyncio.run(_through(app, calls))
    assert all(r.status_code == 200 for r in answers), {r.status_code for r in answers}
    assert backend.most == AT_ONCE, backend.most  # the old code: 100 (the rest queued in the proxy)


def test_models_is_answered_while_every_backend_connection_is_held(backend):
    app = create_app([backend.url], [DecodeWorker(backend.url)], backend_connections=2)

    async def calls(c):
        held = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi"})) for _ in range(2)]
        while backend.held < 2:
            await asyncio.sleep(0.02)
        models = await asyncio.wait_for(c.get("/v1/models"), 5)
        backend.release.set()
        return models, await asyncio.gather(*held)

    models, held = asyncio.run(_through(app, calls))
    assert models.status_code == 200 and models.json() == {"data": []}, models.text
    assert [r.status_code for r in held] == [200, 200] and backend.most == 2


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8", 2**16 + 1])
def test_create_app_backend_connections_out_of_range(value):
    with pytest.raises(InvalidArgumentError):
        create_app(["http://p"], [DecodeWorker("http://d")], backend_connections=value)


def _cli(capsys, argv):
    capsys.readouterr()
    code = cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def limit_1024(monkeypatch):
    """A limit of 1024 descriptors with 20 open."""
    from kvslots.indexer import fds

    monkeypatch.setattr(fds, "limit", lambda: 1024)
    monkeypatch.setattr(fds, "in_use", lambda: 20)


def test_the_default_pool_shares_what_the_limit_leaves(capsys, started, limit_1024):
    from kvslots.indexer import fds
    from kvslots.proxy.app import SIDE_CONNECTIONS

    code, out, err = _cli(capsys, [])
    assert code == 0, err
    room = 1024 - 20 - fds.SPARE
    assert started["app"]["backend_connections"] == room // 2
    assert started["http"].max_connections == room - room // 2 - SIDE_CONNECTIONS


def test_backend_connections_given(capsys, started, limit_1024):
    from kvslots.proxy.app import SIDE_CONNECTIONS

    code, out, err = _cli(capsys, ["--backend-connections", "300"])
    assert code == 0, err
    assert started["app"]["backend_connections"] == 300
    assert started["http"].max_connections == 1024 - 20 - 64 - 300 - SIDE_CONNECTIONS


@pytest.mark.parametrize("value, says", [("0", "must be in 1..65536"), ("-5", "must be in 1..65536"),
                                         (str(2**16 + 1), "must be in 1..65536"),
                                         ("930", "the limit of 1024 (ulimit -n) leaves")])
def test_backend_connections_refused_is_one_line_exit_2(capsys, started, limit_1024, value, says):
    code, out, err = _cli(capsys, ["--backend-connections", value])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--backend-connections {value}" in err and says in err, err
    assert "http" not in started
