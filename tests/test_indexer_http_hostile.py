"""The indexer's HTTP API under hostile input: every bad request is a 4xx with a JSON error body,
never a 500, and changes nothing (the index and the worker list stay as they were)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.indexer import IndexerConfig, IndexerService  # noqa: E402
from kvslots.indexer.app import create_app  # noqa: E402

BS = 4
TOKEN = "s3cret-s3cret-s3cret"  # the admin token rule: 16 or more printable ASCII characters


@pytest.fixture(scope="module")
def client():
    svc = IndexerService(IndexerConfig(block_size=BS, admin_token=TOKEN))
    app = create_app(svc)
    app.state.service = svc
    return TestClient(app, raise_server_exceptions=False)


def post_score(client, body: bytes):
    return client.post("/score", content=body, headers={"content-type": "application/json"})


BAD_SCORE_BODIES = {
    "NaN token": b'{"token_ids":[NaN]}',
    "Infinity token": b'{"token_ids":[Infinity]}',
    "-Infinity lora": b'{"token_ids":[1],"lora_id":-Infinity}',
    "1e400": b'{"token_ids":[1e400]}',
    "lone surrogate value": b'{"token_ids":[1],"lora_name":"\\ud800"}',
    "lone surrogate key": b'{"\\ud800":1}',
    "string token": b'{"token_ids":["1"]}',
    "bool token": b'{"token_ids":[true]}',
    "float token": b'{"token_ids":[2.0]}',
    "negative token": b'{"token_ids":[-1]}',
    "token over u32": b'{"token_ids":[4294967296]}',
    "token over u64": b'{"token_ids":[18446744073709551616]}',
    "string block_size": b'{"token_ids":[1],"block_size":"4"}',
    "zero block_size": b'{"token_ids":[1],"block_size":0}',
    "bool lora_id": b'{"token_ids":[1],"lora_id":false}',
    "duplicate key": b'{"token_ids":[1],"token_ids":[2]}',
    "deep nesting": b"[" * 100_000,
    "deep nesting in a field": b'{"token_ids":' + b"[" * 5000 + b"]" * 5000 + b"}",
    "bad UTF-8": b'{"token_ids":[1],"lora_name":"\xff"}',
    "not JSON": b"hello",
    "empty": b"",
    "array": b"[1,2]",
    "null": b"null",
    "unknown key": b'{"token_ids":[1],"x":1}',
}


@pytest.mark.parametrize("body", BAD_SCORE_BODIES.values(), ids=BAD_SCORE_BODIES.keys())
def test_bad_score_request_is_a_4xx_with_a_json_error(client, body):
    r = post_score(client, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert detail  # says what was wrong
    if isinstance(detail, list):  # never echoes the input back
        assert all(set(d) == {"type", "loc", "msg"} for d in detail)


def test_good_score_request_still_works(client):
    r = post_score(client, b'{"token_ids":[1,2,3,4,5],"block_size":4,"lora_id":7}')
    assert r.status_code == 200
    assert r.json()["prompt_blocks"] == 1


def test_error_names_the_field(client):
    r = post_score(client, b'{"token_ids":[1,"2"]}')
    assert r.json()["detail"][0]["loc"] == ["body", "token_ids", 1]
    r = post_score(client, b'{"token_ids":[1],"token_ids":[2]}')
    assert "duplicate key 'token_ids'" in r.json()["detail"][0]["msg"]


BAD_WORKERS = [
    b'{"name":"\\ud800","endpoint":"tcp://127.0.0.1:1"}',
    b'{"name":"w","endpoint":"tcp://127.0.0.1:1","topic":"\\udfff"}',
    b'{"name":1,"endpoint":"tcp://127.0.0.1:1"}',
    b'{"name":"w","endpoint":NaN}',
    b'{"name":"w","endpoint":"http://x"}',
    b'{"name":"w","endpoint":"tcp://127.0.0.1:1","tier":"DISK"}',
    b'{"name":"w","name":"v","endpoint":"tcp://127.0.0.1:1"}',
]

#: Addresses ZMQ refuses to connect to, or accepts and never reaches: refused up front.
BAD_ENDPOINTS = [
    "tcp://127.0.0.1", "tcp://127.0.0.1:", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:99999",
    "tcp://:::", "tcp://a:b", "tcp://:5557", "tcp://*:5557", "tcp://[::1", "tcp://[::]:5557", "tcp://[zz]:1",
    "tcp://999.0.0.1:1", "tcp://h st:1", "tcp://h:1 ", "tcp://h\u0000:1", "tcp://h:\u00b2", "tcp://h:-1",
    "ipc://", "ipc://*", "ipc://" + "a" * 400, "ipc:///tmp/\u0001", "inproc://", "pgm://h:1", "tcp:/h:1", "",
]


def _post_worker(client, body: bytes):
    return client.post("/workers", content=body,
                       headers={"content-type": "application/json", "authorization": f"Bearer {TOKEN}"})


def _state(client) -> tuple:
    svc = client.app.state.service
    return (client.get("/workers").json(), sorted(svc.backend.index.workers()), sorted(svc._subscribed),
            sorted(svc.sub.status()))


@pytest.mark.parametrize("body", BAD_WORKERS)
def test_bad_worker_is_a_4xx_and_adds_nothing(client, body):
    before = _state(client)
    r = _post_worker(client, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert _state(client) == before


@pytest.mark.parametrize("field", ["endpoint", "replay"])
@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_bad_endpoint_is_a_422_naming_it_and_adds_nothing(client, field, endpoint):
    before = _state(client)
    body = {"name": "w", "endpoint": "tcp://127.0.0.1:1", field: endpoint}
    r = _post_worker(client, json.dumps(body).encode())
    assert r.status_code == 422, (r.status_code, r.text)
    detail = r.json()["detail"]
    if isinstance(detail, str):  # ours (pydantic's list says the same for the empty string)
        assert detail.startswith(f"worker 'w': {field} ") and "\n" not in detail, detail
    assert _state(client) == before


@pytest.mark.parametrize("body, msg", [
    ({"token_ids": ["a"] * 100_000}, "100000 items are not integers in [0, 2**32), the first at index 0"),
    ({"token_ids": [1, 2] + [-1] * 100_000}, "100000 items are not integers in [0, 2**32), the first at index 2"),
    ({"token_ids": [1] + [True] * 21}, "21 items are not integers in [0, 2**32), the first at index 1"),
    ({"token_ids": [1], **{f"x{i}": 1 for i in range(100_000)}}, "100000 unknown fields"),
])
def test_many_bad_items_are_one_error_that_counts_them(client, body, msg):
    """An error each (100,000 bad token ids: 9 MB of 422 and seconds of work; 262,144 took 15 s to
    refuse where a good request of that size took 1 s): past 20, one error that counts them."""
    import time

    t0 = time.monotonic()
    r = post_score(client, json.dumps(body).encode())
    assert r.status_code == 422 and r.json()["detail"] == [
        {"type": "too_many_errors", "loc": ["body", "token_ids"] if "token_ids" in msg or "items" in msg else ["body"],
         "msg": msg}], r.text[:500]
    assert time.monotonic() - t0 < 5 and len(r.content) < 1000


def test_a_few_bad_items_are_an_error_each_and_at_most_20_are_listed(client):
    r = post_score(client, json.dumps({"token_ids": [1, "x", -1], "a": 1}).encode())
    assert r.status_code == 422 and [d["loc"] for d in r.json()["detail"]] == [
        ["body", "token_ids", 1], ["body", "token_ids", 2], ["body", "a"]], r.text
    r = post_score(client, json.dumps({"token_ids": [1] + ["x"] * 20, "a": 1, "b": 2}).encode())
    detail = r.json()["detail"]
    assert r.status_code == 422 and len(detail) == 21, r.text
    assert detail[19]["loc"] == ["body", "token_ids", 20] and detail[20]["msg"] == "2 more errors not listed"


def test_a_burst_of_slow_admin_requests_does_not_hold_up_score():
    """Adding a worker waits for its catch-up replay. Run in the default thread pool (40
    threads), a burst of adds took every thread and /score waited behind them (45 adds of a
    worker whose replay endpoint does not answer: /score answered after 88 s)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    svc = IndexerService(IndexerConfig(block_size=BS, admin_token=TOKEN))
    release, entered = threading.Event(), []

    def slow_add(spec):  # as an add waiting for a replay that does not come
        entered.append(spec.name)
        release.wait(30)
        return True

    svc.add_worker = slow_add
    auth = {"authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(svc)) as c, ThreadPoolExecutor(50) as pool:
        try:
            adds = [pool.submit(c.post, "/workers", json={"name": f"w{i}", "endpoint": "tcp://127.0.0.1:1"},
                                headers=auth) for i in range(45)]
            deadline = time.monotonic() + 10
            while len(entered) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)  # the rest are under way
            score = pool.submit(c.post, "/score", json={"token_ids": [1, 2, 3, 4]})
            assert score.result(timeout=5).status_code == 200
            assert c.get("/healthz").status_code == 200
        finally:
            release.set()
        assert [a.result(timeout=30).status_code for a in adds] == [201] * 45


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "application/json5"])
def test_a_body_not_sent_as_json_is_a_422_that_says_so(client, ctype):
    # curl -d sends a form: the 422 read "Input should be a valid dictionary or object to extract
    # fields from", nothing of the content type.
    headers = {} if ctype is None else {"content-type": ctype}
    r = client.post("/score", content=b'{"token_ids":[1,2,3,4]}', headers=headers)
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["detail"][0]["msg"], r.text
    for ok in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        assert client.post("/score", content=b'{"token_ids":[1]}', headers={"content-type": ok}).status_code == 200
    r = post_score(client, b"[1]")  # JSON that is not an object: pydantic's words
    assert r.status_code == 422 and "Content-Type" not in r.text


def test_delete_of_a_long_unknown_name_does_not_echo_it(client):
    # The 404 echoed the whole path segment (up to the 64 KiB head limit).
    r = client.delete("/workers/" + "a" * 60_000, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and len(r.json()["detail"]) < 100 and r.json()["detail"].startswith("no worker 'aaa")
    r = client.delete("/workers/nobody", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.json()["detail"] == "no worker 'nobody'"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["token_ids", "lora_id", "lora_name", "block_size", "x"]), json_values,
                       max_size=4))
def test_random_score_bodies_never_500(client, obj):
    body = json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")
    r = post_score(client, body)
    assert r.status_code < 500, (r.status_code, r.text, body[:200])
    if r.status_code == 200:  # only a well-formed request is answered
        assert all(type(t) is int and 0 <= t < 2**32 for t in obj["token_ids"])


# ---- connection limits (kvslots.indexer.httpguard), on a real uvicorn server ----


def _serve(**options):
    """The indexer app on uvicorn with the guarded protocol the command uses (``options`` for
    uvicorn_options); yields a function that opens a connection to it."""
    import socket

    from process_support import serve_guarded

    svc = IndexerService(IndexerConfig(block_size=BS))
    port, server, t = serve_guarded(create_app(svc), **options)

    def connect() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(10)
        return s

    yield connect
    server.should_exit = True
    t.join(10)


@pytest.fixture
def guarded_server(monkeypatch):
    """The server of :func:`_serve`, with a 1.5 s read timeout so the tests are quick."""
    from kvslots.indexer import httpguard

    monkeypatch.setattr(httpguard, "READ_TIMEOUT_S", 1.5)
    yield from _serve()


def _read_all(s) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def test_huge_header_is_a_431_not_read_into_memory(guarded_server):
    from kvslots.indexer.httpguard import MAX_HEAD_BYTES

    s = guarded_server()
    sent = 0
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: ")
    try:  # uvicorn read a 300 MB header whole (700 MB of memory); now it stops past 64 KiB
        while sent < 50 * MAX_HEAD_BYTES:
            s.sendall(b"a" * 65536)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _read_all(s)
    assert sent < 50 * MAX_HEAD_BYTES or answer.startswith(b"HTTP/1.1 431")
    # Many headers, each small, count too; an ordinary request with a body still works.
    s = guarded_server()
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(20000)) + b"\r\n")
    assert _read_all(s).startswith(b"HTTP/1.1 431")
    s = guarded_server()
    body = json.dumps({"token_ids": list(range(50_000))}).encode()  # head and body in one write
    s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert _read_all(s).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("partial", [b"", b"POST /score HTTP/1.1\r\nHost: x\r\n",
                                     b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"])
def test_partial_request_times_out(guarded_server, partial):
    """Nothing, a head without its end, a body short of its length: the connection was held
    open for ever (slowloris); now a 408 (or a close, once the body started) after the timeout."""
    import time

    s = guarded_server()
    s.sendall(partial)
    t0 = time.monotonic()
    answer = _read_all(s)
    assert time.monotonic() - t0 < 6
    if b"Content-Length" not in partial:
        assert answer.startswith(b"HTTP/1.1 408")


def test_slow_but_steady_request_is_cut_and_keep_alive_requests_are_not(guarded_server):
    import time

    s = guarded_server()  # a byte every 0.2 s never completes the head: cut at the timeout
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for b in b"POST /score HTTP/1.1\r\nHost: x\r\n" + b"X" * 1000:
            s.sendall(bytes([b]))
            time.sleep(0.2)
            assert time.monotonic() - t0 < 8
    import http.client

    s = guarded_server()  # requests on one keep-alive connection, each quick, for longer than the timeout
    port = s.getpeername()[1]
    s.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(4):
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["ok"]
        time.sleep(0.6)
    conn.close()


H = b"Host: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
SCORE = b'{"token_ids":[1,2,3,4]}'

#: Requests uvicorn's parser refuses before the app sees them: its 400 was text/plain.
UNPARSABLE = {
    "two Content-Lengths": b"POST /score HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nContent-Length: 23\r\n\r\n" + SCORE,
    "negative Content-Length": b"POST /score HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n" + SCORE,
    "Content-Length past 64 bits": b"POST /score HTTP/1.1\r\n" + H + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n",
    "chunk size past 64 bits": b"POST /score HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 18 + b"\r\n",
    "bad chunk size": b"POST /score HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "chunked and Content-Length": b"POST /score HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
    "Transfer-Encoding gzip": b"POST /score HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n\r\n" + SCORE,
    "raw non-ASCII path": b"DELETE /workers/\xff HTTP/1.1\r\n" + H + b"\r\n",
    "NUL in the method": b"G\x00T /healthz HTTP/1.1\r\n" + H + b"\r\n",
    "HTTP/9.9": b"GET /healthz HTTP/9.9\r\n" + H + b"\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "header without a colon": b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
    "folded header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", UNPARSABLE.values(), ids=UNPARSABLE.keys())
def test_unparsable_request_is_a_json_400(guarded_server, request_bytes):
    s = guarded_server()
    s.sendall(request_bytes)
    answer = _read_all(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"content-type: application/json" in head.lower(), answer[:300]
    assert json.loads(body)["detail"], body


def test_websocket_upgrade_is_an_ordinary_request(guarded_server):
    # No route is a WebSocket: the upgrade was refused with a 403 and an empty body.
    s = guarded_server()
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    head, _, body = _read_all(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body.split(b"HTTP/1.1")[0])["ok"]


@pytest.mark.parametrize("command", ["indexer", "proxy"])
def test_commands_serve_with_the_guard_and_no_websockets(monkeypatch, command):
    import uvicorn

    from kvslots import cli
    from kvslots.indexer import cli as indexer_cli

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(indexer_cli, "check_listen", lambda host, port: None)
    argv = ["indexer"] if command == "indexer" else ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert cli.main(argv) == 0
    assert seen["ws"] == "none" and seen["http"].__name__.startswith("Guarded"), seen
    # a cap, by default from the descriptor limit (the indexer's follows its workers: fds.ConnectionCap)
    cap = lambda: getattr(seen["http"].max_connections, "value", seen["http"].max_connections)  # noqa: E731
    assert cap() >= 16, seen
    assert cli.main(argv + ["--max-connections", "7"]) == 0
    assert cap() == 7


def _get(s, path: bytes = b"/healthz") -> bytes:
    """One keep-alive request on ``s``: the response's head and body (Content-Length)."""
    s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _wait_for_a_place(connect, timeout: float, every: float, why: str) -> None:
    """Until a new connection is served (a 200, not the 503 past the cap)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = connect()
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        if _read_all(s).startswith(b"HTTP/1.1 200"):
            return
        assert time.monotonic() < deadline, why
        time.sleep(every)


@pytest.fixture
def capped_server():
    yield from _serve(max_connections=3)


@pytest.mark.parametrize("sends", [False, True])
def test_a_connection_past_the_cap_is_a_503_at_once(capped_server, sends):
    """With no cap, idle connections held a descriptor each until the read timeout: when they
    ran out, every new connection failed. Past --max-connections one is answered a 503 and closed
    at once (whether or not it sent a request); those within it are served as before."""
    import time

    held = [capped_server() for _ in range(3)]
    assert _get(held[0]).startswith(b"HTTP/1.1 200")  # one has sent a request, two are idle
    extra = capped_server()
    if sends:
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    head, _, body = _read_all(extra).partition(b"\r\n\r\n")
    assert time.monotonic() - t0 < 5  # answered and closed, not held until the read timeout
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
    assert "3 connections open" in json.loads(body)["detail"], body
    for s in held:  # the three within the cap still work
        assert _get(s).startswith(b"HTTP/1.1 200")
    held.pop().close()  # a place is free again
    _wait_for_a_place(capped_server, 5, 0.1, "no connection was taken after one closed")


@pytest.mark.parametrize("method, path", [("POST", "/score/"), ("GET", "/workers/"), ("GET", "/healthz/"),
                                          ("DELETE", "/workers/"), ("POST", "/workers/")])
def test_a_trailing_slash_is_a_json_404_not_a_redirect(client, method, path):
    # It was a 307 with an empty body pointing at the path without the slash.
    r = client.request(method, path, content=b'{"token_ids":[1]}', follow_redirects=False,
                       headers={"content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.json()["detail"], (r.status_code, r.headers, r.text)


def _on_the_loop() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_big_body_is_parsed_off_the_event_loop(client, monkeypatch):
    # Parsed on the event loop, a 2 MB body of 200,000 keys, one repeated at the end, held every
    # other request (/healthz too) for 2.5 s; a few of them at once, for as many times that.
    from kvslots.indexer import app as app_module

    seen = []
    parse = app_module._strict_json
    monkeypatch.setattr(app_module, "_strict_json", lambda body: (seen.append((len(body), _on_the_loop())), parse(body))[1])
    big = json.dumps({"token_ids": list(range(100_000))}).encode()
    assert len(big) > app_module.OFF_LOOP_BYTES
    assert post_score(client, big).status_code == 200
    assert post_score(client, SCORE).status_code == 200  # a small one is parsed where it is
    r = post_score(client, b"{" + b",".join(b'"k%d":1' % i for i in range(50_000)) + b',"k0":2}')
    assert r.status_code == 422 and "duplicate key 'k0'" in r.text
    assert seen == [(len(big), False), (len(SCORE), True), (seen[2][0], False)], seen
    # in threads of their own (4): a burst of them does not take the threads /healthz runs in
    import anyio.to_thread

    limiters = []
    run_sync = anyio.to_thread.run_sync
    monkeypatch.setattr(anyio.to_thread, "run_sync",
                        lambda fn, *a, limiter=None, **k: (limiters.append(limiter), run_sync(fn, *a, limiter=limiter, **k))[1])
    assert post_score(client, big).status_code == 200
    assert limiters and limiters[0] is client.app.state.parse_threads and limiters[0].total_tokens == 4, limiters


@pytest.fixture
def capped_quick_server(monkeypatch):
    from kvslots.indexer import httpguard

    monkeypatch.setattr(httpguard, "READ_TIMEOUT_S", 1.5)
    yield from _serve(max_connections=3)


def test_clients_that_never_read_their_answers_do_not_hold_the_connections(capped_quick_server):
    """Requests pipelined on a connection whose client reads nothing: once the socket buffers
    filled, the server waited to write for ever, its read timeout off while an answer was under
    way. Three such clients took every place under --max-connections: every other client got a
    503, for as long as they liked. Now one that takes nothing for the read timeout is dropped."""
    import socket
    import threading
    import time

    flood = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 20000

    def send(s):
        try:
            s.sendall(flood)
        except OSError:
            pass  # dropped

    readers = []
    for _ in range(3):
        s = capped_quick_server()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        readers.append(s)
        threading.Thread(target=send, args=(s,), daemon=True).start()
    time.sleep(1)
    # A 503 while the three are held; a 200 once they are dropped.
    _wait_for_a_place(capped_quick_server, 15, 0.5, "the connections that read nothing are still held")
    for s in readers:
        s.close()

