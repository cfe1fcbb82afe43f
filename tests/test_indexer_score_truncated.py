"""A prompt longer than the indexer's --max-tokens is scored on its first --max-tokens tokens
(``truncated: true``) instead of refused with a 422: the router fell back to round robin for
exactly the long prompts where a prefix hit matters most. Bodies past the byte limit are still
refused (413), and the body's shape check still has its bound."""

from __future__ import annotations

import time

import pytest

from fastapi.testclient import TestClient
from indexer_support import store

from kvslots.events import KVEventBatch, encode_batch
from kvslots.indexer import IndexerConfig, IndexerService
from kvslots.indexer import app as app_module

BS = 4
LONG = list(range(1000, 1200))  # 200 tokens, 50 blocks


def _service(max_tokens: int) -> IndexerService:
    svc = IndexerService(IndexerConfig(block_size=BS, max_tokens=max_tokens))
    # worker "a" holds the first 80 tokens (20 blocks) of LONG
    svc.backend.add_worker("a")
    svc.backend.apply("a", 0, encode_batch(KVEventBatch(time.time(), [store(7, LONG[:80], BS)], 0)), "GPU")
    return svc


def test_a_prompt_past_max_tokens_is_scored_on_its_first_max_tokens():
    c = TestClient(app_module.create_app(_service(64)))
    r = c.post("/score", json={"token_ids": LONG})  # 200 tokens, 64 scored
    assert r.status_code == 200, r.text  # 422 on the old code
    doc = r.json()
    assert doc["truncated"] is True and doc["prompt_blocks"] == 50
    assert doc["workers"]["a"]["blocks"] == 16 and doc["workers"]["a"]["tokens"] == 64  # 64 of its 80
    # at the limit and below: all scored, not truncated
    for n, held in ((64, 16), (40, 10)):
        doc = c.post("/score", json={"token_ids": LONG[:n]}).json()
        assert doc["truncated"] is False and doc["workers"]["a"]["blocks"] == held, doc
    # a bad token id past the limit is still refused (each one is checked)
    assert c.post("/score", json={"token_ids": LONG + [-1]}).status_code == 422
    # a body over the byte limit (64 * 12 + 4096 bytes) is still refused, unparsed
    body = b'{"token_ids": [' + b"1," * 3000 + b"1]}"
    r = c.post("/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    # the Python API says the same
    doc = _service(64).score(LONG, None, None, None)
    assert doc["truncated"] is True and doc["workers"]["a"]["blocks"] == 16


def test_only_the_first_max_tokens_ids_are_parsed(monkeypatch):
    # The memory and time a body costs stay those of --max-tokens ids: the dropped ids are
    # checked on the bytes and never built (1.57M of them in a 3 MB body: 1.9 s and 30 MB).
    parsed = []
    parse = app_module._strict_json
    monkeypatch.setattr(app_module, "_strict_json", lambda b: (parsed.append(len(parse(b)["token_ids"])),
                                                               parse(b))[1])
    c = TestClient(app_module.create_app(_service(20_000)))
    most = (20_000 * 12 + 4096 - 64) // 2  # "1," each: the most ids within the byte limit
    body = b'{"block_size": 4, "token_ids": [' + b"1," * most + b'1], "lora_id": null}'
    r = c.post("/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] is True and r.json()["prompt_blocks"] == (most + 1) // 4
    assert parsed == [20_000]
    # the bounds of the body's shape are those of --max-tokens ids, as before
    bounds = {r.path: app_module._body_bounds(r) for r in c.app.routes if hasattr(r, "body_field")}
    assert bounds["/score"] == (2, 5, 20_000 + 4)


@pytest.mark.parametrize("bad", [b"-1", b"1.5", b"4294967296", b"01", b"1 2", b"", b'"1"', b"[1]", b"null",
                                 b"99999999999"])
def test_a_bad_id_past_max_tokens_is_refused(bad):
    c = TestClient(app_module.create_app(_service(64)))
    body = b'{"token_ids": [' + b"1, " * 100 + bad + b"]}"
    r = c.post("/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    ok = b'{"token_ids": [' + b"1, " * 100 + b"4294967295]}"
    r = c.post("/score", content=ok, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["truncated"] is True


@pytest.mark.parametrize("body", [
    '{"token\\u005fids":[%s]}' % ",".join(map(str, LONG)),  # an escaped key: no cut on the bytes
    '{"token_ids":[%s,-0]}' % ",".join(map(str, LONG[:99])),  # -0 past the limit (JSON's 0)
    '{"token_ids":[%s]}' % ",".join(map(str, LONG)).replace(",", " ,", 1),  # a blank before a comma
], ids=["escaped-key", "minus-zero", "blank"])
def test_forms_the_byte_cut_leaves_are_truncated_too(body):
    # Where _first_ids could not cut the ids on the bytes, the whole body was parsed and refused
    # as too long (422 too_long), which a long prompt no longer is.
    c = TestClient(app_module.create_app(_service(64)))
    r = c.post("/score", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    doc = r.json()
    total = body.count(",") + 1
    assert doc["truncated"] is True and doc["prompt_blocks"] == total // BS, doc
    assert doc["workers"]["a"]["blocks"] == 16 and doc["workers"]["a"]["tokens"] == 64, doc


@pytest.mark.parametrize("bad, shown", [("-1", "-1"), ('"x"', '"x"'), ("1.5", "1.5"), ("4294967296", "4294967296")])
def test_a_bad_id_past_the_limit_is_named(bad, shown):
    c = TestClient(app_module.create_app(_service(64)))
    body = '{"token_ids":[%s,%s,1]}' % (",".join(map(str, LONG[:99])), bad)
    r = c.post("/score", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]  # not too_long: a longer prompt is taken
    assert err["loc"] == ["body", "token_ids", 99], err
    assert err["msg"].startswith(f"token id {shown} at index 99, past --max-tokens (64), is invalid"), err


@pytest.fixture(scope="module")
def default_limits():
    # At the default --max-tokens (262,144) every prompt past it is a body over SHAPE_CHECK_BYTES
    svc = IndexerService(IndexerConfig(block_size=BS))
    return TestClient(app_module.create_app(svc)), svc.cfg.max_tokens


@pytest.mark.parametrize("form, status", [
    ('{"token\\u005fids":[%s]}', 200),  # an escaped key
    ('{"token_ids":[%s,-0]}', 200),  # -0 past the limit
    ('{"token_ids":[%s,1,-1]}', 422),  # a bad id past the limit: named
])
def test_forms_past_the_default_limit_are_cut_not_refused_by_the_shape_check(default_limits, form, status):
    # The shape check ran first with the model's bound (max_tokens items) and refused each with a
    # generic "the body has at least ... array items": the cut after parsing never ran.
    c, most = default_limits
    ids = ",".join(str(1000 + i % 30_000) for i in range(most + 10))  # a realistic prompt, 1.7 MB
    body = (form % ids).encode()
    assert len(body) > app_module.SHAPE_CHECK_BYTES
    r = c.post("/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    if status == 200:
        total = body.count(b",") + 1
        assert r.json()["truncated"] is True and r.json()["prompt_blocks"] == total // BS
    else:
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "token_ids", most + 11], err
        assert err["msg"].startswith(f"token id -1 at index {most + 11}, past --max-tokens"), err
