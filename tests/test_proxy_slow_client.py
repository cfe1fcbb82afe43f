"""A decode worker's answer passed on to the client as it comes (no stream, past PASS_ON_AFTER):
``--timeout`` bounds the worker's time (waiting for its bytes) and, apart, the client's (taking
them). One clock counted both: a client slow to read had the answer cut off and the worker blamed
for it (``decode_errors``, "decode worker ... broke off its answer")."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.proxy.app import PASS_ON_AFTER, DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402

TIMEOUT_S = 2.5
PAUSE_S = 1.5  # each side's pause: each within TIMEOUT_S, both together past it
BIG = 8 * 2**20  # more than the socket buffers hold: the proxy waits on a client that pauses
PIECE = 256 * 1024


def _serve(worker_pause: float, trickle: bool = False):
    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

        async def gen():
            yield b'{"text": "' + b"a" * (PASS_ON_AFTER + PIECE)  # past it: passed on as it comes
            await asyncio.sleep(worker_pause)
            if trickle:  # a worker that never ends
                while True:
                    await asyncio.sleep(0.1)
                    yield b"a"
            for _ in range(BIG // PIECE):
                await asyncio.sleep(0)  # (a worker's bytes come from a socket)
                yield b"a" * PIECE
            yield b'"}'

        return httpx.Response(200, content=gen(), headers={"content-type": "application/json"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     timeout_s=TIMEOUT_S)
    return serve_guarded(app, log_level="critical")


def _read(port: int, pause_after: int, pause_s: float) -> bytes:
    """The raw answer to a completion without a stream, read by a client with a small receive
    buffer that stops for ``pause_s`` once it has ``pause_after`` bytes."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    s.connect(("127.0.0.1", port))
    s.settimeout(15)
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        out = bytearray()
        paused = False
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return bytes(out)
            out += chunk
            if not paused and len(out) > pause_after:
                paused = True
                time.sleep(pause_s)


def _healthz(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()


def _run(worker_pause: float, pause_after: int, client_pause: float, trickle: bool = False) -> tuple[bytes, dict]:
    port, server, t = _serve(worker_pause, trickle)
    try:
        out = _read(port, pause_after, client_pause)
        time.sleep(0.2)  # (the counters are set as the answer ends)
        return out, _healthz(port)
    finally:
        server.should_exit = True
        t.join(10)


def test_a_client_slow_to_read_is_not_counted_as_the_workers_time():
    # the client stops once it has bytes sent after the worker's pause: both pauses together
    # are past --timeout, each is within it
    out, health = _run(PAUSE_S, PASS_ON_AFTER + PIECE + 2**20, PAUSE_S)
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b'"}\r\n0\r\n\r\n'), out[-200:]  # the old code: cut
    assert health["decode_errors"] == 0 and health["slow_clients"] == 0, health


def test_a_client_too_slow_is_cut_off_and_not_blamed_on_the_worker():
    out, health = _run(0.0, PASS_ON_AFTER + PIECE + 2**20, TIMEOUT_S + 0.7)
    assert out.startswith(b"HTTP/1.1 200 OK") and not out.endswith(b"0\r\n\r\n"), out[-200:]  # cut: no last chunk
    assert health["decode_errors"] == 0 and health["slow_clients"] == 1, health  # the old code: decode_errors 1


def test_a_worker_too_slow_is_cut_off_and_counted():
    out, health = _run(0.0, 1 << 40, 0.0, trickle=True)
    assert out.startswith(b"HTTP/1.1 200 OK") and not out.endswith(b"0\r\n\r\n"), out[-200:]
    assert health["decode_errors"] == 1 and health["slow_clients"] == 0, health
