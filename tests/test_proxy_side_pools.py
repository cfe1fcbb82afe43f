"""``GET /v1/models`` has a pool of backend connections of its own, apart from the indexer's
``/score``: they shared one of 8 (SIDE_CONNECTIONS), so clients asking for the models of a decode
worker slow to answer them held it, and every completion's /score waited past its 2 s and was
sent round robin instead of to the worker holding its prompt."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from kvslots.proxy.app import SIDE_CONNECTIONS, DecodeWorker, create_app  # noqa: E402
from ports import free_port  # noqa: E402

MODELS_S = 3.0  # the first decode worker's time to answer GET /v1/models


@pytest.fixture(scope="module")
def backend():
    """Workers and an indexer on one real socket (the pools bound real connections only): decode
    worker a at /a, b at /b; the indexer scores b."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path.endswith("/v1/models"):
            await asyncio.sleep(MODELS_S)
            answer: dict = {"data": []}
        elif path == "/score":
            answer = {"workers": {"a": {"score": 0}, "b": {"score": 10}}}
        elif json.loads(body).get("kv_transfer_params", {}).get("do_remote_decode"):
            answer = {"kv_transfer_params": {"do_remote_prefill": True}}
        else:
            answer = {"decoded_at": path}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(10)


def test_a_prompt_is_scored_while_clients_wait_for_the_models(backend):
    app = create_app([f"{backend}/p"], [DecodeWorker(f"{backend}/a", "a"), DecodeWorker(f"{backend}/b", "b")],
                     indexer_url=backend)

    async def calls():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=30) as c:
                models = [asyncio.ensure_future(c.get("/v1/models")) for _ in range(SIDE_CONNECTIONS)]
                await asyncio.sleep(0.3)  # they hold their connections
                start = time.monotonic()
                r = await c.post("/v1/completions", json={"prompt": [1, 2, 3, 4]})
                took = time.monotonic() - start
                first = await models[0]
                for m in models[1:]:  # (not waited for: their pool answers them two at a time)
                    m.cancel()
                await asyncio.gather(*models, return_exceptions=True)
                return r, took, first

    r, took, first = asyncio.run(calls())
    assert first.status_code == 200 and first.json() == {"data": []}
    # the old code: /score waited behind the models past its 2 s: round robin, to a
    assert r.status_code == 200 and r.json() == {"decoded_at": "/b/v1/completions"}, r.text
    assert took < MODELS_S, took
