"""A decode worker's answer to a request without a stream past :data:`PASS_ON_AFTER` bytes is
passed on to the client as it comes, not read whole (201925f refused one past 64 MiB with a 502:
n=8 answers of 8k tokens with top_logprobs=20 are about 96 MB), and still within --timeout in all:
a worker that trickles past it has its answer cut off, which the client sees (no last chunk)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402

BIG = 2 * 2**20  # past PASS_ON_AFTER (1 MiB)


def _serve(backend, timeout_s):
    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     timeout_s=timeout_s)
    return serve_guarded(app, log_level="critical")


def _prefilled(request: httpx.Request) -> httpx.Response | None:
    if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
    return None


def test_a_big_answer_is_passed_on_as_it_comes():
    client_has_some = threading.Event()  # the client got a first part while the worker holds the rest
    seen = {}
    body = b'{"text": "' + b"a" * BIG + b'"}'
    half = len(body) - 2**19

    async def backend(request):
        if (r := _prefilled(request)) is not None:
            return r

        async def gen():
            for i in range(0, half, 65536):
                yield body[i:min(i + 65536, half)]
            for _ in range(200):  # the old code read it whole first: the client got nothing yet
                if client_has_some.is_set():
                    break
                await asyncio.sleep(0.02)
            seen["client_had_some"] = client_has_some.is_set()
            yield body[half:]

        return httpx.Response(200, content=gen(), headers={"content-type": "application/json"})

    port, server, t = _serve(backend, 30.0)
    try:
        got = bytearray()
        with httpx.Client(timeout=15) as c, c.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                                     json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status_code == 200, r.read()[:300]
            for chunk in r.iter_bytes():
                got += chunk
                if len(got) > 2**20:  # (PASS_ON_AFTER)
                    client_has_some.set()
    finally:
        server.should_exit = True
        t.join(10)
    assert seen == {"client_had_some": True}
    assert bytes(got) == body
    assert r.headers["x-kvslots-pd"] == "disaggregated"


def test_a_big_answer_trickled_past_the_timeout_is_cut_off():
    closed = threading.Event()

    async def backend(request):
        if (r := _prefilled(request)) is not None:
            return r

        async def gen():
            try:
                yield b'{"text": "' + b"a" * BIG
                while True:
                    await asyncio.sleep(0.1)
                    yield b"a"
            finally:
                closed.set()

        return httpx.Response(200, content=gen(), headers={"content-type": "application/json"})

    port, server, t = _serve(backend, 1.5)
    try:
        got = bytearray()
        start = time.monotonic()
        with httpx.Client(timeout=15) as c:
            with pytest.raises(httpx.RemoteProtocolError):  # no last chunk: the client knows it is cut
                with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status_code == 200
                    for chunk in r.iter_bytes():
                        got += chunk
        took = time.monotonic() - start
    finally:
        server.should_exit = True
        t.join(10)
    assert len(got) >= BIG and took < 1.5 + 3, (len(got), took)
    assert closed.wait(2)  # the worker's answer is closed too
