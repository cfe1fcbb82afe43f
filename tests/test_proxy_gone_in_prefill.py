"""A client of ``kvslots proxy`` that goes while its prompt is being prefilled gets no decode:
the prefill request is cancelled and the decode worker never sees the request (it was started
once the prefill answered, its answer written to nobody). A closed client and a half-closed one
look the same until written to: for a request without a stream the proxy writes an interim
``100 Continue`` on the client's EOF (``httpguard.probe_eof``), which a closed client's system
answers with a reset; a half-closed client still gets its answer, after the interim one."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.indexer import httpguard  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402

PREFILL_S = 4.0  # the prefill worker's time on the prompt of a client that goes
SHORT_PREFILL_S = 1.0  # on the others'


class _Marks:
    def __init__(self) -> None:
        self.prefill_ended = threading.Event()  # the prefill request ended: answered or cancelled
        self.prefill_cancelled = False
        self.decode = threading.Event()  # the decode worker got the request
        self.decode_ended = threading.Event()
        self.decode_cancelled = False


@pytest.fixture(scope="module")
def proxy():
    """(port, marks: prompt -> _Marks)."""
    marks: dict[str, _Marks] = {}

    async def backend(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        m = marks[body["prompt"]]
        in_decode = body["prompt"].startswith("in-decode")
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            try:
                await asyncio.sleep(PREFILL_S if body["prompt"].startswith("gone") else
                                    0.0 if in_decode else SHORT_PREFILL_S)
            except asyncio.CancelledError:
                m.prefill_cancelled = True
                raise
            finally:
                m.prefill_ended.set()
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        m.decode.set()
        if in_decode:  # a long answer without a stream
            try:
                await asyncio.sleep(PREFILL_S)
            except asyncio.CancelledError:
                m.decode_cancelled = True
                raise
            finally:
                m.decode_ended.set()
        if body.get("stream"):
            return httpx.Response(200, content=b'data: {"x": 1}\n\ndata: [DONE]\n\n',
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"whole": True})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    port, server, t = serve_guarded(app)
    yield port, marks, app
    server.should_exit = True
    t.join(10)


def _request(prompt: str, stream: bool, version: bytes = b"1.1") -> bytes:
    body = json.dumps({"prompt": prompt, "stream": stream, "max_tokens": 10}).encode()
    return (b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (version, len(body))) + body


def _send(port: int, prompt: str, stream: bool, marks: dict, version: bytes = b"1.1") -> tuple[socket.socket, _Marks]:
    m = marks[prompt] = _Marks()
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(PREFILL_S + 5)
    s.sendall(_request(prompt, stream, version))
    time.sleep(0.3)  # its prefill is under way
    return s, m


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reset is read from TCP_INFO (Linux)")
@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_gone_during_its_prefill_gets_no_decode(proxy, stream, how):
    port, marks, _ = proxy
    prompt = f"gone-{stream}-{how}"
    s, m = _send(port, prompt, stream, marks)
    if how == "reset":  # SO_LINGER 0: closed with a reset
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    gone = time.monotonic()
    s.close()
    # within the guard's tick (the EOF may come before the request is marked) and the probe's wait
    assert m.prefill_ended.wait(PREFILL_S + 2)
    assert m.prefill_cancelled and time.monotonic() - gone < 2 * httpguard._TICK_S + 1, \
        "the prefill request ran on"  # the old code: it ran its PREFILL_S
    assert not m.decode.wait(1.0), "the decode worker got the request of a client gone"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reset is read from TCP_INFO (Linux)")
def test_a_client_gone_while_its_answer_is_decoded_ends_the_decode_request(proxy):
    port, marks, _ = proxy
    m = marks["in-decode"] = _Marks()
    before = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["gone_in_decode"]
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request("in-decode", False))
    assert m.decode.wait(5)
    gone = time.monotonic()
    s.close()
    assert m.decode_ended.wait(PREFILL_S + 2)
    assert m.decode_cancelled and time.monotonic() - gone < 2 * httpguard._TICK_S + 1, \
        "the decode request ran on"  # before: it ran its PREFILL_S, for nobody
    time.sleep(0.2)  # (counted as the request returns)
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["gone_in_decode"] == before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_stays_gets_its_answer(proxy, stream):
    port, marks, _ = proxy
    s, m = _send(port, f"stays-{stream}", stream, marks)
    with s:
        out = b""
        while b"0\r\n\r\n" not in out and b'{"whole":true}' not in out:
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 OK") and m.decode.is_set() and not m.prefill_cancelled, out[:300]


def test_a_half_closed_client_gets_its_answer_after_the_interim_one(proxy):
    port, marks, app = proxy
    s, m = _send(port, "half-closed", False, marks)
    with s:
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK"), out[:300]
    assert out.endswith(b'{"whole":true}') and m.decode.is_set()
    # a client that reads it with http.client (which skips a 100) gets the answer too
    import http.client

    marks["http.client"] = _Marks()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PREFILL_S + 5)
    body = _request("http.client", False).split(b"\r\n\r\n", 1)[1]
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    time.sleep(0.3)
    conn.sock.shutdown(socket.SHUT_WR)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read()) == {"whole": True}
    conn.close()


def test_an_http_10_client_is_not_sent_an_interim_answer(proxy):
    port, marks, _ = proxy
    s, m = _send(port, "http/1.0", False, marks, version=b"1.0")
    with s:
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b'{"whole":true}'), out[:300]


@pytest.mark.parametrize("scope", [None, [], "scope", 3])
def test_probe_eof_takes_a_scope_only(scope):
    from kvslots.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        httpguard.probe_eof(scope)
