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
TOKEN = "s3cret"


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
    "tcp://:::", "tcp://a:b", "tcp://:5557", "tcp://*:5557", "tcp://[::1", "tcp://[::1]:5557", "tcp://[zz]:1",
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
