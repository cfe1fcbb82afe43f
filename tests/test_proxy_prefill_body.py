"""The prefill worker's copy of a request is one vLLM takes: ``min_tokens`` past its
``max_tokens`` of 1 is refused (vLLM's SamplingParams: "min_tokens must be less than or equal to
max_tokens"), so a request with ``min_tokens`` > 1 had its prefill refused every time and was
computed again on the decode worker."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app, prefill_body  # noqa: E402


def _vllm_refuses(body: dict) -> str | None:
    """What vLLM 0.32's SamplingParams._verify_args says of the token counts (None: taken)."""
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    least = body.get("min_tokens", 0)
    if most is not None and least > most:
        return f"min_tokens must be less than or equal to max_tokens={most}, got {least}."
    return None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 20, "min_tokens": 10}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20,
                              "min_tokens": 5, "stream": False}),
])
def test_a_request_with_min_tokens_is_disaggregated(path, body):
    seen = {}

    def backend(request: httpx.Request) -> httpx.Response:
        doc = json.loads(request.content)
        prefill = doc.get("kv_transfer_params", {}).get("do_remote_decode")
        why = _vllm_refuses(doc)
        if why is not None:
            return httpx.Response(400, json={"error": {"message": why}})
        if prefill:
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        seen["decode"] = doc
        return httpx.Response(200, json={"ok": True})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with TestClient(app) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvslots-pd"] == "disaggregated"  # the old code: recomputed (the prefill refused)
    assert seen["decode"]["min_tokens"] == body["min_tokens"]  # the decode worker keeps it


def test_prefill_body_drops_min_tokens_only_there():
    body = {"prompt": "x", "max_tokens": 9, "min_tokens": 3}
    out = prefill_body(body)
    assert "min_tokens" not in out and out["max_tokens"] == 1 and _vllm_refuses(out) is None
    assert body == {"prompt": "x", "max_tokens": 9, "min_tokens": 3}
