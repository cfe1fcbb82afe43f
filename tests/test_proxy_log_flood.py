"""A failing backend logged a line for every request it failed (a dead prefill worker under 1,000
requests a second wrote 1,000 lines a second), and clients going mid-request a line each. Now each
backend (and the clients) has at most ``_ratelog.BURST`` lines a period per kind, the rest
counted (:class:`kvslots._ratelog.RateLimitedLog`)."""

from __future__ import annotations

import logging

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots import _ratelog  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402

N = 60


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_dead_backend_logs_a_burst_not_a_line_per_request(caplog):
    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p"):
            raise httpx.ConnectError("connection refused")
        if request.url.host == "i":
            return httpx.Response(500)
        return httpx.Response(503, text="down\nkvslots proxy: a forged line")

    app = create_app(["http://p1", "http://p2"], [DecodeWorker("http://d", "w")], indexer_url="http://i",
                     transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        statuses = {c.post("/v1/completions", json={"prompt": [1, 2]}).status_code for _ in range(N)}
    assert statuses == {502}
    burst = _ratelog.BURST
    for worker in ("http://p1", "http://p2"):  # one burst for each backend
        assert len(_lines(caplog, f"prefill worker {worker} failed")) == burst
    assert len(_lines(caplog, "indexer http://i unusable")) == burst
    decode = _lines(caplog, "decode worker http://d")
    assert len(decode) == burst and "further such messages" in decode[-1]
    assert all("\n" not in line for line in decode)  # the worker's text on the line it is logged in
    assert len(caplog.records) == 4 * burst


def _prefill(request: httpx.Request) -> bool:
    import json

    return bool(json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"))


def test_a_prefill_workers_4xx_does_not_hide_its_5xx(caplog):
    """Keyed (url, "refused"), clients' bad requests (a 4xx each) used the prefill worker's burst:
    its 500s that followed were never logged."""
    failing = []

    def backend(request: httpx.Request) -> httpx.Response:
        if _prefill(request):
            return httpx.Response(500 if failing else 400, json={"error": "x"})
        return httpx.Response(400 if not failing else 200, json={"ok": 1})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        for _ in range(2 * _ratelog.BURST):
            assert c.post("/v1/completions", json={"prompt": "bad"}).status_code == 400
        failing.append(1)
        for _ in range(5):
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert len(_lines(caplog, "prefill worker http://p answered 500")) == 5  # the old code: 0
    # a 4xx may be the prefill worker's setting: logged too, rate-limited apart from the 5xx
    assert len(_lines(caplog, "prefill worker http://p answered 400")) == _ratelog.BURST


def test_one_url_as_prefill_and_decode_worker_has_an_allowance_for_each(caplog):
    def backend(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")  # a "failed" line for each role

    app = create_app(["http://x"], [DecodeWorker("http://x")], transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        for _ in range(N):
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 502
    burst = _ratelog.BURST
    assert len(_lines(caplog, "prefill worker http://x")) == burst  # the old code: burst / 2 each
    assert len(_lines(caplog, "decode worker http://x")) == burst


def test_prefill_and_indexer_failures_are_counted_in_healthz():
    """What the rate-limited log leaves out was reported only when the same kind failed again
    later; /healthz now counts every prefill failure, by kind, and the indexer's."""
    answers = iter([httpx.ConnectError("refused")] * 3 + [httpx.Response(500)] * 2 + [httpx.Response(404)]
                   + [httpx.Response(204)] + [httpx.Response(200, text="[]")] + [httpx.Response(401)])

    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.host == "i":
            return httpx.Response(500)
        if _prefill(request):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return httpx.Response(200, json={"ok": 1})

    app = create_app(["http://p"], [DecodeWorker("http://d", "w")], indexer_url="http://i",
                     transport=httpx.MockTransport(backend))
    with TestClient(app) as c:
        statuses = [c.post("/v1/completions", json={"prompt": [1, 2]}).status_code for _ in range(9)]
        health = c.get("/healthz").json()
    assert statuses == [200] * 8 + [401]
    assert health["prefill_errors"] == {"no_answer": 3, "4xx": 2, "5xx": 2, "other_status": 1, "no_object": 1}
    assert health["indexer_errors"] == {"no_answer": 0, "status": 8, "no_object": 0, "no_workers": 0, "bad_score": 0,
                                        "unknown_worker": 0}
    assert health["recomputed"] == 8


def test_every_unusable_indexer_answer_is_counted_by_kind(caplog):
    """An answer whose workers or scores could not be used was round robin uncounted (4 such: 1
    counted, the one that was no JSON object); an answer whose scores are all read, none above 0
    (nothing cached), is round robin and no error."""
    answers = iter([httpx.ConnectError("refused"), httpx.Response(503), httpx.Response(200, text="[1]"),
                    httpx.Response(200, text='{"workers": "junk"}'), httpx.Response(200, text='{"nope": 1}'),
                    httpx.Response(200, text='{"workers": {"w": {"score": "high"}, "v": {"score": 0}}}'),
                    httpx.Response(200, text='{"workers": {"w": {"score": null}, "v": {"score": 0}}}'),
                    httpx.Response(200, text='{"workers": {"w": {"score": 0}}}'),
                    httpx.Response(200, text='{"workers": {"w": {"score": 0}, "v": {"score": 0.0}}}'),
                    httpx.Response(200, text='{"workers": {"w": {"score": 0}, "v": {"score": 2}}}')])

    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.host == "i":
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer
        if _prefill(request):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, json={"by": request.url.host})

    app = create_app(["http://p"], [DecodeWorker("http://d1", "w"), DecodeWorker("http://d2", "v")],
                     indexer_url="http://i", transport=httpx.MockTransport(backend))
    with caplog.at_level(logging.INFO, logger="kvslots.proxy"), TestClient(app) as c:
        by = [c.post("/v1/completions", json={"prompt": [1, 2]}).json()["by"] for _ in range(10)]
        health = c.get("/healthz").json()
    assert by[-1] == "d2"  # the one score above 0
    # the old code: an int, 3 (no answer, the 503, no object)
    assert health["indexer_errors"] == {"no_answer": 1, "status": 1, "no_object": 1, "no_workers": 2,
                                        "bad_score": 2, "unknown_worker": 1}
    assert len(_lines(caplog, "indexer http://i")) == 8
    assert len(_lines(caplog, "does not name worker 'v'")) == 1
