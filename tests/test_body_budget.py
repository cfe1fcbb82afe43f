"""The bodies of the requests ``kvslots proxy`` and ``kvslots indexer`` read or handle at once
are bounded together (:class:`kvslots.indexer.httpguard.BodyLimit`'s budget): each body was
bounded (``--max-body-mb``), their number only by the connection cap, and six 60 MB prompts at
once took the proxy to 1.6 GB, 300 MB more for each one after. Past the budget a request is a
503 with Retry-After before its body is read, and the budget is given back as requests end."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from indexer_support import wait_for  # noqa: E402

from kvslots.indexer import IndexerConfig, IndexerService  # noqa: E402
from kvslots.indexer import app as indexer_app  # noqa: E402
from kvslots.proxy import app as proxy_app  # noqa: E402

MB = 2**20


class _Held(httpx.AsyncBaseTransport):
    """Backends that answer once the gate opens: the requests stay in flight until then."""

    def __init__(self):
        self.gate = threading.Event()
        self.reached = 0

    async def handle_async_request(self, request):
        self.reached += 1
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})


def _post_all(c: TestClient, bodies) -> tuple[list, list[threading.Thread]]:
    got: list = []

    def post(body):
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        got.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=post, args=(b,), daemon=True) for b in bodies]
    for t in threads:
        t.start()
    return got, threads


def test_the_proxy_takes_at_most_its_budget_of_bodies_at_once(monkeypatch):
    monkeypatch.setattr(proxy_app, "BODY_BUDGET_BYTES", 0, raising=False)  # four of the largest: 4 MiB
    be = _Held()
    app = proxy_app.create_app(["http://p"], [proxy_app.DecodeWorker("http://d")], transport=be, max_body_mb=1)
    body = b'{"prompt": "' + b"x" * (MB - 200) + b'"}'
    with TestClient(app) as c:
        got, threads = _post_all(c, [body] * 6)
        try:
            wait_for(lambda: be.reached == 4 and len(got) == 2, 10, "four in flight, two refused")
            assert all(s == 503 and retry == "1" and "takes at most 4194304" in doc["error"]
                       for s, retry, doc in got), got
            # Without a Content-Length it is counted as it comes: refused too while the four are held.
            r = c.post("/v1/completions", content=iter([body[:1000], body[1000:]]))
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        finally:  # the requests held, let go and done before the client closes
            be.gate.set()
            for t in threads:
                t.join(20)
        assert sorted(s for s, *_ in got) == [200] * 4 + [503] * 2, got
        r = c.post("/v1/completions", content=iter([body[:1000], body[1000:]]))  # given back
        assert r.status_code == 200, r.text


def test_the_indexer_takes_at_most_its_budget_of_bodies_at_once(monkeypatch):
    monkeypatch.setattr(indexer_app, "BODY_BUDGET_BYTES", 0, raising=False)
    svc = IndexerService(IndexerConfig(block_size=4, max_tokens=20_000))  # bodies of at most 244 KB
    gate, reached = threading.Event(), []
    score = svc.score

    def held(*args):
        reached.append(1)
        gate.wait(20)
        return score(*args)

    monkeypatch.setattr(svc, "score", held)
    body = b'{"token_ids": [' + b",".join([b"1234567890"] * 20_000) + b"]}"  # 220 KB
    budget = 4 * svc.cfg.max_body_bytes
    with TestClient(indexer_app.create_app(svc)) as c:
        got: list = []

        def post():
            r = c.post("/score", content=body, headers={"content-type": "application/json"})
            got.append((r.status_code, r.headers.get("retry-after"), r.json()))

        threads = [threading.Thread(target=post, daemon=True) for _ in range(5)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(reached) == 4 and len(got) == 1, 10, "four in flight, one refused")
            assert got[0][:2] == (503, "1") and f"takes at most {budget}" in got[0][2]["detail"], got
        finally:
            gate.set()
            for t in threads:
                t.join(20)
        assert sorted(s for s, *_ in got) == [200] * 4 + [503], got
        assert c.post("/score", content=body, headers={"content-type": "application/json"}).status_code == 200
