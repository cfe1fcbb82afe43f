"""A client that reads nothing of a decode worker's answer passed on as it comes (no stream, past
PASS_ON_AFTER) is cut off at its own ``--timeout`` and counted in /healthz ``slow_clients``: its
time was counted only after each chunk was taken, so a client taking none blocked the proxy's send
until the guard's write stall (READ_TIMEOUT_S, 60 s), uncounted. Patched high here, it never came.
A write stall that comes first (READ_TIMEOUT_S under ``--timeout``, as by default) is counted too:
it ended the send as if it were sent."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.indexer import httpguard  # noqa: E402
from kvslots.proxy.app import PASS_ON_AFTER, DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402

BIG = 16 * 2**20  # far more than the socket buffers hold


def _slow_client(timeout_s: float, read_timeout_s: float, monkeypatch) -> tuple[dict, bytes, float]:
    """/healthz once it counts a slow client (or after the time it should have), what a client
    that reads nothing of its answer got when it read at last, and how long until it was counted."""
    monkeypatch.setattr(httpguard, "READ_TIMEOUT_S", read_timeout_s)

    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

        async def gen():
            yield b'{"text": "' + b"a" * (PASS_ON_AFTER + 1024)  # past it: passed on as it comes
            for _ in range(BIG // 2**18):
                await asyncio.sleep(0)
                yield b"a" * 2**18
            yield b'"}'

        return httpx.Response(200, content=gen(), headers={"content-type": "application/json"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     timeout_s=timeout_s)
    port, server, t = serve_guarded(app, log_level="critical")
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        sent = time.monotonic()
        health = {}
        while time.monotonic() - sent < min(timeout_s, read_timeout_s) + 2 * httpguard._TICK_S + 3:  # reading nothing
            health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
            if health["slow_clients"]:
                break
            time.sleep(0.2)
        took = time.monotonic() - sent
        s.settimeout(5)
        out = bytearray()
        try:
            while chunk := s.recv(2**20):
                out += chunk
        except ConnectionResetError:
            pass
        return health, bytes(out), took
    finally:
        s.close()
        server.should_exit = True
        t.join(10)


def test_a_client_reading_nothing_is_cut_off_at_its_timeout_and_counted(monkeypatch):
    health, out, took = _slow_client(2.0, 1000.0, monkeypatch)
    assert health["slow_clients"] == 1 and health["decode_errors"] == 0, health  # the old code: 0
    assert took > 1.5
    # the connection is closed (aborted: what it was not sent is dropped), the answer unfinished
    assert out.startswith(b"HTTP/1.1 200 OK") and not out.endswith(b"0\r\n\r\n"), out[-200:]
    assert len(out) < BIG


def test_a_write_stall_before_the_timeout_is_counted(monkeypatch):
    health, out, took = _slow_client(60.0, 1.0, monkeypatch)
    assert health["slow_clients"] == 1 and health["decode_errors"] == 0, health  # the old code: 0
    assert out.startswith(b"HTTP/1.1 200 OK") and not out.endswith(b"0\r\n\r\n"), out[-200:]
    assert len(out) < BIG
