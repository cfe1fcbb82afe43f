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


def _client(status: int, retry_after: list[bytes], date: list[bytes] = ()) -> TestClient:
    def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(status, json={"error": "busy"},
                              headers=[*((b"retry-after", v) for v in retry_after), *((b"date", v) for v in date)])

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
    (b"Sunday, 06-Nov-94 08:49:37 GMT", "0"), (b"Sun Nov  6 08:49:37 1994", "0"),  # RFC 850, asctime
    (b"Thu, 31 Dec 2099 23:59:60 GMT", "86400"),  # a leap second
    # RFC 9110's three forms only (email.utils took these): a zone but GMT, a two-digit year in
    # the IMF form, no day name, an unknown zone, a day out of its month
    (b"Wed, 21 Oct 2015 09:28:00 +0200", None), (b"1 Jan 2030 00:00", None), (b"Wed, 21 Oct 15 07:28:00 GMT", None),
    (b"21 Oct 2015 07:28:00 XYZ", None), (b"Wed, 21 Oct 2015 07:28:00 UTC", None),
    (b"Fri, 31 Feb 2030 00:00:00 GMT", None),
    (b"Wed,  21 Oct 2015 07:28:00 GMT", None), (b"Wed, 21 Oct 2015 7:28:00 GMT", None),
    (b"007", "7"),
    (b"9" * 40, "86400"),  # at most a day
    (b"-1", None), (b"1.5", None), (b"5, 6", None), (b"soon", None), (b"\xff\xfe", None),
    (b"1\x0b", None),
    (b"Fri, 31 Dec 9999 23:59:59 GMT", "86400"),  # a date at most a day away too (was passed on as it was)
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


@pytest.mark.parametrize("skew", [-60, 0, 600])
def test_a_date_is_measured_from_the_workers_own_date(skew):
    """A worker whose clock is 60 s slow asking for 30 s (its Date + 30 s) was passed on as 0
    (clients retried at once), one 10 min fast as 630: measured on the proxy's clock."""
    import email.utils
    import time

    worker_now = time.time() + skew
    sent = email.utils.formatdate(worker_now + 30, usegmt=True).encode()
    with _client(503, [sent], [email.utils.formatdate(worker_now, usegmt=True).encode()]) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and r.headers["retry-after"] == "30"


@pytest.mark.parametrize("date", [[b"soon"], [b"Wed, 21 Oct 2015 07:28:00 +0000"],
                                  [b"Wed, 21 Oct 2015 07:28:00 GMT", b"Wed, 21 Oct 2015 07:28:00 GMT"]])
def test_without_one_valid_date_the_proxys_clock(date):
    import email.utils
    import time

    sent = email.utils.formatdate(time.time() + 100, usegmt=True).encode()
    with _client(429, [sent], date) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 429 and 70 <= int(r.headers["retry-after"]) <= 101


def test_a_two_digit_year_is_the_latest_not_more_than_50_years_ahead():
    from datetime import datetime, timezone

    from kvslots.proxy.app import _http_date

    now = datetime(2026, 6, 1, tzinfo=timezone.utc)
    assert _http_date("Sunday, 06-Nov-94 08:49:37 GMT", now).year == 1994
    assert _http_date("Monday, 06-Nov-76 08:49:37 GMT", now).year == 2076
    assert _http_date("Tuesday, 06-Nov-77 08:49:37 GMT", now).year == 1977
