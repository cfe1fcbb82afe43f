"""A prefill worker's refusals: whose fault they are decides what the client gets and what is logged."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402


def _prefill(request: httpx.Request) -> bool:
    return bool(json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"))


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("credential", ["backend_api_key", "userinfo"])
def test_a_prefill_refusal_of_the_proxys_credential_is_recomputed(caplog, credential, status, stream):
    """With --backend-api-key or a URL's user:password the credential is the proxy's: a prefill
    worker refusing it is the operator's mistake. Every client got that 401/403 (the old code),
    the decode worker, which would have served them, never asked; now recomputed, with a warning."""
    seen = []

    def backend(request: httpx.Request) -> httpx.Response:
        leg = "prefill" if _prefill(request) else "decode"
        seen.append(leg)
        if leg == "prefill":
            return httpx.Response(status, json={"error": "Unauthorized"})
        return httpx.Response(200, json={"ok": 1})

    prefill, kw = (("http://p", {"backend_api_key": "the-key"}) if credential == "backend_api_key"
                   else ("http://u:pw@p", {}))
    app = create_app([prefill], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend), **kw)
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream},
                   headers={"Authorization": "Bearer the-clients"})
        health = c.get("/healthz").json()
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "recomputed"  # the old code: the 401/403
    assert seen == ["prefill", "decode"]
    assert health["prefill_errors"]["4xx"] == 1 and health["recomputed"] == 1
    lines = _warnings(caplog, "prefill worker http://p refused the proxy's credential")
    assert len(lines) == 1 and "u:pw" not in lines[0]


def test_a_prefill_workers_4xx_the_decode_worker_serves_is_logged(caplog):
    """A prefill worker serving another model name (vLLM's 404) refused every request the decode
    worker then served: P/D was off, and the old code logged it at DEBUG, nothing at INFO."""
    def backend(request: httpx.Request) -> httpx.Response:
        if _prefill(request):
            return httpx.Response(404, json={"error": {"message": "The model `llama` does not exist."}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "recomputed"
    lines = _warnings(caplog, "prefill worker http://p answered 404")
    assert len(lines) == 3 and "does not exist" in lines[0]  # the old code: none
