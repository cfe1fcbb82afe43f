"""A client's Authorization with trailing blanks (uvicorn's httptools parser keeps them) made h11,
httpx's writer to the workers, refuse the request with an error quoting the value: the client's
credential was logged (prefill and decode lines), sent back in a 502 blaming the decode worker and
counted in decode_errors. Now its outer blanks are dropped, and a value that is no HTTP field
value (a control character) is a 400 that does not quote it. Through real sockets: the proxy under
uvicorn's default parser, the worker under uvicorn with h11."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402


def _worker(seen: list):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen.append([v for k, v in scope["headers"] if k == b"authorization"])
        prefill = json.loads(body).get("kv_transfer_params", {}).get("do_remote_decode")
        out = json.dumps({"kv_transfer_params": {"do_remote_prefill": True}} if prefill else {"ok": 1}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})
    return app


def _serve_h11(app):
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", http="h11"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "worker did not start"
        time.sleep(0.02)
    return sock.getsockname()[1], server, t


def _raw(port: int, auth: bytes) -> bytes:
    body = b'{"prompt":"hi"}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                  + auth + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        out = b""
        while d := s.recv(65536):
            out += d
    return out


def test_an_authorization_with_trailing_blanks_reaches_the_workers_without_them(caplog):
    seen: list = []
    wport, wserver, wt = _serve_h11(_worker(seen))
    url = f"http://127.0.0.1:{wport}"
    port, server, t = serve_guarded(create_app([url], [DecodeWorker(url)]), log_level="critical")
    try:
        with caplog.at_level(logging.DEBUG):
            for auth in (b"Bearer secret  ", b"Bearer secret\t", b"Bearer secret \t "):
                seen.clear()
                out = _raw(port, auth)
                assert out.startswith(b"HTTP/1.1 200 "), out  # the old code: a 502
                assert b"secret" not in out
                assert seen == [[b"Bearer secret"], [b"Bearer secret"]]
        assert "secret" not in caplog.text
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["decode_errors"] == 0
    finally:
        server.should_exit = wserver.should_exit = True
        t.join(10)
        wt.join(10)


@pytest.mark.parametrize("auth", [b"Bearer se\x01cret", b"Bearer secret\x7f", b"Bearer se\ncret", b"Bearer se\x00c"])
def test_an_authorization_that_is_no_field_value_is_a_400_not_quoted(auth, caplog):
    seen: list = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(401, json={"error": "Unauthorized"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.DEBUG), TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": auth})
        m = c.get("/v1/models", headers={"Authorization": auth})
    assert r.status_code == 400 and m.status_code == 400  # the old code: the worker's 401
    assert "Authorization" in r.json()["error"] and b"cret" not in r.content and seen == []
    assert "cret" not in caplog.text


def test_a_request_httpx_cannot_write_is_not_quoted():
    from kvslots.proxy.app import _why

    e = httpx.LocalProtocolError("Illegal header value b'Bearer secret  '")
    assert "secret" not in _why(e) and "LocalProtocolError" in _why(e)
    assert _why(httpx.ReadTimeout("")) == "ReadTimeout"
