"""A decode worker that breaks off a stream (a reset, fewer bytes than its Content-Length, a bad
chunk) leaves the proxy's stream unfinished (no last chunk), as a passed-on answer is: the proxy
ended it, so the client got a 200 whose stream looked whole, the answer silently cut short.
Through uvicorn (a real socket): the unfinished stream is uvicorn's closing the connection."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from process_support import serve_guarded  # noqa: E402


class _Broken(httpx.AsyncByteStream):
    def __init__(self, error: Exception):
        self.error = error

    async def __aiter__(self):
        yield b'data: {"a": 1}\n\n'
        raise self.error


@pytest.mark.parametrize("error", [httpx.ReadError("connection reset"),
                                   httpx.RemoteProtocolError("peer closed connection without sending complete "
                                                             "message body: received 7 bytes, expected 100")])
def test_a_stream_broken_off_by_the_decode_worker_is_left_unfinished(error):
    def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Broken(error))

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    port, server, t = serve_guarded(app, log_level="critical")
    try:
        got = bytearray()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            with pytest.raises(httpx.RemoteProtocolError):  # the old code: a whole stream
                with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                    assert r.status_code == 200
                    for chunk in r.iter_bytes():
                        got += chunk
            assert bytes(got) == b'data: {"a": 1}\n\n'
            assert c.get("/healthz").json()["decode_errors"] == 1
    finally:
        server.should_exit = True
        t.join(10)
