"""`kvslots proxy` under hostile configuration and backends (what test_pd_proxy.py leaves out):
a backend URL the proxy appends paths to has no query or fragment, a decode worker's indexer name
is one the indexer can have, a decode worker's 5xx to /v1/models is a 502 (never the proxy's own
500), and a URL's credentials never reach a client."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402


@pytest.fixture
def no_server(monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("uvicorn started"))


def _cli(capsys, argv):
    capsys.readouterr()
    code = cli.main(["proxy", *argv])
    out, err = capsys.readouterr()
    return code, out, err


BAD_URLS = ["http://p:1/?x=1", "http://p:1/v?", "http://p:1#frag", "http://p:1/a#", "http://p:1/a?b#c"]


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("flag", ["--prefill", "--decode", "--indexer"])
def test_url_with_a_query_or_fragment_is_one_line_exit_2(capsys, no_server, flag, url):
    good = {"--prefill": "http://p:1", "--decode": "http://d:2"}
    argv = [x for f, u in good.items() if f != flag for x in (f, u)] + [flag, url]
    if flag == "--indexer":
        argv += ["--prefill", "http://p:1", "--decode", "http://d:2"]
    code, out, err = _cli(capsys, argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvslots proxy: error: {flag} ") and "query or fragment" in err, err


@pytest.mark.parametrize("url", BAD_URLS)
def test_create_app_refuses_a_url_with_a_query_or_fragment(url):
    for prefill, decode, indexer in ([url], [DecodeWorker("http://d")], None), \
            (["http://p"], [DecodeWorker(url)], None), (["http://p"], [DecodeWorker("http://d")], url):
        with pytest.raises(InvalidArgumentError, match="query or fragment"):
            create_app(prefill, decode, indexer_url=indexer)


def test_a_path_prefix_is_still_a_good_url():
    create_app(["http://p:1/base/"], [DecodeWorker("http://d:2/x", "w")], indexer_url="http://i:3/idx")


@pytest.mark.parametrize("name", ["bad name", "a\x01", "a=b", "-lead", "x" * 129, "a/b", "\u00e9"])
def test_decode_worker_name_the_indexer_cannot_have_is_refused(capsys, no_server, name):
    code, out, err = _cli(capsys, ["--prefill", "http://p:1", "--decode", f"http://d:2={name}"])
    assert code == 2 and out == "" and err.count("\n") == 1 and "worker name" in err, err
    with pytest.raises(InvalidArgumentError, match="worker name"):
        create_app(["http://p"], [DecodeWorker("http://d", name)])


def _client(handler, decode="http://decode-a", prefill="http://prefill"):
    app = create_app([prefill], [DecodeWorker(decode, "w")], transport=httpx.MockTransport(handler))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("status", [500, 502, 503, 599])
def test_models_5xx_from_the_decode_worker_is_a_502(status):
    c = _client(lambda r: httpx.Response(status, content=b"<html>oops</html>", headers={"content-type": "text/html"}))
    r = c.get("/v1/models")
    assert r.status_code == 502 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert f"answered {status}" in r.json()["error"]


def test_models_4xx_and_200_pass_through():
    c = _client(lambda r: httpx.Response(404, json={"error": "nope"}))
    assert c.get("/v1/models").status_code == 404
    c = _client(lambda r: httpx.Response(200, json={"data": []}))
    assert c.get("/v1/models").json() == {"data": []}


def test_credentials_in_a_url_never_reach_a_client():
    def handler(request):
        if request.url.host == "decode-a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(500)

    c = _client(handler, decode="http://user:hunter2@decode-a", prefill="http://u:pw2@prefill")
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and "hunter2" not in r.text and "hunter2" not in str(r.headers), (r.text, r.headers)
    r = c.get("/healthz")
    assert "hunter2" not in r.text and "pw2" not in r.text, r.text
    r = c.get("/v1/models")
    assert "hunter2" not in r.text, r.text


@pytest.mark.parametrize("kwargs", [
    {"prefill_urls": "http://p"},  # a str: each character was taken for a URL
    {"decode_workers": ["http://d"]},  # AttributeError
    {"decode_workers": [None]},
    {"timeout_s": float("nan")}, {"timeout_s": float("inf")}, {"timeout_s": -1}, {"timeout_s": 0},
    {"timeout_s": "600"}, {"timeout_s": True},
    {"transport": "x"}, {"transport": httpx.HTTPTransport()},  # a sync transport: AttributeError per request
])
def test_create_app_wrong_arguments_are_kvslots_errors(kwargs):
    args = {"prefill_urls": ["http://p"], "decode_workers": [DecodeWorker("http://d")], **kwargs}
    with pytest.raises(InvalidArgumentError):
        create_app(args.pop("prefill_urls"), args.pop("decode_workers"), **args)


@pytest.mark.parametrize("body", [None, [], "x", 5, [("a", 1)]])
def test_prefill_body_needs_a_dict(body):
    from kvslots.proxy.app import prefill_body

    with pytest.raises(InvalidArgumentError):
        prefill_body(body)


@pytest.mark.parametrize("flag", ["--prefill", "--decode", "--indexer"])
def test_url_with_port_0_is_one_line_exit_2(capsys, no_server, flag):
    argv = {"--prefill": "http://p:1", "--decode": "http://d:2"}
    argv[flag] = "http://h:0"
    code, out, err = _cli(capsys, [x for kv in argv.items() for x in kv])
    assert code == 2 and err.count("\n") == 1 and "port 0" in err, err


@pytest.mark.parametrize("host", ["", "  "])
def test_empty_host_is_one_line_exit_2(capsys, no_server, host):
    # It bound every address, silently (as --host 0.0.0.0 does, asked for).
    code, out, err = _cli(capsys, ["--prefill", "http://p:1", "--decode", "http://d:2", "--host", host])
    assert code == 2 and out == "" and err.count("\n") == 1 and "give an address to bind" in err, err


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_timeout_is_a_502_that_says_so(stream):
    # httpx's timeouts have no message: the 502 read "decode worker ... failed: ", nothing more.
    def handler(request):
        if request.url.host == "decode-a":
            raise httpx.ReadTimeout("", request=request)
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

    r = _client(handler).post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == 502 and r.json()["error"].endswith("failed: ReadTimeout"), r.text


class _UnreadableBody(httpx.AsyncByteStream):
    async def __aiter__(self):
        raise httpx.ReadError("connection reset")
        yield b""  # noqa: unreachable - makes this an async generator


def test_a_decode_4xx_whose_body_cannot_be_read_is_a_502_with_or_without_a_stream():
    # With a stream it was the 4xx, its body the text "(body unreadable: ...)" as application/json.
    def handler(request):
        if request.url.host == "decode-a":
            return httpx.Response(400, headers={"content-type": "application/json"}, stream=_UnreadableBody())
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

    c = _client(handler)
    for stream in (False, True):
        r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 502 and "connection reset" in r.json()["error"], (stream, r.status_code, r.text)


def test_an_indexer_name_given_to_two_decode_workers_is_refused(capsys, no_server):
    # Both got its score and the first always won: the other was never picked by score.
    code, out, err = _cli(capsys, ["--prefill", "http://p:1", "--decode", "http://d:2=w", "--decode",
                                   "http://u:hunter2@d:3=w"])
    assert code == 2 and err.count("\n") == 1 and "worker name 'w' is given to http://d:2 and http://d:3" in err, err
    assert "hunter2" not in err
    with pytest.raises(InvalidArgumentError, match="worker name 'w' is given to"):
        create_app(["http://p"], [DecodeWorker("http://d:2", "w"), DecodeWorker("http://d:3", "w")])
    # the same worker twice, or names apart, are fine
    create_app(["http://p"], [DecodeWorker("http://d:2", "w"), DecodeWorker("http://d:2", "w"), DecodeWorker("http://d:3")])


@pytest.mark.parametrize("value", ["0", "-1", str(2**20 + 1)])
def test_max_connections_out_of_range_is_one_line_exit_2(capsys, no_server, value):
    code, out, err = _cli(capsys, ["--prefill", "http://p:1", "--decode", "http://d:2", "--max-connections", value])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--max-connections {value} must be in 1..1048576" in err, err


def test_max_connections_default_leaves_room_for_the_backend_pool(capsys, monkeypatch):
    import uvicorn

    from kvslots import _listen
    from kvslots.indexer import fds
    from kvslots.proxy.app import BACKEND_CONNECTIONS, SIDE_CONNECTIONS

    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: given.update(kw))
    monkeypatch.setattr(_listen, "check_listen", lambda host, port: None)
    monkeypatch.setattr(fds, "limit", lambda: 1024)
    monkeypatch.setattr(fds, "in_use", lambda: 20)
    code, out, err = _cli(capsys, ["--prefill", "http://p:1", "--decode", "http://d:2"])
    assert code == 0, err
    # half of what is left for the backend pool (under BACKEND_CONNECTIONS), the rest less the side pool
    room = 1024 - 20 - fds.SPARE
    assert BACKEND_CONNECTIONS > room // 2
    assert given["http"].max_connections == room - room // 2 - SIDE_CONNECTIONS


@pytest.mark.parametrize("prefill, decode", [
    (5, [DecodeWorker("http://d")]),  # not iterable: was a TypeError
    (["http://p"], 5),
    (iter([]), [DecodeWorker("http://d")]),  # an empty iterator passed `not prefill_urls`
    (["http://p"], iter([])),
])
def test_create_app_worker_lists_of_the_wrong_kind_are_kvslots_errors(prefill, decode):
    with pytest.raises(InvalidArgumentError):
        create_app(prefill, decode, transport=httpx.MockTransport(lambda r: httpx.Response(200)))


def test_create_app_takes_worker_iterators_once():
    # A generator of decode workers was consumed by the checks: every request then found no
    # worker (StopIteration out of the round robin: a 500), /v1/models too (not subscriptable).
    def answer(request):
        if request.url.host == "p":
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, json={"by": request.url.host})

    app = create_app(iter(["http://p"]), (w for w in [DecodeWorker("http://d")]),
                     transport=httpx.MockTransport(answer))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json() == {"by": "d"}, r.text
        assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("value", [10**400, 10**5000], ids=["400-digits", "5000-digits"])  # repr() refuses 5000
def test_create_app_timeout_past_float_range_is_a_kvslots_error(value):
    with pytest.raises(InvalidArgumentError, match="timeout_s"):  # was an OverflowError
        create_app(["http://p"], [DecodeWorker("http://d")], timeout_s=value)


def test_decode_worker_with_an_empty_name_is_one_line_exit_2(capsys, no_server):
    # `--decode http://d=$NAME` with NAME unset was taken as a worker without a name: never
    # scored by the indexer, silently.
    code, out, err = _cli(capsys, ["--prefill", "http://p", "--decode", "http://d="])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvslots proxy: error: --decode 'http://d=': worker name ''"), err


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"),
                                          ("GET", "/v1/models/"), ("GET", "/healthz/")])
def test_a_trailing_slash_is_a_json_404_not_a_redirect(method, path):
    # It was a 307 with an empty body pointing at the path without the slash.
    c = _client(lambda r: pytest.fail("a backend was called"))
    r = c.request(method, path, json={"prompt": "x"}, follow_redirects=False)
    assert r.status_code == 404 and r.json()["detail"], (r.status_code, r.headers, r.text)


def test_a_big_body_is_parsed_and_encoded_off_the_event_loop(monkeypatch):
    # On the event loop, a 30 MB body of 2.6 million keys held every other request (/healthz
    # too) for 13 s: parsing it, then encoding it for the prefill and the decode worker.
    import asyncio

    from kvslots.proxy import app as app_module

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    seen = []

    def watched(name):
        fn = getattr(app_module, name)

        def call(x):
            seen.append((name, on_loop()))
            return fn(x)
        return call

    for name in ("_parse_body", "_json_bytes", "_token_ids"):
        monkeypatch.setattr(app_module, name, watched(name))
    got = []

    def handler(request):
        got.append((request.url.host, request.headers["content-type"], len(request.content)))
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

    app = create_app(["http://p"], [DecodeWorker("http://d", "w")], indexer_url="http://i",
                     transport=httpx.MockTransport(handler))
    c = TestClient(app)
    prompt = list(range(100_000))
    assert c.post("/v1/completions", json={"prompt": prompt}).status_code == 200
    assert seen and all(not loop for _, loop in seen), seen
    assert {name for name, _ in seen} == {"_parse_body", "_json_bytes", "_token_ids"}
    assert [h for h, *_ in got] == ["p", "i", "d"] and all(ct == "application/json" for _, ct, _ in got), got
    assert all(n > 500_000 for *_, n in got), got  # each sent whole
    seen.clear()
    assert c.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 200  # a small one: where it is
    assert seen and all(loop for _, loop in seen), seen


def _many(item: bytes, size: int, head: bytes = b'{"prompt":[', tail: bytes = b"]}") -> bytes:
    n = (size - len(head) - len(tail)) // (len(item) + 1)
    return head + b",".join([item] * n) + tail


@pytest.mark.parametrize("body, says", [
    (_many(b"[]", 3 * 2**20), "arrays and objects; at most 131072"),
    (_many(b"{}", 3 * 2**20), "arrays and objects; at most 131072"),
    (_many(b"[]", 3 * 2**20, b"[", b"]"), "arrays and objects; at most 131072"),
    (_many(b'""', 3 * 2**20), "strings (keys included); at most 524288"),
    (b"{" + b",".join(b'"k%d":1' % i for i in range(600_000)) + b"}", "strings (keys included)"),
], ids=["a million []", "a million {}", "top-level array of []", "a million strings", "600,000 keys"])
def test_a_body_of_more_containers_or_strings_than_a_request_holds_is_a_400_unparsed(monkeypatch, body, says):
    # Parsing holds the GIL, in a worker thread too: 30 MB of empty arrays took 15 s and held
    # every other request, /healthz too, for 6 s; 30 MB of empty strings 3 s and 1.4 s.
    from kvslots.proxy import app as app_module

    parsed = []
    monkeypatch.setattr(app_module, "loads_strict_json", lambda raw: parsed.append(len(raw)))
    c = _client(lambda r: pytest.fail("a backend was called"))
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"], (r.status_code, r.text[:300])
    assert parsed == []


def test_big_good_bodies_still_pass_the_shape_check():
    # Brackets and quotes in the text are not structure: a 2 MB message of them, and a chat of
    # 10,000 messages, go through.
    got = []

    def handler(request):
        got.append(json.loads(request.content))
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

    c = _client(handler)
    text = '{"a": [1, "[\\"x\\"]"], "b": {}}\\' * 60_000
    for body in ({"messages": [{"role": "user", "content": text}]},
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi [{"}]}] * 10_000},
                 {"prompt": [list(range(8))] * 20_000}):
        got.clear()
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text[:300]
        assert got[-1]["messages" if "messages" in body else "prompt"] == body.get("messages", body.get("prompt"))
