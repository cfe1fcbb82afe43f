"""The proxy's per-client limit (``--max-requests-per-client``) counts the connection's address,
not one a request names: uvicorn trusted ``X-Forwarded-For`` from 127.0.0.1 by default and put it
in the scope's client, so behind the default ``--host 127.0.0.1`` a client naming a new address in
each request was never limited. Served through uvicorn (a real socket), as ``kvslots proxy`` and
``kvslots indexer`` serve (``httpguard.uvicorn_options``)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.indexer import httpguard  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402


def _statuses(headers: list[dict[str, str]]) -> list[int]:
    """The statuses of requests sent at once (one connection each) with ``headers``, to a proxy
    with a limit of 1 per client whose decode worker holds each request until all have an answer
    or are held."""
    go = threading.Event()
    held = [0]

    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        held[0] += 1
        while not go.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(200, json={"ok": True})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     max_requests_per_client=1)
    port, server, t = serve_guarded(app)

    async def main() -> list[int]:
        clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) for _ in headers]
        try:
            first = asyncio.ensure_future(clients[0].post("/v1/completions", json={"prompt": "hi"},
                                                          headers=headers[0]))
            for _ in range(500):
                if held[0] == 1:
                    break
                await asyncio.sleep(0.01)
            assert held[0] == 1, "the first request never reached the decode worker"
            rest = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi"}, headers=h))
                    for c, h in zip(clients[1:], headers[1:])]
            for _ in range(300):  # each of the others answered (429) or held
                if held[0] + sum(r.done() for r in rest) == len(headers):
                    break
                await asyncio.sleep(0.01)
            go.set()
            return [r.status_code for r in await asyncio.gather(first, *rest)]
        finally:
            go.set()
            for c in clients:
                await c.aclose()

    try:
        return asyncio.run(main())
    finally:
        server.should_exit = True
        t.join(10)


def test_the_limit_counts_the_connections_address_not_x_forwarded_for():
    assert _statuses([{}, {}]) == [200, 429]  # the control
    # the old code: [200, 200], each request a client of its own
    assert _statuses([{"x-forwarded-for": "10.0.0.1"}, {"x-forwarded-for": "10.0.0.2"}]) == [200, 429]


def test_neither_server_takes_addresses_from_headers():
    assert httpguard.uvicorn_options()["proxy_headers"] is False
