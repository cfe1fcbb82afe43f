"""The indexer's public Python API (IndexerConfig, IndexerService, WorkerSpec) with wrong types
and values: a kvslots error (ConfigError, ArgumentTypeError), never a TypeError, AttributeError or
ValueError from deep inside, and nothing registered."""

from __future__ import annotations

import pytest

from kvslots.errors import ArgumentTypeError, ConfigError, KVSlotsError
from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec

BAD_CONFIGS = {
    "port str": {"port": "8200"}, "port float": {"port": 8200.0}, "port bool": {"port": True},
    "block_size str": {"block_size": "4"}, "block_size 0": {"block_size": 0},
    "max_tokens None": {"max_tokens": None}, "capacity float": {"capacity": 1.5},
    "replay_timeout str": {"replay_timeout": "1"}, "replay_timeout nan": {"replay_timeout": float("nan")},
    "replay_timeout inf": {"replay_timeout": float("inf")}, "admin_token int": {"admin_token": 12345678901234567},
    "host None": {"host": None}, "backend int": {"backend": 1}, "log_level list": {"log_level": []},
    "redis_url bytes": {"redis_url": b"redis://h"}, "workers str": {"workers": "abc"},
    "workers of dicts": {"workers": [{"name": "a", "endpoint": "tcp://h:1"}]}, "workers None": {"workers": None},
    "tier_weights list": {"tier_weights": []}, "tier_weights str value": {"tier_weights": {"GPU": "1"}},
    "tier_weights bool": {"tier_weights": {"GPU": True}}, "tier_weights int key": {"tier_weights": {1: 1.0}},
    "max_connections 0": {"max_connections": 0}, "max_connections bool": {"max_connections": True},
    "max_connections str": {"max_connections": "8"}, "max_connections past 2**20": {"max_connections": 2**20 + 1},
}


@pytest.mark.parametrize("changes", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_a_config_error(changes):
    with pytest.raises(ConfigError):
        IndexerConfig(**changes).validate()
    with pytest.raises(ConfigError):  # the service validates what it is given
        IndexerService(IndexerConfig(**changes))


@pytest.mark.parametrize("cfg", [None, "cfg", {"block_size": 4}, 5])
def test_service_needs_an_indexer_config(cfg):
    with pytest.raises(ArgumentTypeError):
        IndexerService(cfg)


@pytest.fixture(scope="module")
def svc():
    return IndexerService(IndexerConfig(block_size=4))


@pytest.mark.parametrize("call", [
    lambda s: s.add_worker({"name": "a", "endpoint": "tcp://h:1"}),
    lambda s: s.add_worker(None),
    lambda s: s.add_worker("a=tcp://h:1"),
    lambda s: s.remove_worker(["a"]),
    lambda s: s.remove_worker(None),
    lambda s: s.remove_worker(5),
    lambda s: s.score((t for t in range(8)), 4, None, None),
    lambda s: s.score(iter([1, 2, 3, 4]), 4, None, None),
    lambda s: s.score({1, 2, 3, 4}, 4, None, None),
    lambda s: s.score("abcd", 4, None, None),
    lambda s: s.score([1] * 8, -1, None, None),
    lambda s: s.score([1] * 8, 2.5, None, None),
    lambda s: s.score([1] * 8, 4, -1, None),
    lambda s: s.score([1] * 8, 4, None, "\ud800"),
])
def test_bad_calls_are_kvslots_errors_and_change_nothing(svc, call):
    before = (svc.workers(), sorted(svc.backend.specs()))
    with pytest.raises(KVSlotsError):
        call(svc)
    assert (svc.workers(), sorted(svc.backend.specs())) == before


@pytest.mark.parametrize("text", [5, None, b"a=tcp://h:1", ["a=tcp://h:1"]])
def test_worker_spec_parse_needs_a_string(text):
    with pytest.raises(ConfigError):
        WorkerSpec.parse(text)


def test_good_configs_and_calls_still_work(svc):
    IndexerConfig(port=0, capacity=None, replay_timeout=1, tier_weights={"GPU": 2}).validate()
    assert svc.score([1] * 8, None, None, None)["prompt_blocks"] == 2
    assert svc.score((1, 2, 3, 4), 2, 7, None)["prompt_blocks"] == 2
    assert svc.remove_worker("nobody") is False


#: A replay address that is the endpoint, spelled the same or otherwise (compared as text, the
#: other spellings were accepted).
SAME_ADDRESS = [("tcp://h:1", "tcp://h:1"), ("tcp://127.0.0.1:1", "tcp://127.0.0.1:01"),
                ("tcp://127.0.0.1:01", "tcp://127.0.0.1:1"), ("tcp://h:1", "tcp://H:00001"),
                ("tcp://[::1]:5557", "tcp://[0:0::1]:5557"), ("ipc:///tmp/k.sock", "ipc:///tmp/k.sock")]


@pytest.mark.parametrize("endpoint, replay", SAME_ADDRESS)
def test_replay_on_the_endpoint_itself_is_refused(endpoint, replay, capsys):
    # A publisher binds its PUB and ROUTER sockets apart: replays asked there were never answered.
    from fastapi.testclient import TestClient

    from kvslots import cli
    from kvslots.indexer.app import create_app

    with pytest.raises(ConfigError, match="is the endpoint too"):
        WorkerSpec("a", endpoint, replay=replay)
    capsys.readouterr()
    assert cli.main(["indexer", "--worker", f"a={endpoint},replay={replay}"]) == 2
    err = capsys.readouterr().err
    assert "is the endpoint too" in err and err.count("\n") == 1, err
    token = "t" * 20
    svc = IndexerService(IndexerConfig(block_size=4, admin_token=token))
    c = TestClient(create_app(svc))
    r = c.post("/workers", json={"name": "a", "endpoint": endpoint, "replay": replay},
               headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 422 and "is the endpoint too" in r.json()["detail"], r.text
    assert c.get("/workers").json() == []


@pytest.mark.parametrize("endpoint, replay", [("tcp://h:1", "tcp://h:10"), ("tcp://h:1", "tcp://h2:1"),
                                              ("tcp://[::1]:1", "tcp://[::2]:1"), ("tcp://h:1", "ipc://h:1")])
def test_replay_on_another_address_is_taken(endpoint, replay):
    assert WorkerSpec("a", endpoint, replay=replay).replay == replay
