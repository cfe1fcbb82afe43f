"""A decode worker's 429 or 503 with ``Retry-After`` keeps it in the proxy's answer (the 429 passed
on, the 503 as the proxy's 502): it was dropped, so clients retried at once into a worker asking
them to wait. The value is checked (delay-seconds, at most a day, or an HTTP-date) and written
anew: a hostile one is left out, never echoed."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402


def _client(status: int, retry_after: list[bytes]) -> TestClient:
    def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(status, json={"error": "busy"},
                              headers=[(b"retry-after", v) for v in retry_after])

    return TestClient(create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend)))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status,proxied", [(429, 429), (503, 502)])
def test_the_workers_retry_after_is_passed_on(stream, status, proxied):
    with _client(status, [b"7"]) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    assert r.status_code == proxied
    assert r.headers.get("retry-after") == "7"


@pytest.mark.parametrize("sent,passed", [
    (b"Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2015 07:28:00 GMT"),
    (b"Wed, 21 Oct 2015 09:28:00 +0200", "Wed, 21 Oct 2015 07:28:00 GMT"),  # written anew, in GMT
    (b"007", "7"),
    (b"9" * 40, "86400"),  # at most a day
    (b"-1", None), (b"1.5", None), (b"5, 6", None), (b"soon", None), (b"\xff\xfe", None),
    (b"1\x0b", None), (b"Mon, 01 Jan 9999 23:59:59 -1200", "Sat, 02 Jan 9999 11:59:59 GMT"),
    (b"Fri, 31 Dec 9999 23:59:59 -1200", None), (b"<script>" * 100, None),
])
def test_a_retry_after_is_checked_and_written_anew(sent, passed):
    with _client(429, [sent]) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 429 and r.json() == {"error": "busy"}
    assert r.headers.get("retry-after") == passed


def test_two_retry_afters_are_none():
    with _client(429, [b"1", b"2"]) as c:
        r = c.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 429 and "retry-after" not in r.headers
