"""A client of ``kvslots proxy`` that closes its connection while its streamed completion has
produced nothing yet (queued in vLLM, a long prefill) ends the decode worker's stream at once, not
at the first token (15f9d03 kept every connection open after the client's FIN so that a
half-closed client gets its answer: a closed one was then noticed only when the first token was
written to it, 3 s here); a half-closed client of a request without a stream still gets its
answer (after an interim 100 Continue), however long it takes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.indexer import httpguard  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402

FIRST_TOKEN_S = 8.0  # the decode worker's stream: nothing for this long (queued in vLLM)
LONG_PREFILL_S = 2 * httpguard._TICK_S + 2.0


@pytest.fixture(scope="module")
def proxy():
    """(port, {"opened": Event, "closed": Event}) for the last streamed decode request."""
    marks: dict[str, threading.Event] = {}

    async def backend(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            # the prefill; a long one for a client to go in (seen gone within a tick or two)
            await asyncio.sleep(LONG_PREFILL_S if body["prompt"] == "long" else 0.2)
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        if not body.get("stream"):
            await asyncio.sleep(1.5 * httpguard._TICK_S + 0.5)  # past a guard's tick
            return httpx.Response(200, json={"whole": True})
        opened, closed = marks["opened"], marks["closed"]

        async def gen():
            opened.set()
            try:
                await asyncio.sleep(FIRST_TOKEN_S)
                yield b'data: {"x": 1}\n\n'
            finally:
                closed.set()

        return httpx.Response(200, content=gen(), headers={"content-type": "text/event-stream"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    port, server, t = serve_guarded(app)
    yield port, marks
    server.should_exit = True
    t.join(10)


def _request(stream: bool, prompt: str = "hi") -> bytes:
    body = json.dumps({"prompt": prompt, "stream": stream, "max_tokens": 10}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


@pytest.mark.parametrize("when", ["after the head", "before the head"])
@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_a_client_gone_from_a_stream_ends_the_decode_stream(proxy, when, how):
    port, marks = proxy
    marks["opened"], marks["closed"] = threading.Event(), threading.Event()
    gone_before = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["gone_before_decode"]
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    s.sendall(_request(stream=True, prompt="long" if when == "before the head" else "hi"))
    if when == "after the head":  # the stream's head is written, no token yet
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 OK"), got[:300]
    else:  # gone while its prefill runs (a close and a half-close look the same), its body read
        time.sleep(0.3)
    s.shutdown(socket.SHUT_WR) if how == "shutdown" else s.close()
    gone = time.monotonic()
    try:
        if when == "before the head":  # seen gone before its prefill ended: no decode started
            assert not marks["opened"].wait(LONG_PREFILL_S + 1.0), "a decode was started for a client gone"
            health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
            assert health["gone_before_decode"] == gone_before + 1, health
            return
        assert marks["opened"].wait(5)
        # the old code: at the first token (FIRST_TOKEN_S); now at once, or the guard's next tick
        assert marks["closed"].wait(2 * httpguard._TICK_S + 1.5), "the decode stream was not ended"
        assert time.monotonic() - gone < FIRST_TOKEN_S - 2
    finally:
        s.close()


def test_a_half_closed_client_still_gets_an_answer_without_a_stream(proxy):
    port, _ = proxy
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(_request(stream=False))
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    # after an interim 100 Continue, which tells it from a closed client (httpguard.probe_eof)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and out.endswith(b'{"whole":true}'), \
        out[:500]


@pytest.mark.parametrize("scope", [None, [], "scope", 3])
def test_eof_is_disconnect_takes_a_scope_only(scope):
    from kvslots.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        httpguard.eof_is_disconnect(scope)
