"""Request bodies refused for their shape before any parser builds them
(:func:`kvslots.indexer.httpguard.json_shape_error`): parsing holds the GIL, in a worker thread
too, and a 3 MB body of a million empty arrays held every other request of the indexer for about
0.5 s (1 s to refuse it), 30 MB of them every other request of the proxy for 6 s (15 s)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.indexer import IndexerConfig, IndexerService  # noqa: E402
from kvslots.indexer import app as app_module  # noqa: E402
from kvslots.indexer.httpguard import json_shape_error  # noqa: E402

TOKEN = "s3cret-s3cret-s3cret"
MB = 2**20


def _many(item: bytes, size: int, head: bytes = b'{"token_ids":[', tail: bytes = b"]}") -> bytes:
    n = (size - len(head) - len(tail)) // (len(item) + 1)
    return head + b",".join([item] * n) + tail


def _counts(doc) -> tuple[int, int, int]:
    """Arrays and objects, strings (keys included), and array items and object members in ``doc``."""
    if isinstance(doc, (list, dict)):
        each = [_counts(x) for x in (doc if isinstance(doc, list) else doc.values())]
        keys = len(doc) if isinstance(doc, dict) else 0
        return 1 + sum(e[0] for e in each), keys + sum(e[1] for e in each), len(doc) + sum(e[2] for e in each)
    return 0, int(isinstance(doc, str)), 0


# Strings full of what the counting could take for structure: brackets, quotes, backslashes.
_text = st.text(alphabet=st.sampled_from('[]{}"\\,:ab\u00e9\n'), max_size=12)
_docs = st.recursive(st.none() | st.booleans() | st.integers() | _text,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                     max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(_docs, st.booleans())
def test_the_counts_are_exact_whatever_the_strings_hold(doc, ascii_only):
    body = json.dumps(doc, ensure_ascii=ascii_only).encode()
    containers, strings, items = _counts(doc)
    assert json_shape_error(body, containers, strings, items) is None
    assert json_shape_error(body, containers, strings, items, strings_alone=True) is None
    if containers:
        # one fewer allowed: refused, by the exact count or (past the strings) by both
        assert json_shape_error(body, containers - 1, strings) is not None
    if strings:
        assert json_shape_error(body, None, strings - 1, strings_alone=True) is not None
    if items > 1 and items == _commas(doc) + 1:  # one array or object holds them all: the commas tell
        assert json_shape_error(body, None, strings, items - 1) is not None


def _commas(doc) -> int:
    if isinstance(doc, (list, dict)):
        inner = doc if isinstance(doc, list) else doc.values()
        return max(len(doc) - 1, 0) + sum(_commas(x) for x in inner)
    return 0


@pytest.mark.parametrize("body", [
    b'{"token_ids":[1,2],"lora_name":"[[{{"}',
    b'{"token_ids":[1,2],"lora_name":"\\\\"}',  # an escaped backslash just before the closing quote
    b'{"token_ids":[1,2],"lora_name":"[\\"[\\\\\\"{"}',
    b'{"token_ids":[1,2],"lora_name":"\\u005b\\u007b"}',
])
def test_brackets_and_quotes_in_strings_are_not_structure(body):
    assert json_shape_error(body, 2, 5) is None


def test_past_the_strings_bound_brackets_are_not_told_apart():
    # Telling them apart costs a piece per string: a body of a million "[" is refused without it.
    body = _many(b'"["', 3 * MB)
    why = json_shape_error(body, 2, 5)
    assert why and "more than 5 strings" in why, why


@pytest.fixture(scope="module")
def client():
    svc = IndexerService(IndexerConfig(block_size=4, admin_token=TOKEN))
    return TestClient(app_module.create_app(svc), raise_server_exceptions=False)


def test_each_route_bound_is_its_body_model(client):
    # One home for a route's body rule: the bounds come from the model (token_ids: one array of
    # integers; four keys and lora_name; WorkerIn: six keys, five string values).
    bounds = {(r.path, tuple(r.methods)): app_module._body_bounds(r)
              for r in client.app.routes if hasattr(r, "body_field")}
    assert bounds[("/score", ("POST",))] == (2, 5, 262_144 + 4)
    assert bounds[("/workers", ("POST",))] == (1, 11, 6)
    assert bounds[("/healthz", ("GET",))] is None


HOSTILE = {
    "score: token_ids of a million []": ("/score", _many(b"[]", 3 * MB)),
    "score: token_ids of a million {}": ("/score", _many(b"{}", 3 * MB)),
    "score: a top-level array of []": ("/score", _many(b"[]", 3 * MB, b"[", b"]")),
    "score: a million strings of [": ("/score", _many(b'"["', 3 * MB)),
    "score: 300,000 unknown keys": ("/score", _many(b'"k":1', 3 * MB, b"{", b"}")),
    "workers: name of a million []": ("/workers", _many(b"[]", 3 * MB, b'{"name":[', b"]}")),
}


@pytest.mark.parametrize("path, body", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("admin", [True, False])
def test_a_body_of_more_containers_than_the_route_takes_is_refused_unparsed(client, monkeypatch, path, body, admin):
    parsed = []
    parse = app_module._strict_json
    monkeypatch.setattr(app_module, "_strict_json", lambda b: (parsed.append(len(b)), parse(b))[1])
    workers = client.get("/workers").json()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {TOKEN}"} if admin else {})}
    r = client.post(path, content=body, headers=headers)
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert "the body has" in r.json()["detail"][0]["msg"], r.text[:300]
    assert parsed == []  # refused before it was built
    assert client.get("/workers").json() == workers


def test_a_score_body_of_700000_nulls_is_refused_and_bounded(client):
    # /score's item bound is what its byte cap holds (a prompt past --max-tokens is cut after
    # parsing where the bytes cannot be cut): such a body is parsed (~13 MiB, 0.1 s) and its
    # first id past the limit named.
    r = client.post("/score", content=_many(b"null", 3 * MB), headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "token_ids", 262_144], r.text[:300]


@pytest.mark.parametrize("lora_name", ["[{" * 100, '"[\\', "\\", "é[", "a" * 256])
def test_good_bodies_still_work(client, lora_name):
    body = json.dumps({"token_ids": list(range(262_144)), "lora_name": lora_name, "block_size": 4}).encode()
    r = client.post("/score", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["prompt_blocks"] == 65_536, r.text[:300]
    name = lora_name[:64].replace('"', "").replace("\\", "").replace("[", "").replace("{", "").replace("é", "") or "w"
    r = client.post("/workers", json={"name": f"w{name}", "endpoint": "tcp://127.0.0.1:1", "topic": lora_name},
                    headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.text
    assert client.delete(f"/workers/w{name}", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 204


def test_a_small_body_gets_the_models_errors(client):
    # Cheap to parse: the shape is not checked, and the 422 names the field.
    body = {"name": "w", "endpoint": "tcp://127.0.0.1:1", "replay": None, "topic": "", "tier": "GPU", "eagle": False,
            "x": [[]]}
    r = client.post("/workers", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "x"], r.text
    r = client.post("/score", json={"token_ids": [[1]]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "token_ids", 0], r.text


def test_a_hostile_body_does_not_hold_up_other_requests():
    """On a real server: while three 3 MB bodies of a million empty arrays are sent at once,
    /healthz keeps answering (before: 1 s to refuse each, /healthz held about 0.5 s by one)."""
    import http.client
    import threading
    import time

    from test_indexer_http_hostile import _serve

    gen = _serve()
    connect = next(gen)
    s = connect()
    port = s.getpeername()[1]
    s.close()
    try:
        body = _many(b"[]", 3 * MB)
        done = []

        def hostile():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            t = time.perf_counter()
            c.request("POST", "/score", body=body, headers={"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            done.append((r.status, time.perf_counter() - t))

        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        worst = 0.0
        senders = [threading.Thread(target=hostile) for _ in range(3)]
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            t0 = time.perf_counter()
            probe.request("GET", "/healthz")
            assert probe.getresponse().read()
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.002)
        for t in senders:
            t.join()
        assert [s for s, _ in done] == [422] * 3, done
        assert max(d for _, d in done) < 0.6 and worst < 0.2, (done, worst)
    finally:
        next(gen, None)  # stops the server
