"""A client of a streamed completion that goes after its prefill, while its decode worker has not
sent its answer's head (queued in vLLM), ends the decode request at once: the decode request's send
was not watched for the client's disconnect, so it ran, and held the client's place
(``--max-requests-per-client``), until the head came."""

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

HEAD_S = 10.0  # the decode worker's head comes this late


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_a_client_gone_before_the_decode_head_ends_the_decode_request(how):
    opened, ended = threading.Event(), threading.Event()

    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        if opened.is_set():  # the next request: answered at once
            return httpx.Response(200, json={"ok": True})
        opened.set()
        try:
            await asyncio.sleep(HEAD_S)
        finally:
            ended.set()
        return httpx.Response(200, content=b'data: {"x": 1}\n\n', headers={"content-type": "text/event-stream"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     max_requests_per_client=1)
    port, server, t = serve_guarded(app)
    try:
        body = json.dumps({"prompt": "hi", "stream": True, "max_tokens": 10}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert opened.wait(5), "the decode request was never sent"
        s.shutdown(socket.SHUT_WR) if how == "shutdown" else s.close()
        gone = time.monotonic()
        # the old code: at the head (HEAD_S); now at once, or the guard's next tick
        assert ended.wait(2 * httpguard._TICK_S + 1.5), "the decode request was not ended"
        assert time.monotonic() - gone < HEAD_S - 3
        # its place is given back: another request of this address (limit 1) is not a 429
        time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert r.status_code == 200, r.text
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        assert health["gone_in_decode"] == 1 and health["gone_before_decode"] == 0, health
        s.close()
    finally:
        server.should_exit = True
        t.join(10)
