"""``kvslots proxy`` against backends that answer without end: the indexer's and a prefill
worker's answers are read whole by the proxy, and httpx's timeouts are each read's, so one
trickled a byte at a time held the request for ever, and one streamed without end was read into
memory whole. Now each is read within a time (the indexer's 2 s, the proxy's timeout) and a size
(:data:`MAX_INDEXER_ANSWER`, :data:`MAX_PREFILL_ANSWER`), past which the indexer is not used
(round robin) and the prompt is computed on the decode worker. A decode worker's answer read
whole (/v1/models, its refusal of a request) is a 502 past --timeout or its size
(:data:`MAX_MODELS_ANSWER`, :data:`MAX_DECODE_ANSWER`); its answer to a request without a stream
past :data:`PASS_ON_AFTER` is passed on as it comes, cut off at --timeout. Real sockets on
loopback."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy import app as app_module  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answer):
        self.answer = answer  # (server, socket) -> None, after the request is read
        self.stop = threading.Event()
        self.sent = 0
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        data = b""
        while b"\r\n\r\n" not in data:
            more = self.request.recv(65536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += self.request.recv(65536)
        try:
            self.server.answer(self.server, self.request)
        except OSError:  # the proxy hung up
            pass


def _send(server: _Server, sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)
    server.sent += len(data)


def trickle(server, sock):
    """A chunked answer of a blank every 0.2 s, for as long as the test runs."""
    _send(server, sock, HEAD)
    while not server.stop.wait(0.2):
        _send(server, sock, b"1\r\n \r\n")


def endless(server, sock):
    """A chunked answer of 64 KiB blanks as fast as the proxy reads them, up to 160 MB."""
    _send(server, sock, HEAD)
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    while server.sent < 160 * 2**20 and not server.stop.is_set():
        _send(server, sock, chunk)
    _send(server, sock, b"0\r\n\r\n")


def _json(doc):
    def answer(server, sock):
        body = json.dumps(doc).encode()
        _send(server, sock, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
              b"connection: close\r\n\r\n%s" % (len(body), body))
    return answer


PREFILLED = {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e"}}


def _ask(prefill, indexer, timeout_s=600.0, wait=15.0):
    """POSTs a token-id prompt through a proxy over these servers (decode workers wa, wb):
    the answer and the seconds it took, or (None, wait) when it took longer (the servers are
    closed then, which ends it)."""
    decode = [_Server(_json({"by": name})) for name in ("wa", "wb")]
    servers = [prefill, indexer, *decode]
    app = create_app([prefill.url], [DecodeWorker(d.url, n) for d, n in zip(decode, ("wa", "wb"))],
                     indexer_url=indexer.url, timeout_s=timeout_s)
    got = []
    try:
        with TestClient(app) as c:
            def post():
                t = time.perf_counter()
                r = c.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2})
                got.append((r, time.perf_counter() - t))
            th = threading.Thread(target=post, daemon=True)
            th.start()
            th.join(wait)
            for s in servers:
                s.stop.set()
            th.join(30)
    finally:
        for s in servers:
            s.close()
    return got[0] if got and got[0][1] < wait else (None, wait)


@pytest.mark.parametrize("answer", [trickle, endless])
def test_an_indexer_answering_without_end_is_given_up(answer):
    indexer = _Server(answer)
    r, took = _ask(_Server(_json(PREFILLED)), indexer)
    assert r is not None, f"no answer within {took} s"  # trickle: held for ever
    assert r.status_code == 200 and r.json() == {"by": "wa"}, r.text  # round robin's first
    assert r.headers["x-kvslots-pd"] == "disaggregated"
    assert indexer.sent < 32 * 2**20, indexer.sent  # endless: all 160 MB were read into memory
    assert took < app_module.INDEXER_TIMEOUT_S + 3, took


@pytest.mark.parametrize("answer", [trickle, endless])
def test_a_prefill_worker_answering_without_end_is_computed_on_the_decode_worker(answer):
    prefill = _Server(answer)
    r, took = _ask(prefill, _Server(_json({"workers": {"wb": {"score": 2}}})), timeout_s=1.5)
    assert r is not None, f"no answer within {took} s"
    assert r.status_code == 200 and r.json() == {"by": "wb"}, r.text  # the indexer's pick
    assert r.headers["x-kvslots-pd"] == "recomputed"
    assert prefill.sent < 96 * 2**20, prefill.sent  # endless: all 160 MB were read into memory
    assert took < 1.5 + 3, took


@pytest.mark.parametrize("answer", [trickle, endless])
def test_models_from_a_decode_worker_answering_without_end_is_a_502(answer):
    decode = _Server(answer)
    app = create_app(["http://127.0.0.1:1"], [DecodeWorker(decode.url)], timeout_s=1.5)
    got = []
    try:
        with TestClient(app) as c:
            def get():
                t = time.perf_counter()
                r = c.get("/v1/models")
                got.append((r, time.perf_counter() - t))
            th = threading.Thread(target=get, daemon=True)
            th.start()
            th.join(15)
            decode.stop.set()  # ends a request still held
            th.join(30)
    finally:
        decode.close()
    assert decode.sent < 48 * 2**20, decode.sent  # endless: all 160 MB were read into memory
    r, took = got[0]
    assert took < 1.5 + 3, took  # trickle: held for ever
    assert r.status_code == 502 and "decode worker failed" in r.json()["error"], r.text


def _decode_answer(answer, stream):
    """POSTs a prompt through a proxy whose decode worker answers with ``answer``: the answer,
    the seconds it took (or None, 15 when it took longer) and the bytes the worker sent."""
    prefill, decode = _Server(_json(PREFILLED)), _Server(answer)
    app = create_app([prefill.url], [DecodeWorker(decode.url)], timeout_s=1.5)
    got = []
    try:
        with TestClient(app) as c:
            def post():
                t = time.perf_counter()
                r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
                got.append((r, time.perf_counter() - t))
            th = threading.Thread(target=post, daemon=True)
            th.start()
            th.join(15)
            decode.stop.set()  # ends a request still held
            th.join(30)
    finally:
        prefill.close()
        decode.close()
    r, took = got[0] if got and got[0][1] < 15 else (None, 15)
    return r, took, decode.sent


@pytest.mark.parametrize("answer", [trickle, endless])
def test_a_decode_worker_answering_without_end_is_given_up(answer):
    r, took, sent = _decode_answer(answer, stream=False)
    assert r is not None, "no answer within 15 s"  # trickle: held until the worker stopped
    assert took < 1.5 + 3, took
    if answer is trickle:  # under PASS_ON_AFTER by --timeout: nothing sent yet
        assert r.status_code == 502 and "decode worker" in r.json()["error"], r.text
    else:  # passed on as it came (not read into memory), cut off at --timeout
        # (TestClient does not tell an unfinished answer; test_proxy_pass_on.py does, on a socket)
        assert r.status_code == 200 and not r.content.strip(b" "), r.content[:100]
        assert sent > app_module.PASS_ON_AFTER


def _error_head(answer):
    """``answer``, its head a 500 (a decode worker refusing a stream) instead of the 200."""
    def refusing(server, sock):
        real = sock.sendall

        class Sock:
            def sendall(self, data):
                real(data.replace(b"HTTP/1.1 200 OK", b"HTTP/1.1 500 Internal Server Error", 1))
        answer(server, Sock())
    return refusing


@pytest.mark.parametrize("answer", [trickle, endless])
def test_a_decode_worker_refusing_a_stream_without_end_is_a_502(answer):
    r, took, sent = _decode_answer(_error_head(answer), stream=True)
    assert sent < 96 * 2**20, sent  # endless: its error body was read into memory whole
    assert r is not None, "no answer within 15 s"
    assert took < 1.5 + 3, took
    assert r.status_code == 502 and "decode worker" in r.json()["error"], r.text
