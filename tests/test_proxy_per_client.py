"""``kvslots proxy``'s limit on one client's requests in flight (``--max-requests-per-client``):
one client address opening many connections held every backend connection and every other
client waited behind it, up to ``--timeout``; now its request past the limit is a 429 with
``Retry-After``, and others' requests still go through."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402
from proxy_support import started  # noqa: E402,F401 - a fixture


class _Held:
    """Workers (a MockTransport handler): prefill at once; each decode request is held until
    ``go`` is set, counted in ``held``."""

    def __init__(self) -> None:
        self.held = 0
        self.go = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        self.held += 1
        try:
            await self.go.wait()
        finally:
            self.held -= 1
        if body.get("stream"):
            async def gen():
                for _ in range(3):
                    await asyncio.sleep(0.05)
                    yield b'data: {"x": 1}\n\n'
            return httpx.Response(200, content=gen(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"ok": True})


def _run(calls, **kw):
    """``calls(held, client_of)`` against a proxy over held workers; ``client_of(address)`` is an
    httpx client whose requests come from ``address``."""

    async def main():
        held = _Held()
        app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(held), **kw)
        async with app.router.lifespan_context(app), contextlib_exit() as stack:
            def client_of(address: str) -> httpx.AsyncClient:
                t = httpx.ASGITransport(app=app, client=(address, 40000))
                return stack.push_async(httpx.AsyncClient(transport=t, base_url="http://proxy", timeout=10))
            return await calls(held, client_of)

    return asyncio.run(main())


class contextlib_exit:
    """Closes the clients made in the block."""

    def __init__(self) -> None:
        self.clients: list[httpx.AsyncClient] = []

    async def __aenter__(self):
        return self

    def push_async(self, c: httpx.AsyncClient) -> httpx.AsyncClient:
        self.clients.append(c)
        return c

    async def __aexit__(self, *exc):
        for c in self.clients:
            await c.aclose()


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_one_client_past_the_default_limit_is_429_and_others_go_through():
    # 4 backend connections: one address may hold 3 (default: a quarter is left for the others)
    async def calls(held, client_of):
        a, b = client_of("10.0.0.1"), client_of("10.0.0.2")
        first = [asyncio.ensure_future(a.post("/v1/completions", json={"prompt": "hi"})) for _ in range(3)]
        await _until(lambda: held.held == 3, "the first 3 never reached the worker")
        over = await asyncio.wait_for(a.post("/v1/chat/completions", json={"messages": []}), 5)
        other = asyncio.ensure_future(b.post("/v1/completions", json={"prompt": "hi"}))
        await _until(lambda: held.held == 4, "another client's request never reached the worker")
        held.go.set()
        return over, await asyncio.gather(*first), await other, await a.post("/v1/completions", json={"prompt": "x"})

    over, first, other, after = _run(calls, backend_connections=4)
    assert over.status_code == 429, (over.status_code, over.text)  # the old code: held with the rest
    assert over.headers["retry-after"] == "1" and "--max-requests-per-client" in over.json()["error"]
    assert [r.status_code for r in first] == [200] * 3 and other.status_code == 200
    assert after.status_code == 200  # its requests done, the client has its places back


def test_a_stream_holds_its_place_until_it_ends():
    during_answered = threading.Event()  # the stream's tokens come once the request during it is answered

    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

        async def gen():
            for _ in range(500):
                if during_answered.is_set():
                    break
                await asyncio.sleep(0.01)
            for _ in range(3):
                yield b'data: {"x": 1}\n\n'
        return httpx.Response(200, content=gen(), headers={"content-type": "text/event-stream"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend),
                     max_requests_per_client=1)
    port, server, t = serve_guarded(app)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as a, httpx.Client(
                base_url=f"http://127.0.0.1:{port}", timeout=10) as a2:
            with a.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as s:
                assert s.status_code == 200
                during = a2.post("/v1/completions", json={"prompt": "hi"})  # another connection
                during_answered.set()
                body = s.read()
            # the place is given back as the app returns, just after the last byte was sent
            for _ in range(100):
                after = a2.post("/v1/completions", json={"prompt": "hi", "stream": True})
                if after.status_code != 429:
                    break
                time.sleep(0.02)
    finally:
        server.should_exit = True
        t.join(10)
    assert during.status_code == 429 and body.count(b"data:") == 3
    assert after.status_code == 200 and after.text.count("data:") == 3


def test_zero_is_no_limit():
    async def calls(held, client_of):
        a = client_of("10.0.0.1")
        many = [asyncio.ensure_future(a.post("/v1/completions", json={"prompt": "hi"})) for _ in range(6)]
        await _until(lambda: held.held == 6, "not all 6 reached the worker")
        held.go.set()
        return await asyncio.gather(*many)

    assert [r.status_code for r in _run(calls, backend_connections=2, max_requests_per_client=0)] == [200] * 6


@pytest.mark.parametrize("value", [-1, True, 1.5, "8", None.__class__, 2**16 + 1, 2**70])
def test_create_app_max_requests_per_client_out_of_range(value):
    with pytest.raises(InvalidArgumentError, match="max_requests_per_client"):
        create_app(["http://p"], [DecodeWorker("http://d")], max_requests_per_client=value)


def test_the_default_leaves_a_quarter_to_others():
    from kvslots.proxy.cli import default_requests_per_client

    assert [default_requests_per_client(n) for n in (1, 2, 4, 1024)] == [1, 2, 3, 768]


def _cli(capsys, argv):
    capsys.readouterr()
    code = cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, want", [(["--max-requests-per-client", "5"], 5),
                                        (["--max-requests-per-client", "0"], 0),
                                        (["--backend-connections", "100"], 75)])
def test_the_command_passes_the_limit(capsys, started, argv, want):
    code, out, err = _cli(capsys, argv)
    assert code == 0, err
    assert started["app"]["max_requests_per_client"] == want


@pytest.mark.parametrize("value", ["-1", str(2**16 + 1)])
def test_a_refused_limit_is_one_line_exit_2(capsys, started, value):
    code, out, err = _cli(capsys, ["--max-requests-per-client", value])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--max-requests-per-client {value} must be an integer in 0..65536" in err, err
    assert "http" not in started
