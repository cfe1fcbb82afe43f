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
    (b"Wed, 21 Oct 2015 07:28:00 GMT", "0"),  # a date: the seconds from now to it, 0 when past
    (b"Wed, 21 Oct 2015 09:28:00 +0200", "0"),
    (b"007", "7"),
    (b"9" * 40, "86400"),  # at most a day
    (b"-1", None), (b"1.5", None), (b"5, 6", None), (b"soon", None), (b"\xff\xfe", None),
    (b"1\x0b", None),
    (b"Mon, 01 Jan 9999 23:59:59 -1200", "86400"),  # a date at most a day away too (was passed on as it was)
    (b"Fri, 01 Jan 2100 00:00:00 GMT", "86400"),
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


@pytest.mark.parametrize("ahead", [100, 3600])
def test_a_date_is_the_seconds_from_now_to_it(ahead):
    import email.utils
    import time

    sent = email.utils.formatdate(time.time() + ahead, usegmt=True).encode()
    with _client(503, [sent]) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and ahead - 30 <= int(r.headers["retry-after"]) <= ahead + 1
