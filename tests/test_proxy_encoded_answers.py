"""``kvslots proxy`` asks its backends for unencoded answers and refuses encoded ones: httpx asked
for gzip and deflate and decoded what came without a bound, 64 KiB read at a time up to 66 MB
(deflate's ratio), so a decode worker's 0.5 MB gzip answer (512 MB of zeros) grew the proxy by
315 MB while the client read it."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402

BOMB = gzip.compress(b"\0" * 2**20)


def _app(encode: set[str], asked: list[str]):
    """A proxy over workers (and an indexer) whose answers named in ``encode`` ("prefill",
    "decode", "indexer", "models") come gzip-encoded; ``asked`` gets each request's
    Accept-Encoding."""

    def backend(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("accept-encoding", ""))
        if request.url.path == "/score":
            what, doc = "indexer", {"workers": {"a": {"score": 5}}}
        elif request.url.path == "/v1/models":
            what, doc = "models", {"data": []}
        elif json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            what, doc = "prefill", {"kv_transfer_params": {"do_remote_prefill": True}}
        else:
            what, doc = "decode", {"ok": True}
        if what in encode:
            return httpx.Response(200, content=gzip.compress(json.dumps(doc).encode()) if what != "decode" else BOMB,
                                  headers={"content-type": "application/json", "content-encoding": "gzip"})
        return httpx.Response(200, json=doc)

    return create_app(["http://p"], [DecodeWorker("http://d", "a")], indexer_url="http://i",
                      transport=httpx.MockTransport(backend))


@pytest.mark.parametrize("stream", [False, True])
def test_an_encoded_decode_answer_is_the_workers_failure(stream):
    asked: list[str] = []
    with TestClient(_app({"decode"}, asked)) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": stream})
        health = c.get("/healthz").json()
    assert r.status_code == 502, (r.status_code, len(r.content))  # the old code: 200, 1 MiB decoded
    assert "Content-Encoding 'gzip'" in r.json()["error"] and health["decode_errors"] == 1
    assert asked and set(asked) == {"identity"}, asked  # the old code: gzip, deflate


def test_an_encoded_prefill_answer_is_recomputed_and_an_encoded_score_round_robin():
    asked: list[str] = []
    with TestClient(_app({"prefill", "indexer"}, asked)) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert r.headers["x-kvslots-pd"] == "recomputed"  # the old code: disaggregated, its answer decoded
    assert set(asked) == {"identity"}, asked


def test_an_encoded_models_answer_is_a_502():
    asked: list[str] = []
    with TestClient(_app({"models"}, asked)) as c:
        r = c.get("/v1/models")
    assert r.status_code == 502 and "Content-Encoding" in r.json()["error"], r.text
    assert asked == ["identity"]


def test_unencoded_answers_pass():
    asked: list[str] = []
    with TestClient(_app(set(), asked)) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "disaggregated", r.text
