"""``kvslots proxy`` against stand-in workers (httpx MockTransport): the prefill request is cut to
one token with do_remote_decode, its kv_transfer_params reach the decode request, streams pass
through, a failed prefill is recomputed on the decode worker, a failed decode is a 502, the
indexer's scores pick the decode worker."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app, prefill_body  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}


class Backends:
    def __init__(self, prefill_status=200, decode_status=200, scores=None, prefill_params=PARAMS):
        self.calls: list[tuple[str, dict]] = []
        self.prefill_status = prefill_status
        self.decode_status = decode_status
        self.scores = scores
        self.prefill_params = prefill_params

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((str(request.url), body))
        host = request.url.host
        if host == "indexer":
            if self.scores is None:
                return httpx.Response(500)
            return httpx.Response(200, json={"workers": {k: {"score": v} for k, v in self.scores.items()}})
        if host.startswith("prefill"):
            if self.prefill_status == "down":
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(self.prefill_status, json={"choices": [{"text": "x"}],
                                                             "kv_transfer_params": self.prefill_params})
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, text="boom")
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=b"data: {\"a\": 1}\n\ndata: [DONE]\n\n")
        return httpx.Response(200, json={"choices": [{"text": f"decoded by {host}"}], "got": body})


def _client(backends, decode=("http://decode-a",), indexer=None, names=None):
    workers = [DecodeWorker(u, (names or {}).get(u)) for u in decode]
    app = create_app(["http://prefill-1", "http://prefill-2"], workers, indexer_url=indexer,
                     transport=httpx.MockTransport(backends))
    return TestClient(app)


def test_prefill_body_is_one_token_without_stream():
    b = prefill_body({"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"x": 1},
                      "max_completion_tokens": 9})
    assert b["max_tokens"] == 1 and b["max_completion_tokens"] == 1 and b["stream"] is False
    assert "stream_options" not in b and b["kv_transfer_params"] == {"do_remote_decode": True}


def test_hand_off_reaches_the_decode_worker():
    be = Backends()
    with _client(be) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 20})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "disaggregated"
    (purl, pbody), (durl, dbody) = be.calls
    assert purl == "http://prefill-1/v1/completions" and pbody["max_tokens"] == 1
    assert durl == "http://decode-a/v1/completions"
    assert dbody["kv_transfer_params"] == PARAMS and dbody["max_tokens"] == 20
    assert r.json()["got"]["prompt"] == "hello"


def test_prefill_workers_round_robin_and_chat():
    be = Backends()
    with _client(be) as c:
        for _ in range(2):
            assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 200
    assert [u for u, _ in be.calls if "prefill" in u] == ["http://prefill-1/v1/chat/completions",
                                                          "http://prefill-2/v1/chat/completions"]


def test_stream_passes_through():
    be = Backends()
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert be.calls[0][1]["stream"] is False and be.calls[1][1]["stream"] is True


@pytest.mark.parametrize("status, params", [("down", PARAMS), (500, PARAMS), (200, None), (200, {"junk": 1})])
def test_failed_prefill_is_recomputed_on_decode(status, params):
    be = Backends(prefill_status=status, prefill_params=params)
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"forged": True}})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "recomputed"
    assert "kv_transfer_params" not in be.calls[-1][1]
    assert c.get("/healthz").json()["recomputed"] == 1


def test_failed_decode_is_a_502():
    be = Backends(decode_status=503)
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502 and "boom" in r.json()["error"]
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 502


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
                                  b"{\"prompt\": NaN, \"stream\": [[[[]]]]}"])
def test_bad_body_is_a_400(body):
    with _client(Backends()) as c:
        assert c.post("/v1/completions", content=body).status_code == 400


def test_indexer_picks_the_decode_worker():
    be = Backends(scores={"wa": 0.0, "wb": 3.0})
    names = {"http://decode-a": "wa", "http://decode-b": "wb"}
    with _client(be, decode=("http://decode-a", "http://decode-b"), indexer="http://indexer", names=names) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8]})
        assert r.headers["x-kvslots-decode-worker"] == "http://decode-b"
        # a text prompt is not scored (the proxy does not tokenize): round robin
        r = c.post("/v1/completions", json={"prompt": "text"})
        assert r.headers["x-kvslots-decode-worker"] == "http://decode-a"
    be2 = Backends(scores=None)  # indexer failing: round robin, no error
    with _client(be2, decode=("http://decode-a", "http://decode-b"), indexer="http://indexer", names=names) as c:
        assert c.post("/v1/completions", json={"prompt": [5, 6]}).status_code == 200
