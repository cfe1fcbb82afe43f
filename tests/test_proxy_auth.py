"""Workers started with vLLM's ``--api-key`` refused every proxied request: the proxy sent them no
``Authorization``. Now the client's is passed on to both legs (prefill and decode) and to
``GET /v1/models``, as a reverse proxy passes it (llm-d's routing sidecar); with
``--backend-api-key`` (or $KVSLOTS_BACKEND_API_KEY) the workers get ``Bearer KEY`` instead, the
client's not sent (vLLM's disaggregated proxy examples). The indexer gets neither."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from proxy_support import started  # noqa: E402,F401 - a fixture


def _proxy(seen: list, **kw) -> TestClient:
    """A proxy whose backends (prefill p, decode d, indexer i) record (leg, Authorization) and
    refuse a request without 'Bearer good' as vLLM --api-key does (401)."""
    def backend(request: httpx.Request) -> httpx.Response:
        auth = request.headers.get_list("authorization")
        if request.url.host == "i":
            seen.append(("indexer", auth))
            return httpx.Response(200, json={"workers": {}})
        body = json.loads(request.content) if request.content else {}
        leg = "models" if request.url.path == "/v1/models" else \
            "prefill" if body.get("kv_transfer_params", {}).get("do_remote_decode") else "decode"
        seen.append((leg, auth))
        if auth != ["Bearer good"]:
            return httpx.Response(401, json={"error": "Unauthorized"})
        if leg == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, json={"ok": True})

    return TestClient(create_app(["http://p"], [DecodeWorker("http://d", "w")], indexer_url="http://i",
                                 transport=httpx.MockTransport(backend), **kw))


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_authorization_reaches_both_legs(stream):
    seen: list = []
    with _proxy(seen) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": stream},
                   headers={"Authorization": "Bearer good"})
        models = c.get("/v1/models", headers={"Authorization": "Bearer good"})
    assert r.status_code == 200 and r.headers["x-kvslots-pd"] == "disaggregated"
    assert models.status_code == 200
    assert seen == [("prefill", ["Bearer good"]), ("indexer", []), ("decode", ["Bearer good"]),
                    ("models", ["Bearer good"])]


def test_a_wrong_key_is_the_workers_401():
    seen: list = []
    with _proxy(seen) as c:
        r = c.post("/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer bad"})
        none = c.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 401 and none.status_code == 401
    # the prefill worker's 401 is the client's answer: nothing more is asked of anyone
    assert seen == [("prefill", ["Bearer bad"]), ("prefill", [])]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [401, 403])
def test_the_prefill_workers_401_or_403_is_the_clients_answer_as_it_is(status, stream):
    """It was taken as a failed prefill: the prompt was scored by the indexer and sent to the
    decode worker, which refused it too (an unauthenticated request reached every backend)."""
    seen: list = []

    def backend(request: httpx.Request) -> httpx.Response:
        if request.url.host == "i":
            seen.append("indexer")
            return httpx.Response(200, json={"workers": {"w": {"score": 1}}})
        seen.append(request.url.host)
        return httpx.Response(status, content=b'{"error":"no"}', headers={"content-type": "application/problem+json",
                                                                          "retry-after": "5"})

    app = create_app(["http://p"], [DecodeWorker("http://d", "w")], indexer_url="http://i",
                     transport=httpx.MockTransport(backend))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "stream": stream})
    assert (r.status_code, r.content, r.headers["content-type"]) == (status, b'{"error":"no"}',
                                                                     "application/problem+json")
    assert r.headers["retry-after"] == "5"
    assert seen == ["p"]  # the old code: ["p", "indexer", "d"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_workers_401_is_the_clients_answer(stream):
    def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(401, json={"error": "Unauthorized"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        health = c.get("/healthz").json()
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"} and health["decode_errors"] == 0


def test_the_backend_key_replaces_the_clients():
    seen: list = []
    with _proxy(seen, backend_api_key="good") as c:
        r = c.post("/v1/completions", json={"prompt": [1], "stream": True}, headers={"Authorization": "Bearer bad"})
        models = c.get("/v1/models")
    assert r.status_code == 200 and models.status_code == 200
    assert seen == [("prefill", ["Bearer good"]), ("indexer", []), ("decode", ["Bearer good"]),
                    ("models", ["Bearer good"])]


def test_two_authorizations_are_a_400_before_any_worker():
    seen: list = []
    with _proxy(seen) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"},
                   headers=[("authorization", "Bearer good"), ("authorization", "Bearer other")])
        m = c.get("/v1/models", headers=[("authorization", "Bearer good"), ("authorization", "Bearer other")])
    assert r.status_code == 400 and m.status_code == 400
    assert "Authorization" in r.json()["error"] and seen == []


def test_a_non_ascii_authorization_is_passed_on_as_sent():
    seen: list = []
    with _proxy(seen) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": b"Bearer \xff\xfe"})
    assert r.status_code == 401  # (the worker's answer), not a 500 of encoding it
    assert ("prefill", ["Bearer \xff\xfe"]) in seen


@pytest.mark.parametrize("key", ["", "has blank", "k\n", "é", "x" * 4097, 5, b"k"])
def test_create_app_refuses_a_bad_key(key):
    with pytest.raises(InvalidArgumentError) as e:
        create_app(["http://p"], [DecodeWorker("http://d")], backend_api_key=key)
    assert "has blank" not in str(e.value)  # the key is never shown


def _cli(capsys, argv):
    capsys.readouterr()
    code = cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:2", *argv])
    return (code, *capsys.readouterr())


def test_the_command_takes_the_key_from_the_flag_or_the_environment(capsys, started, monkeypatch):
    monkeypatch.delenv("KVSLOTS_BACKEND_API_KEY", raising=False)
    assert _cli(capsys, [])[0] == 0 and started["app"]["backend_api_key"] is None
    assert _cli(capsys, ["--backend-api-key", "k1"])[0] == 0 and started["app"]["backend_api_key"] == "k1"
    monkeypatch.setenv("KVSLOTS_BACKEND_API_KEY", "k2")
    assert _cli(capsys, [])[0] == 0 and started["app"]["backend_api_key"] == "k2"
    monkeypatch.setenv("KVSLOTS_BACKEND_API_KEY", "")  # set empty: as unset (not a refused key)
    assert _cli(capsys, [])[0] == 0 and started["app"]["backend_api_key"] is None


def test_a_bad_key_is_one_line_exit_2(capsys, started):
    code, out, err = _cli(capsys, ["--backend-api-key", "secret part"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--backend-api-key" in err and "secret" not in err and "http" not in started


@pytest.mark.parametrize("prefill,decode", [("http://u:pw@p", "http://d"), ("http://p", "http://u:pw@d"),
                                            ("http://u@p", "http://d")])
def test_a_worker_url_with_userinfo_and_the_backend_key_are_refused(prefill, decode):
    # httpx sends the URL's user:password as Basic auth in place of the key: it silently won
    with pytest.raises(InvalidArgumentError) as e:
        create_app([prefill], [DecodeWorker(decode)], backend_api_key="good")
    assert "user:password" in str(e.value) and "pw" not in str(e.value) and "u@" not in str(e.value)


def test_a_worker_url_with_userinfo_and_the_backend_key_are_one_line_exit_2(capsys, started):
    capsys.readouterr()
    code = cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://u:pw@d:2", "--backend-api-key", "k"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--backend-api-key" in err and "pw" not in err and "app" not in started


def test_the_userinfo_and_backend_key_rule_is_one_check(capsys, started):
    """Written twice (create_app and the command), with two messages; now one check the command wraps."""
    from kvslots.proxy.app import check_one_credential
    from kvslots.proxy.cli import API_KEY_ENV

    what = f"--backend-api-key (or ${API_KEY_ENV})"
    with pytest.raises(InvalidArgumentError) as e:
        check_one_credential(["http://p:1", "http://u:pw@d:2"], what)
    with pytest.raises(InvalidArgumentError) as app_error:
        create_app(["http://p:1"], [DecodeWorker("http://u:pw@d:2")], backend_api_key="k")
    assert str(app_error.value) == str(e.value).replace(what, "backend_api_key")
    capsys.readouterr()
    assert cli.main(["proxy", "--prefill", "http://p:1", "--decode", "http://u:pw@d:2", "--backend-api-key", "k"]) == 2
    assert capsys.readouterr().err == f"kvslots proxy: error: {e.value}\n"
    check_one_credential(["http://p:1", "http://d:2"])  # none with user:password: nothing to refuse


def test_a_worker_urls_userinfo_is_sent_in_place_of_the_clients_authorization():
    """The operator's setting wins (as --help says): the client's header is not sent beside it."""
    seen: list = []

    def backend(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        leg = "models" if request.url.path == "/v1/models" else \
            "prefill" if body.get("kv_transfer_params", {}).get("do_remote_decode") else "decode"
        seen.append((leg, request.headers.get_list("authorization")))
        if leg == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, json={"ok": True})

    app = create_app(["http://u:pw@p"], [DecodeWorker("http://u:pw@d")], transport=httpx.MockTransport(backend))
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer c"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer c"}).status_code == 200
    basic = ["Basic dTpwdw=="]  # u:pw
    assert seen == [("prefill", basic), ("decode", basic), ("models", basic)]


def test_with_the_backend_key_the_clients_authorization_is_not_read():
    """Not sent, not checked: two of them (a 400 without the key), or one with a control
    character, change nothing; the workers get the key."""
    seen: list = []
    with _proxy(seen, backend_api_key="good") as c:
        two = c.post("/v1/completions", json={"prompt": "hi"},
                     headers=[("authorization", "Bearer a"), ("authorization", "Bearer b")])
        odd = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": b"Bearer \x01"})
    assert two.status_code == 200 and odd.status_code == 200
    assert {tuple(auth) for _, auth in seen} == {("Bearer good",)}
