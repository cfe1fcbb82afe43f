"""A decode worker's Content-Type is passed on only when it is printable ASCII: one past Latin-1
(httpx decodes a header as UTF-8 when it can) failed Starlette's encoding of it, so the client got
a 500 in plain text instead of the worker's answer (its 200, its 400)."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402


def _answer(status: int, content_type: list[bytes], stream: bool) -> httpx.Response:
    def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(status, content=b'{"x":1}', headers=[(b"content-type", v) for v in content_type])

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with TestClient(app, raise_server_exceptions=False) as c:
        return c.post("/v1/completions", json={"prompt": "hi", "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [200, 400])
@pytest.mark.parametrize("sent", [["text/plain; x=中".encode()], [b"a\xff"], [b""], [b"a/b", b"c/d"], [b"x" * 300]])
def test_a_content_type_that_is_not_printable_ascii_is_the_default(status, stream, sent):
    r = _answer(status, sent, stream)
    assert r.status_code == status and r.content == b'{"x":1}'
    if status == 200 and not stream:
        assert r.headers["content-type"] == "application/json"  # (always)
    else:
        # (Starlette adds "; charset=utf-8" to a text/ type)
        assert r.headers["content-type"].startswith("text/event-stream" if status == 200 else "application/json")


@pytest.mark.parametrize("stream", [False, True])
def test_a_plain_content_type_is_passed_on(stream):
    r = _answer(400, [b"application/problem+json; charset=utf-8"], stream)
    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json; charset=utf-8"
