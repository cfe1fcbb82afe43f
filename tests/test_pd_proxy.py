"""``kvslots proxy`` against stand-in workers (httpx MockTransport): the prefill request is cut to
one token with do_remote_decode, its kv_transfer_params reach the decode request, streams pass
through, a failed prefill is recomputed on the decode worker, a failed decode is a 502 (its 4xx
passed on), the indexer's scores pick the decode worker."""

from __future__ import annotations

import json

import httpx
import pytest
from ports import free_port

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app, prefill_body  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}


class Backends:
    def __init__(self, prefill_status=200, decode_status=200, scores=None, prefill_params=PARAMS,
                 prefill_content=None, indexer_content=None):
        self.calls: list[tuple[str, dict]] = []
        self.prefill_status = prefill_status
        self.decode_status = decode_status
        self.scores = scores
        self.prefill_params = prefill_params
        self.prefill_content = prefill_content  # raw bytes answered instead of the JSON object
        self.indexer_content = indexer_content

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((str(request.url), body))
        host = request.url.host
        if host == "indexer":
            if self.indexer_content is not None:
                return httpx.Response(200, content=self.indexer_content)
            if self.scores is None:
                return httpx.Response(500)
            return httpx.Response(200, json={"workers": {k: {"score": v} for k, v in self.scores.items()}})
        if host.startswith("prefill"):
            if self.prefill_status == "down":
                raise httpx.ConnectError("refused", request=request)
            if self.prefill_content is not None:
                return httpx.Response(self.prefill_status, content=self.prefill_content)
            return httpx.Response(self.prefill_status, json={"choices": [{"text": "x"}],
                                                             "kv_transfer_params": self.prefill_params})
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, text="boom")
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=b"data: {\"a\": 1}\n\ndata: [DONE]\n\n")
        return httpx.Response(200, json={"choices": [{"text": f"decoded by {host}"}], "got": body})


def _client(backends, decode=("http://decode-a",), indexer=None, names=None):
    workers = [DecodeWorker(u, (names or {}).get(u)) for u in decode]
    app = create_app(["http://prefill-1", "http://prefill-2"], workers, indexer_url=indexer,
                     transport=httpx.MockTransport(backends))
    return TestClient(app)


def test_prefill_body_is_one_token_without_stream():
    b = prefill_body({"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"x": 1},
                      "max_completion_tokens": 9})
    assert b["max_tokens"] == 1 and b["max_completion_tokens"] == 1 and b["stream"] is False
    assert "stream_options" not in b and b["kv_transfer_params"] == {"do_remote_decode": True}


def test_hand_off_reaches_the_decode_worker():
    be = Backends()
    with _client(be) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 20})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "disaggregated"
    (purl, pbody), (durl, dbody) = be.calls
    assert purl == "http://prefill-1/v1/completions" and pbody["max_tokens"] == 1
    assert durl == "http://decode-a/v1/completions"
    assert dbody["kv_transfer_params"] == PARAMS and dbody["max_tokens"] == 20
    assert r.json()["got"]["prompt"] == "hello"


def test_prefill_workers_round_robin_and_chat():
    be = Backends()
    with _client(be) as c:
        for _ in range(2):
            assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 200
    assert [u for u, _ in be.calls if "prefill" in u] == ["http://prefill-1/v1/chat/completions",
                                                          "http://prefill-2/v1/chat/completions"]


def test_stream_passes_through():
    be = Backends()
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert be.calls[0][1]["stream"] is False and be.calls[1][1]["stream"] is True


@pytest.mark.parametrize("status, params", [("down", PARAMS), (500, PARAMS), (200, None), (200, {"junk": 1})])
def test_failed_prefill_is_recomputed_on_decode(status, params):
    be = Backends(prefill_status=status, prefill_params=params)
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"forged": True}})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "recomputed"
    assert "kv_transfer_params" not in be.calls[-1][1]
    assert c.get("/healthz").json()["recomputed"] == 1


def test_failed_decode_is_a_502():
    be = Backends(decode_status=503)
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502 and "boom" in r.json()["error"]
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 502


@pytest.mark.parametrize("status", [400, 404, 422, 429])
def test_decode_workers_4xx_is_passed_on_not_a_502(status):
    """vLLM's 400 for a bad parameter (stream: "yes", max_tokens: 0, a prompt over the model's
    length) is the client's fault: it was a 502 blaming the worker."""
    be = Backends(decode_status=status)
    with _client(be) as c:
        for body in ({"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "stream": True}):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == status and r.text == "boom", r.text
            assert r.headers["x-kvslots-decode-worker"] == "http://decode-a"
        assert c.get("/healthz").json()["decode_errors"] == 0


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
                                  b"{\"prompt\": NaN, \"stream\": [[[[]]]]}"])
def test_bad_body_is_a_400(body):
    with _client(Backends()) as c:
        assert c.post("/v1/completions", content=body).status_code == 400


@pytest.mark.parametrize("body, problem", [
    # nested deeper than 64 at any depth (500 and 900 levels were a RecursionError: 500)
    (b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}", "nested more than 64 levels deep"),
    (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", "nested more than 64 levels deep"),
    # strings that are not Unicode text (a UnicodeEncodeError when forwarded: 500)
    (b'{"prompt": "\\ud800"}', "lone surrogate"),
    (b'{"prompt": "\\ud800", "stream": true}', "lone surrogate"),
    (b'{"\\udc80": 1, "prompt": "x"}', "lone surrogate"),
    (b'{"prompt": "\xed\xa0\x80"}', "not UTF-8"),
    (b'{"prompt": [' + b"9" * 5000 + b"]}", "too many digits"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_body_is_a_400_naming_the_problem(body, problem, path):
    be = Backends()
    with _client(be) as c:
        r = c.post(path, content=body)
        assert r.status_code == 400 and problem in r.json()["error"], r.text
        assert c.get("/healthz").status_code == 200
    assert be.calls == []  # nothing was forwarded


def test_prefill_body_copies_only_the_top_level():
    nested = {"a": [[{"b": 1}]]}
    out = prefill_body({"prompt": "x", "extra": nested})
    assert out["extra"] is nested and out is not nested


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"42", b"null", b"not json", b"",
                                     b"[" * 100_000 + b"]" * 100_000, b'{"kv_transfer_params": [1]}',
                                     b'{"kv_transfer_params": {"do_remote_prefill": true}, "a": NaN}'])
def test_prefill_answer_that_is_not_a_json_object_is_recomputed(content):
    # The module docstring's promise; a JSON array was an AttributeError (500).
    be = Backends(prefill_content=content)
    with _client(be) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "recomputed", r.text
        assert c.get("/healthz").json()["recomputed"] == 1
    assert "kv_transfer_params" not in be.calls[-1][1]


@pytest.mark.parametrize("content", [b"[1]", b'{"workers": []}', b'{"workers": {"wb": 5}}',
                                     b'{"workers": {"wb": {"score": "x"}}}',
                                     b'{"workers": {"wb": {"score": 1' + b"0" * 400 + b'}}}',
                                     b'{"workers": {"wb": {"score": true}}}',
                                     b'{"workers": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"\xff"])
def test_odd_indexer_answer_falls_back_to_round_robin(content):
    be = Backends(indexer_content=content)
    names = {"http://decode-a": "wa", "http://decode-b": "wb"}
    with _client(be, decode=("http://decode-a", "http://decode-b"), indexer="http://indexer", names=names) as c:
        workers = [c.post("/v1/completions", json={"prompt": [5, 6]}).headers["x-kvslots-decode-worker"]
                   for _ in range(2)]
    assert workers == ["http://decode-a", "http://decode-b"]


class _BrokenStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b"data: {\"a\": 1}\n\n"
        raise httpx.ReadError("connection reset")


def test_stream_broken_off_by_the_decode_worker_is_counted():
    # What reached the client before the break is passed on; that the stream is left unfinished
    # (no last chunk) is tests/test_proxy_stream_broken_off.py's, through a real server.
    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("prefill"):
            return httpx.Response(200, json={"kv_transfer_params": PARAMS})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_BrokenStream())

    with _client(backend) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 200 and r.text == 'data: {"a": 1}\n\n'
        assert c.get("/healthz").json()["decode_errors"] == 1


@pytest.mark.parametrize("prefill, decode", [
    (["http://[::1"], [DecodeWorker("http://d")]), (["ftp://p"], [DecodeWorker("http://d")]),
    (["http://p"], [DecodeWorker("http://d:99999")]), (["http://p"], [DecodeWorker("http://\u65e5\u672c.jp")]),
    ([], [DecodeWorker("http://d")]), (["http://p"], []),
])
def test_create_app_checks_the_urls(prefill, decode):
    with pytest.raises(InvalidArgumentError):
        create_app(prefill, decode)


def _proxy_cli(argv, capsys):
    capsys.readouterr()
    code = cli.main(["proxy", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, problem", [
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://[::1"], "--decode 'http://[::1' is not an http(s) URL"),
    (["--prefill", "http://[::1", "--decode", "http://127.0.0.1:2"], "--prefill 'http://[::1' is not an http(s) URL"),
    (["--prefill", "x", "--decode", "http://127.0.0.1:2"], "--prefill 'x' is not an http(s) URL"),
    (["--prefill", "http://p", "--decode", "http://d", "--indexer", "http://i:70000"], "--indexer"),
    (["--prefill", "http://p", "--decode", "http://d=w", "--port", "0"], "--port 0 is not a TCP port"),
    (["--prefill", "http://p", "--decode", "http://d", "--timeout", "inf"], "--timeout inf must be a finite"),
    (["--prefill", "http://p", "--decode", "http://d", "--timeout", "nan"], "--timeout nan must be a finite"),
    (["--prefill", "http://p", "--decode", "http://d", "--host", "256.1.1.1"], "host '256.1.1.1': cannot resolve"),
])
def test_cli_bad_arguments_are_one_line_exit_2(capsys, monkeypatch, argv, problem):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("uvicorn started"))
    code, out, err = _proxy_cli(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("kvslots proxy: error: "), err
    assert problem in err, err


def test_cli_port_in_use_is_one_line_exit_2(capsys, monkeypatch):
    import socket

    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("uvicorn started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = _proxy_cli(["--prefill", "http://p", "--decode", "http://d", "--port", str(port)], capsys)
    assert code == 2 and err.startswith(f"kvslots proxy: error: cannot listen on 127.0.0.1:{port}"), err
    started = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **k: started.append(k))
    free = free_port()
    assert _proxy_cli(["--prefill", "http://p/", "--decode", "http://d=w", "--port", str(free)], capsys)[0] == 0
    assert len(started) == 1 and started[0].pop("http").__name__.startswith("Guarded")
    assert started == [{"host": "127.0.0.1", "port": free, "log_level": "warning", "ws": "none",
                        "proxy_headers": False}]


def test_body_over_the_cap_is_a_413_before_it_is_read_whole(capsys, monkeypatch):
    """A 1000 MB body was read whole (2 GB of memory) and forwarded; now a 413 past
    --max-body-mb (64 MiB by default), with or without a Content-Length, and nothing is forwarded."""
    be = Backends()
    workers = [DecodeWorker("http://decode-a")]
    app = create_app(["http://prefill-1"], workers, transport=httpx.MockTransport(be), max_body_mb=1)
    with TestClient(app) as c:
        big = b'{"prompt": "' + b"a" * 2**20 + b'"}'
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json() == {"error": f"request body over {2**20} bytes"}
        r = c.post("/v1/completions", content=iter([big[:2**19], big[2**19:]]))  # chunked: no Content-Length
        assert r.status_code == 413
        assert be.calls == []
        r = c.post("/v1/completions", json={"prompt": "a" * (2**20 - 100)})
        assert r.status_code == 200
    for bad in (0, -1, 65537, True, 1.5, "64"):
        with pytest.raises(InvalidArgumentError, match="max_body_mb"):
            create_app(["http://p"], workers, max_body_mb=bad)
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("uvicorn started"))
    for value in ("0", "65537", "-5"):
        code, out, err = _proxy_cli(["--prefill", "http://p", "--decode", "http://d", "--max-body-mb", value], capsys)
        assert code == 2 and err == f"kvslots proxy: error: --max-body-mb {value} must be in 1..65536\n", err


def test_indexer_picks_the_decode_worker():
    be = Backends(scores={"wa": 0.0, "wb": 3.0})
    names = {"http://decode-a": "wa", "http://decode-b": "wb"}
    with _client(be, decode=("http://decode-a", "http://decode-b"), indexer="http://indexer", names=names) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8]})
        assert r.headers["x-kvslots-decode-worker"] == "http://decode-b"
        # a text prompt is not scored (the proxy does not tokenize): round robin
        r = c.post("/v1/completions", json={"prompt": "text"})
        assert r.headers["x-kvslots-decode-worker"] == "http://decode-a"
    be2 = Backends(scores=None)  # indexer failing: round robin, no error
    with _client(be2, decode=("http://decode-a", "http://decode-b"), indexer="http://indexer", names=names) as c:
        assert c.post("/v1/completions", json={"prompt": [5, 6]}).status_code == 200
