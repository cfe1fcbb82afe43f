"""``kvslots proxy`` (the command, its logging set-up) flooded its log: httpx logged a line (INFO)
for each backend answer, 2-3 lines a request in normal operation, and uvicorn logged "ASGI
callable returned without completing response." (ERROR) for each stream a worker broke off and
"Invalid HTTP request received." for each malformed request, none of them limited. Now httpx
logs warnings only and uvicorn's lines go through the proxy's RateLimitedLog. The command runs
in a child process; every line of its stderr is counted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvslots  # noqa: E402
from kvslots import _ratelog  # noqa: E402
from ports import free_port  # noqa: E402
from process_support import serve_guarded  # noqa: E402

N = 25


async def _worker(scope, receive, send):
    """/score: 500; the prefill leg: its kv_transfer_params; the decode leg: a stream broken off
    (one chunk, then the app returns: uvicorn closes the connection without the last chunk)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/score":
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"down"})
        return
    prefill = json.loads(body).get("kv_transfer_params", {}).get("do_remote_decode")
    if prefill:
        out = json.dumps({"kv_transfer_params": {"do_remote_prefill": True}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b'data: {"a": 1}\n\n', "more_body": True})


def test_the_commands_log_is_bounded(tmp_path):
    wport, wserver, wt = serve_guarded(_worker, log_level="critical")
    port = free_port()
    w = f"http://127.0.0.1:{wport}"
    err = tmp_path / "err"
    # the child imports the kvslots this test does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(kvslots.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("KVSLOTS_BACKEND_API_KEY", None)
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvslots", "proxy", "--prefill", w, "--decode", f"{w}=w",
                                 "--indexer", w, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=f, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
        with httpx.Client(base_url=base, timeout=10) as c:
            for _ in range(N):
                with pytest.raises(httpx.RemoteProtocolError):  # the stream is left unfinished
                    with c.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "stream": True}) as r:
                        for _ in r.iter_bytes():
                            pass
            for _ in range(N):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n")
                    while s.recv(65536):
                        pass
            health = c.get("/healthz").json()
        assert health["decode_errors"] == N
    finally:
        proc.terminate()
        proc.wait(30)
        wserver.should_exit = True
        wt.join(10)
    lines = err.read_text().splitlines()
    burst = _ratelog.BURST
    print(f"{len(lines)} lines of stderr for {N} broken-off streams and {N} malformed requests")

    def count(text: str) -> int:
        return sum(text in line for line in lines)

    assert count("httpx") == 0, lines  # the old code: 3 a request (prefill, /score, decode)
    assert 1 <= count("ASGI callable returned without completing response") <= burst, lines  # old: N
    assert 1 <= count("Invalid HTTP request received") <= burst, lines  # old: N
    assert count("broke off the stream") <= burst and count("indexer") <= burst
    assert len(lines) <= 4 * burst + 8, lines  # the old code: over 5 * N
