"""A failing backend logged a line for every request it failed (a dead prefill worker under 1,000
requests a second wrote 1,000 lines a second), and clients going mid-request a line each. Now each
backend (and the clients) has at most ``_ratelog.BURST`` lines a period per kind, the rest
counted (:class:`kvslots.events._ratelog.RateLimitedLog`)."""

from __future__ import annotations

import logging

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.events import _ratelog  # noqa: E402
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
