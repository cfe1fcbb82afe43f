"""The indexer service end to end: real ZMQ publishers on loopback (vLLM's wire protocol), the
subscription with its gap/replay/restart handling, the in-memory backend, the HTTP API."""

from __future__ import annotations

import argparse
import errno
import socket

import pytest
from fastapi.testclient import TestClient
from indexer_support import Oracle, TestPublisher, remove, score_view, store, wait_for

from kvslots.events import AllBlocksCleared
from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec
from kvslots.indexer.app import create_app
from kvslots.indexer.config import ConfigError, build_config

BS = 4
TOKEN = "t0ken-with-enough-entropy"
P1 = list(range(100, 116))  # 4 blocks
P2 = P1[:8] + list(range(200, 208))  # shares 2 blocks with P1
P3 = list(range(300, 312))


class Harness:
    def __init__(self, pubs: dict[str, TestPublisher], *, tiers=None, admin_token=None, **cfg):
        self.pubs = pubs
        self.oracle = Oracle()
        workers = []
        for name, pub in pubs.items():
            tier = (tiers or {}).get(name, "GPU")
            workers.append(WorkerSpec(name, pub.endpoint, pub.replay_endpoint, tier=tier))
            self.oracle.add_worker(name, tier)
        self.cfg = IndexerConfig(workers=workers, block_size=BS, admin_token=admin_token, replay_timeout=1.0,
                                 capacity=None, **cfg)
        self.service = IndexerService(self.cfg)
        self.service.start()
        self.client = TestClient(create_app(self.service))

    def publish(self, worker: str, events: list, *, drop: bool = False, model: bool = True) -> int:
        if model:
            self.oracle.apply(worker, events)
        return self.pubs[worker].publish(events, drop=drop)

    def score(self, tokens, **kw) -> dict:
        r = self.client.post("/score", json={"token_ids": tokens, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def converge(self, *prompts, timeout: float = 5.0) -> None:
        """Until every prompt scores as the oracle says (the stream is asynchronous)."""
        def ok():
            return all(score_view(self.score(p)) == self.oracle.lookup(p, BS) for p in prompts)
        wait_for(ok, timeout, "scores to match the oracle")

    def stream(self, worker: str) -> dict:
        return self.service.sub.status()[worker]

    def metric(self, name: str, worker: str | None = None) -> float:
        labels = {"worker": worker} if worker else {}
        v = self.service.metrics.registry.get_sample_value(name, labels)
        return v or 0.0

    def close(self) -> None:
        self.client.close()
        self.service.stop()
        for p in self.pubs.values():
            p.close()


@pytest.fixture
def harness():
    made = []

    def make(names=("a",), host="127.0.0.1", **kw):
        pubs = {n: TestPublisher(buffer_steps=kw.pop(f"buffer_{n}", 10_000), host=host) for n in names}
        h = Harness(pubs, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def settle(h: Harness, worker: str) -> None:
    """Publishes a no-op batch until the subscriber sees live messages (ZMQ's slow joiner)."""
    wait_for(lambda: h.publish(worker, [], model=False) is not None and h.stream(worker)["last_live_seq"] is not None,
             5, "the subscription to receive")


def test_scores_follow_the_stream(harness):
    h = harness(("a", "b"))
    settle(h, "a")
    settle(h, "b")
    h.publish("a", [store(1, P1, BS)])
    h.publish("b", [store(2, P2, BS, medium="CPU")])
    h.publish("a", [store(1, P2, BS, start=2)])  # a's P2 tail, chained to its block 1
    h.converge(P1, P2, P3)
    r = h.score(P2)
    assert r["workers"]["a"] == {"blocks": 4, "tokens": 16, "score": 4.0,
                                 "tiers": {"GPU": {"blocks": 4, "tokens": 16}, "CPU": {"blocks": 0, "tokens": 0},
                                           "STORAGE": {"blocks": 0, "tokens": 0}}}
    assert r["workers"]["b"]["score"] == pytest.approx(3.2) and r["stale"] is False
    h.publish("a", [remove(1, P1, BS, [1])])
    h.converge(P1, P2)
    assert h.score(P1)["workers"]["a"]["blocks"] == 1
    assert h.metric("kvslots_indexer_block_events_total", None) == 0  # labelled only
    assert h.service.metrics.registry.get_sample_value(
        "kvslots_indexer_block_events_total", {"worker": "a", "kind": "stored"}) == 6


def test_an_ipv6_worker_is_subscribed_and_healed_by_replay(harness, capsys):
    """A worker registered at tcp://[::1]:PORT: its live stream and a gap healed over its replay
    socket reach the index like an IPv4 worker's."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        with capsys.disabled():
            print(f"\nskipped: no IPv6 loopback here ({e})")
        pytest.skip(f"no IPv6 loopback: {e}")
    h = harness(("a",), host="[::1]")
    assert h.pubs["a"].endpoint.startswith("tcp://[::1]:")
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.publish("a", [store(1, P2, BS, start=2)], drop=True)  # lost on the way: replayed
    h.publish("a", [store(1, P3, BS)])
    h.converge(P1, P2, P3)
    assert h.score(P2)["workers"]["a"]["blocks"] == 4
    assert h.pubs["a"].replays_served >= 1


def test_dropped_messages_healed_by_replay(harness):
    h = harness()
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.publish("a", [remove(1, P1, BS, [3])], drop=True)
    h.publish("a", [store(1, P3, BS)], drop=True)
    h.publish("a", [store(1, P2, BS, start=2)])
    h.converge(P1, P2, P3)
    assert h.stream("a")["gaps"] == 1
    assert h.metric("kvslots_indexer_gaps_total", "a") == 1
    assert h.metric("kvslots_indexer_unhealed_gaps_total", "a") == 0


def test_unhealable_gap_drops_what_may_be_stale(harness):
    h = harness(buffer_a=2)
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    # Lost, and gone from the publisher's 2-batch buffer by the time the gap shows:
    h.publish("a", [remove(1, P1, BS, [0, 1, 2, 3])], drop=True)
    h.publish("a", [], drop=True)
    h.publish("a", [store(1, P3, BS)], drop=True)
    h.publish("a", [store(1, P2, BS)])
    # P1's removal was lost for good; the index must not go on claiming P1 (it rebuilt a from
    # what the publisher still buffers: the last two batches).
    h.converge(P1, P2, P3)
    assert h.stream("a")["unhealed_gaps"] == 1
    assert h.metric("kvslots_indexer_resets_total", "a") == 1


def test_publisher_restart_drops_old_entries(harness):
    h = harness()
    settle(h, "a")
    for _ in range(5):
        h.publish("a", [], model=False)
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    h.pubs["a"].restart()
    h.oracle.clear("a")
    # The new publisher starts again at seq 0; the subscriber sees the sequence go back.
    wait_for(lambda: h.publish("a", [], model=False) is not None and h.stream("a")["resets"] >= 1, 5,
             "the restart to be noticed")
    h.publish("a", [store(1, P3, BS)])
    h.converge(P1, P3)
    assert h.stream("a")["resets"] >= 1


def test_restarted_publisher_already_past_our_seq(harness):
    h = harness()
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    last = h.stream("a")["last_live_seq"]
    h.pubs["a"].restart()
    h.oracle.clear("a")
    # The new process publishes more than we had seen before we reconnect (lost on the way,
    # still in its replay buffer): its seq is already past ours, so only the lost connection
    # tells us its blocks are not the old process's.
    for _ in range(last + 3):
        h.publish("a", [], drop=True, model=False)
    h.publish("a", [store(1, P3, BS)], drop=True)
    wait_for(lambda: h.publish("a", [], model=False) is not None and h.stream("a")["resets"] >= 1, 5,
             "the reconnect to be noticed")
    h.converge(P1, P3)


def test_malformed_frames_are_counted_and_skipped(harness):
    h = harness()
    settle(h, "a")
    pub = h.pubs["a"]
    pub.send_frames([b"", b"only two"])
    pub.send_frames([b"", b"\x00\x01", b"payload"])  # 2-byte seq
    pub.publish_raw(b"\xc1 not msgpack")  # a real seq, garbage payload
    pub.publish_raw(b"\x92\x00\x00")  # msgpack, not a batch
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    assert h.metric("kvslots_indexer_malformed_frames_total", "a") == 4
    assert h.stream("a")["gaps"] == 0  # the bad payloads still advanced the sequence


def test_a_frame_past_max_frame_mb_is_dropped_reopened_and_counted(harness):
    """max_frame_mb reaches the subscription: a 2 MiB frame to an indexer bounded at 1 MiB drops
    the connection before it is buffered; the indexer reopens it (counted in /workers and the
    metrics), resets the worker as after any reconnect, and what follows is indexed."""
    h = harness(max_frame_mb=1)
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    h.pubs["a"].publish_raw(b"\x00" * (2 * 2**20))
    h.oracle = Oracle()  # the reset drops the worker's entries; the rebuild comes from what follows
    h.oracle.add_worker("a", "GPU")
    wait_for(lambda: h.stream("a")["reopened"] >= 1, 10, "the dropped connection to be reopened")
    assert h.metric("kvslots_indexer_reopened_connections_total", "a") >= 1
    # published until the reopened connection delivers (ZMQ's slow joiner again)
    wait_for(lambda: h.publish("a", [store(3, P3, BS)], model=False) is not None
             and h.score(P3)["workers"].get("a", {}).get("blocks") == 3, 10, "a batch after the big frame")
    assert h.stream("a")["malformed"] == 0
    assert h.service.sub.status()["a"]["resets"] >= 1


@pytest.mark.parametrize("value", [0, -1, 4097, 2**70, 1.5, "64", True, None])
def test_max_frame_mb_is_checked(value, tmp_path):
    with pytest.raises(ConfigError, match="max_frame_mb"):
        IndexerConfig(max_frame_mb=value).validate()
    f = tmp_path / "idx.yaml"
    f.write_text(f"max_frame_mb: {value!r}\n" if not isinstance(value, str) else f"max_frame_mb: '{value}'\n")
    with pytest.raises(ConfigError, match="max_frame_mb"):
        build_config(argparse.Namespace(config=str(f)))


def test_max_frame_mb_from_the_file_and_the_flag(tmp_path):
    f = tmp_path / "idx.yaml"
    f.write_text("max_frame_mb: 8\n")
    assert build_config(argparse.Namespace(config=str(f))).max_frame_mb == 8
    assert build_config(argparse.Namespace(config=str(f), max_frame_mb=16)).max_frame_mb == 16
    assert build_config(argparse.Namespace()).max_frame_mb == 64


def test_duplicate_store_and_remove(harness):
    h = harness()
    settle(h, "a")
    h.publish("a", [store(1, P1, BS), store(1, P1, BS)])
    h.publish("a", [store(1, P1, BS, medium="CPU")])
    h.publish("a", [remove(1, P1, BS, [2]), remove(1, P1, BS, [2])])
    h.converge(P1)
    assert h.score(P1)["workers"]["a"]["tiers"]["CPU"]["blocks"] == 4
    assert h.score(P1)["workers"]["a"]["tiers"]["GPU"]["blocks"] == 2


def test_stream_tier_and_all_blocks_cleared(harness):
    h = harness(("gpu", "host"), tiers={"host": "CPU"})
    settle(h, "gpu")
    settle(h, "host")
    h.publish("gpu", [store(1, P1, BS), store(1, P1, BS, medium="CPU")])
    h.publish("host", [store(2, P1, BS)])
    h.converge(P1)
    assert h.score(P1)["workers"]["host"]["tiers"]["CPU"]["blocks"] == 4
    h.publish("gpu", [AllBlocksCleared()])  # clears GPU only: the CPU copy stays
    h.converge(P1)
    assert h.score(P1)["workers"]["gpu"]["score"] == pytest.approx(3.2)


def test_late_indexer_learns_from_replay_buffer():
    pub = TestPublisher()
    try:
        pub.publish([store(1, P1, BS)])
        pub.publish([store(1, P2, BS, start=2)])
        oracle = Oracle()
        oracle.add_worker("a")
        oracle.apply("a", [store(1, P1, BS), store(1, P2, BS, start=2)])
        h = Harness({"a": pub})
        h.oracle = oracle
        try:
            # The initial replay ran before start() returned: no waiting needed.
            assert score_view(h.score(P2)) == oracle.lookup(P2, BS)
            assert h.stream("a")["applied_seq"] == 1
        finally:
            h.client.close()
            h.service.stop()
    finally:
        pub.close()


# ---- HTTP surface ----

def test_admin_api_is_off_without_a_token(harness):
    h = harness()
    r = h.client.post("/workers", json={"name": "x", "endpoint": "tcp://127.0.0.1:1"})
    assert r.status_code == 403 and "admin API is off" in r.json()["detail"]
    assert h.client.delete("/workers/a").status_code == 403


def test_admin_api_with_a_token(harness):
    h = harness(admin_token=TOKEN)
    extra = TestPublisher()
    try:
        body = {"name": "b", "endpoint": extra.endpoint, "replay": extra.replay_endpoint}
        assert h.client.post("/workers", json=body).status_code == 401
        r = h.client.post("/workers", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = h.client.post("/workers", json=body, headers=auth)
        assert r.status_code == 201, r.text
        assert h.client.post("/workers", json=body, headers=auth).status_code == 409
        bad = {"name": "c d", "endpoint": "http://x"}
        assert h.client.post("/workers", json=bad, headers=auth).status_code == 422
        assert [w["name"] for w in h.client.get("/workers").json()] == ["a", "b"]
        h.pubs["b"] = extra
        h.oracle.add_worker("b")
        settle(h, "b")
        h.publish("b", [store(5, P1, BS)])
        h.converge(P1)
        assert h.client.delete("/workers/b", headers=auth).status_code == 204
        assert h.client.delete("/workers/b", headers=auth).status_code == 404
        assert "b" not in h.score(P1)["workers"]
        assert h.service.backend.index.stats()["entries"] == 0
    finally:
        h.pubs.pop("b", None)
        extra.close()


def test_request_limits(harness):
    h = harness(max_tokens=64)
    c = h.client
    r = c.post("/score", json={"token_ids": list(range(65))})  # the first 64 scored
    assert r.status_code == 200 and r.json()["truncated"] is True and r.json()["prompt_blocks"] == 16
    r = c.post("/score", content=b"[" + b"1," * 100_000 + b"1]", headers={"content-type": "application/json"})
    assert r.status_code == 413
    def chunks():
        for _ in range(200):
            yield b"1," * 100
    r = c.post("/score", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert c.post("/score", json={"token_ids": [1, -1]}).status_code == 422
    assert c.post("/score", json={"token_ids": [2**32]}).status_code == 422
    assert c.post("/score", json={"token_ids": [1], "block_size": 0}).status_code == 422
    assert c.post("/score", json={"token_ids": [1], "surprise": 1}).status_code == 422
    assert c.post("/score", content=b"{", headers={"content-type": "application/json"}).status_code == 422
    r = c.post("/score", json={"token_ids": list(range(10))})
    assert r.status_code == 200 and r.json()["prompt_blocks"] == 2


def test_health_metrics_docs(harness):
    h = harness()
    settle(h, "a")
    h.publish("a", [store(1, P1, BS)])
    h.converge(P1)
    r = h.client.get("/healthz")
    assert r.status_code == 200 and r.json()["ok"] is True and r.json()["backend"] == "memory"
    text = h.client.get("/metrics").text
    for name in ("kvslots_indexer_events_applied_total", "kvslots_indexer_gaps_total",
                 "kvslots_indexer_replays_total", "kvslots_indexer_malformed_frames_total",
                 "kvslots_indexer_index_entries", "kvslots_indexer_lookup_seconds_bucket"):
        assert name in text, name
    spec = h.client.get("/openapi.json").json()
    assert {"/score", "/workers", "/workers/{name}", "/healthz", "/metrics"} <= set(spec["paths"])
    w = h.client.get("/workers").json()[0]
    assert w["name"] == "a" and w["stream"]["applied_seq"] >= 1


def test_cli_worker_specs_and_config(tmp_path):
    s = WorkerSpec.parse("w1=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,topic=kv,tier=cpu")
    assert (s.name, s.replay, s.topic, s.tier) == ("w1", "tcp://10.0.0.1:5558", "kv", "CPU")
    for bad in ("w1", "w1=http://x", "w1=tcp://x:1,color=red", "w 1=tcp://x:1", "w=tcp://x:1,tier=HBM"):
        with pytest.raises(ConfigError):
            WorkerSpec.parse(bad)
    f = tmp_path / "idx.yaml"
    f.write_text("workers:\n  - {name: y, endpoint: 'tcp://h:1', tier: storage}\n"
                 "tier_weights: {cpu: 0.5}\ncapacity: 100\nport: 9000\n")
    args = argparse.Namespace(config=str(f), worker=["z=tcp://h:2"], tier_weight=["GPU=2"], port=9100,
                              capacity=None, admin_token=None, admin_token_file=None)
    cfg = build_config(args)
    assert [w.name for w in cfg.workers] == ["y", "z"] and cfg.workers[0].tier == "STORAGE"
    assert cfg.tier_weights == {"GPU": 2.0, "CPU": 0.5, "STORAGE": 0.5}
    assert (cfg.capacity, cfg.port, cfg.host) == (100, 9100, "127.0.0.1")
    with pytest.raises(ConfigError, match="twice"):
        build_config(argparse.Namespace(worker=["a=tcp://h:1", "a=tcp://h:2"]))
    with pytest.raises(ConfigError, match="16 characters"):
        build_config(argparse.Namespace(admin_token="short"))


def test_cli_process_serves_and_shuts_down():
    import signal
    import subprocess
    import sys

    import httpx
    from indexer_support import free_port

    pub = TestPublisher(topic="kv")
    port = free_port()
    proc = None
    try:
        pub.publish([store(1, P1, BS)])
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvslots", "indexer", "--port", str(port), "--block-size", str(BS),
             "--worker", f"w0={pub.endpoint},replay={pub.replay_endpoint},topic=kv", "--log-level", "info"],
            stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(url + "/healthz", timeout=0.5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the indexer to listen")
        r = httpx.post(url + "/score", json={"token_ids": P1}).json()
        assert r["workers"]["w0"]["blocks"] == 4  # learnt from the publisher's replay buffer
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        assert "Application shutdown complete" in proc.stderr.read()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pub.close()


# ---- robustness: workers that cannot be subscribed, concurrent admin calls, the CLI ----

GOOD_ENDPOINTS = ["tcp://10.0.0.5:5557", "tcp://h-1.example.com:65535", "tcp://[::ffff:127.0.0.1]:5557",
                  "tcp://[::1]:5557", "tcp://[fd00::5]:1",
                  "ipc:///tmp/kvslots.sock", "ipc://@abstract", "inproc://events", "ipc://" + "a" * 107]
BAD_ENDPOINTS = ["tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "tcp://:::", "tcp://a:b",
                 "tcp://*:5557", "tcp://[::]:5557", "tcp://[::ffff:0.0.0.0]:1", "tcp://[::1", "tcp://1.2.3.256:1", "ipc://", "ipc://*",
                 "ipc://" + "a" * 108, "inproc://", "tcp://h:1\x00", "udp://h:1"]


@pytest.mark.parametrize("endpoint", GOOD_ENDPOINTS)
def test_endpoint_rule_accepts(endpoint):
    assert WorkerSpec.parse(f"w=tcp://other-host:1,replay={endpoint}").replay == endpoint  # (replay: not the endpoint)
    assert WorkerSpec.from_dict({"name": "w", "endpoint": endpoint}).endpoint == endpoint


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_endpoint_rule_is_one_for_cli_yaml_and_http(endpoint, tmp_path):
    for make in (lambda: WorkerSpec.parse(f"w={endpoint}"),
                 lambda: WorkerSpec.parse(f"w=tcp://h:1,replay={endpoint}"),
                 lambda: WorkerSpec.from_dict({"name": "w", "endpoint": endpoint}),
                 lambda: WorkerSpec("w", "tcp://h:1", replay=endpoint)):
        with pytest.raises(ConfigError, match="worker 'w': (endpoint|replay) "):
            make()
    f = tmp_path / "idx.yaml"
    f.write_text(f"workers:\n  - {{name: w, endpoint: {endpoint!r}}}\n".replace("\x00", "\\0"))
    with pytest.raises(ConfigError, match="endpoint"):
        build_config(argparse.Namespace(config=str(f)))


def test_subscription_failure_leaves_nothing(harness, monkeypatch, caplog):
    import errno
    import logging

    import zmq

    h = harness(admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    svc = h.service

    def state():
        return (h.client.get("/workers").json(), sorted(svc.backend.index.workers()), sorted(svc._subscribed),
                sorted(svc.sub.status()))

    before = state()
    real_add = svc.sub.add
    body = {"name": "x", "endpoint": "tcp://127.0.0.1:1"}
    for exc, status, says in ((zmq.ZMQError(errno.EINVAL), 422, "cannot subscribe"),  # the address: the client's fault
                              (zmq.ZMQError(errno.EMFILE), 503, "out of file descriptors"),  # the server's limit
                              (RuntimeError("boom"), 503, "RuntimeError")):
        def failing_add(spec, exc=exc):
            if spec.name == "x":
                raise exc
            return real_add(spec)

        monkeypatch.setattr(svc.sub, "add", failing_add)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvslots.indexer"):
            r = h.client.post("/workers", json=body, headers=auth)
        assert r.status_code == status, r.text
        assert isinstance(r.json()["detail"], str) and "\n" not in r.json()["detail"] and says in r.json()["detail"]
        # Out of descriptors is one line in the log, not a traceback per add.
        assert any(rec.exc_info for rec in caplog.records) == (says == "RuntimeError"), caplog.records
        assert state() == before
    monkeypatch.setattr(svc.sub, "add", real_add)
    r = h.client.post("/workers", json=body, headers=auth)  # the name is free again
    assert r.status_code == 201, r.text
    assert "x" in svc._subscribed and "x" in svc.backend.index.workers()


def test_concurrent_add_and_remove_stay_consistent():
    import random
    import threading

    pub = TestPublisher()
    svc = IndexerService(IndexerConfig(replay_timeout=0.3))
    svc.start()
    try:
        names = ("x", "y")
        specs = {n: WorkerSpec(n, pub.endpoint, pub.replay_endpoint) for n in names}
        rng = random.Random(0)

        def hammer(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(40):
                n = r.choice(names)
                if r.random() < 0.5:
                    svc.add_worker(specs[n])
                else:
                    svc.remove_worker(n)

        for _ in range(30):
            threads = [threading.Thread(target=hammer, args=(rng.random(),)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            registered = set(svc.backend.specs())
            assert set(svc._subscribed) == registered
            assert set(svc.backend.index.workers()) == registered
            assert set(svc.sub.status()) == registered
    finally:
        svc.stop()
        pub.close()


def _cli(argv, capsys) -> tuple[int, str]:
    from kvslots import cli

    capsys.readouterr()
    code = cli.main(["indexer", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, problem", [
    (["--worker", "a=tcp://127.0.0.1"], "port in 1-65535"),
    (["--worker", "a=tcp://h:1,replay=tcp://h"], "replay"),
    (["--backend", "redis", "--redis-url", "notaurl"], "redis_url 'notaurl'"),
    (["--backend", "redis", "--redis-url", "redis://127.0.0.1:abc/0"], "Port could not be cast"),
    (["--backend", "redis", "--redis-url", "redis://h:1/0?nope=1"], "nope"),
    (["--redis-namespace", "*"], "redis namespace"),
    (["--redis-namespace", "a:k:b"], "redis namespace"),
    (["--tier-weight", "GPU=1e308"], "tier weight GPU"),
    (["--tier-weight", "CPU=-1"], "tier weight CPU"),
    (["--capacity", "-1"], "capacity -1"),
    (["--host", "no-such-host.invalid"], "cannot resolve"),
    (["--admin-token", "\u00e9" * 20], "printable ASCII"),
    (["--config", ""], "an empty path names no file"),  # was ignored: the defaults served
    (["--admin-token-file", ""], "an empty path names no file"),  # was ignored: no token, admin off
    (["--admin-token", ""], "gave an empty token"),  # was the environment's or the YAML's token
])
def test_cli_errors_are_one_line(argv, problem, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2, err
    assert err.startswith("kvslots indexer: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert problem in err, err


@pytest.mark.parametrize("argv, problem", [
    (["--host", ""], "give an address to bind"),  # bound every address, silently
    (["--worker", "a=tcp://h:1,tier=GPU,tier=CPU"], "tier= given twice"),  # was the last one, silently
    (["--worker", "a=tcp://h:1,replay=tcp://h:2,replay=tcp://h:3"], "replay= given twice"),
    (["--tier-weight", "GPU=1", "--tier-weight", "gpu=2"], "tier GPU is given twice"),
])
def test_cli_settings_once_taken_silently_are_one_line(argv, problem, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    code, err = _cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and problem in err, err


def test_an_empty_admin_token_file_is_refused_not_replaced(tmp_path, monkeypatch, capsys):
    (tmp_path / "token").write_text(" \n")
    monkeypatch.setenv("KVSLOTS_INDEXER_ADMIN_TOKEN", TOKEN)  # would have been taken instead
    code, err = _cli(["--admin-token-file", str(tmp_path / "token")], capsys)
    assert code == 2 and "gave an empty token" in err and err.count("\n") == 1, err


#: Redis URL options redis-py parses but does not check: each was a ValueError / TypeError /
#: OverflowError when connecting, and every HTTP route a 500.
BAD_REDIS_URL_OPTIONS = ["socket_timeout=nan", "socket_timeout=-1", "socket_timeout=0", "socket_timeout=inf",
                         "socket_timeout=1e300", "socket_connect_timeout=nan", "socket_connect_timeout=-1",
                         "socket_connect_timeout=0", "health_check_interval=-5", "socket_read_size=0",
                         "socket_read_size=-1", "retry_on_error=abc"]


@pytest.mark.parametrize("option", BAD_REDIS_URL_OPTIONS)
def test_redis_url_option_values_are_checked_up_front(option, capsys):
    from kvslots.indexer import IndexerConfig, IndexerService

    url = f"redis://user:hunter2@127.0.0.1:1/0?{option}"
    key = option.partition("=")[0]
    code, err = _cli(["--backend", "redis", "--redis-url", url], capsys)
    assert code == 2 and err.count("\n") == 1 and f": {key}=" in err and "hunter2" not in err, err
    with pytest.raises(ConfigError, match=f"redis_url .*{key}="):  # a config built in code, too
        IndexerService(IndexerConfig(backend="redis", redis_url=url))


@pytest.mark.parametrize("url", ["redis://h:1/-1", "unix:///tmp/r.sock?db=-2"])
def test_redis_url_negative_db_is_refused(url, capsys):
    code, err = _cli(["--backend", "redis", "--redis-url", url], capsys)
    assert code == 2 and "db=-" in err, err


@pytest.mark.parametrize("url, problem", [
    ("redis://h:1/0?protocol=9", "protocol must be either 2 or 3"),  # a redis ConnectionError: a traceback, exit 1
    ("redis://h:1/abc", "the path '/abc' is not /DB"),  # was db 0, silently
    ("redis://h:1/1/2", "the path '/1/2' is not /DB"),  # was db 12
    ("redis://user:hunter2@h:1/x", "the path '/x' is not /DB"),
    ("redis://h:1/0?socket_timeout=1&socket_timeout=2", "socket_timeout given twice"),  # was the first
    ("redis://h:1?db=1&db=2", "db given twice"),
])
def test_redis_url_odd_path_protocol_or_twice_given_option_is_one_line(url, problem, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    code, err = _cli(["--backend", "redis", "--redis-url", url], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and problem in err, err
    assert "hunter2" not in err, err


@pytest.mark.parametrize("url", ["redis://" + "a" * 64 + ":1/0", "redis://a..b:1/0", "redis://.:1/0", "redis://%ff:1/0",
                                 "redis://\udcff:1/0"])
def test_redis_url_host_the_socket_module_cannot_encode_is_refused(url, capsys, monkeypatch):
    # Each passed the check, and the indexer started: every Redis call was a UnicodeError from
    # the IDNA codec (not a redis error), every HTTP route a 500, a traceback logged each tick.
    import uvicorn

    from kvslots.indexer import IndexerConfig, IndexerService

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    code, err = _cli(["--backend", "redis", "--redis-url", url], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not a host name" in err, err
    with pytest.raises(ConfigError, match="is not a host name"):
        IndexerService(IndexerConfig(backend="redis", redis_url=url))


def test_redis_url_port_0_is_refused(capsys):
    # redis-py took port 0 for its default, 6379: a server nobody named.
    code, err = _cli(["--backend", "redis", "--redis-url", "redis://h:0/0"], capsys)
    assert code == 2 and err.count("\n") == 1 and "port 0" in err, err


def test_redis_url_good_options_pass():
    from kvslots.indexer.config import check_redis_url

    check_redis_url("redis://h:1/0?socket_timeout=2.5&socket_connect_timeout=1&health_check_interval=0"
                    "&socket_read_size=65536&max_connections=4")
    check_redis_url("unix:///tmp/r.sock?db=3")
    for url in ("redis://h:1", "redis://h:1/", "rediss://h:1/15?protocol=3", "redis://[::1]:1/0", "redis://\u00e9.example:1",
                "redis:///0", "redis://" + "a" * 63 + ".b:1"):
        check_redis_url(url)


def test_cli_redis_url_error_hides_the_password(capsys):
    code, err = _cli(["--backend", "redis", "--redis-url", "redis://user:hunter2@h:abc/0"], capsys)
    assert code == 2 and "hunter2" not in err and "***" in err, err


def test_cli_port_in_use_is_one_line(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = _cli(["--port", str(port)], capsys)
    assert code == 2 and err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err


def test_cli_bad_worker_process_exits_2_without_a_traceback():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvslots", "indexer", "--worker", "a=tcp://127.0.0.1", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_capacity_zero_means_no_limit_everywhere(tmp_path):
    f = tmp_path / "idx.yaml"
    f.write_text("capacity: 0\n")
    assert build_config(argparse.Namespace(config=str(f))).capacity is None
    assert build_config(argparse.Namespace(capacity=0)).capacity is None
    f.write_text("capacity: -5\n")
    with pytest.raises(ConfigError, match="capacity"):
        build_config(argparse.Namespace(config=str(f)))


def test_tier_weights_are_bounded(tmp_path):
    assert build_config(argparse.Namespace(tier_weight=["GPU=1e6"])).tier_weights["GPU"] == 1e6
    for bad in ("GPU=1000000.5", "GPU=1e308", "CPU=-0.1", "CPU=nan", "CPU=inf"):
        with pytest.raises(ConfigError, match="tier weight"):
            build_config(argparse.Namespace(tier_weight=[bad]))
    f = tmp_path / "idx.yaml"
    f.write_text("tier_weights: {STORAGE: 1.0e+300}\n")
    with pytest.raises(ConfigError, match="tier weight STORAGE"):
        build_config(argparse.Namespace(config=str(f)))


def test_largest_tier_weight_keeps_scores_finite(harness):
    h = harness(tier_weights={"GPU": 1e6, "CPU": 1e6, "STORAGE": 1e6})
    settle(h, "a")
    h.pubs["a"].publish([store(1, P1, BS)])
    wait_for(lambda: h.score(P1)["workers"]["a"]["blocks"] == 4, 5, "applied")
    assert h.score(P1)["workers"]["a"]["score"] == 4e6


def test_admin_token_must_be_printable_ascii():
    for bad in ("\u00e9" * 16, "x" * 16 + "\n", " " + "x" * 16, "x" * 8 + "\x00" + "x" * 8):
        with pytest.raises(ConfigError, match="admin token"):
            build_config(argparse.Namespace(admin_token=bad))
    assert build_config(argparse.Namespace(admin_token="a-Valid_token.0123+/=")).admin_token == "a-Valid_token.0123+/="


@pytest.mark.parametrize("weights", ["{gpu: 1, GPU: 2}", "{CPU: 0.5, cpu: 0.8}", "{Storage: 1, STORAGE: 1}"])
def test_config_tier_given_twice_is_refused(tmp_path, capsys, weights):
    # Case-folded, the second silently replaced the first.
    f = tmp_path / "idx.yaml"
    f.write_text(f"tier_weights: {weights}\n")
    code, err = _cli(["--config", str(f)], capsys)
    assert code == 2 and err.count("\n") == 1 and "given twice" in err and str(f) in err, err


# ---- file descriptors: more workers than the limit holds, the HTTP connection cap ----


def test_more_workers_than_the_fd_limit_holds_is_one_line_exit_2():
    # 300 workers under ulimit -n 256: the subscriptions failed with 'Too many open files' in
    # uvicorn's startup, a traceback and exit status 3.
    import resource
    import subprocess
    import sys

    workers = [x for i in range(300) for x in ("--worker", f"w{i}=tcp://127.0.0.1:{20000 + i}")]
    r = subprocess.run([sys.executable, "-m", "kvslots", "indexer", "--port", "0", *workers],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith("kvslots indexer: ") and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "file descriptors" in r.stderr and "256" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_out_of_fds_subscribing_at_start_is_one_line_exit_2(capsys, monkeypatch):
    # What the limit check cannot foresee (descriptors taken meanwhile): the first worker that
    # cannot be subscribed stops the start-up, as one line; the others are not tried (each
    # failed alike, a log line each).
    import errno

    import uvicorn

    from kvslots.errors import InvalidArgumentError
    from kvslots.indexer.subscription import Subscription

    tried = []

    def out_of_fds(self, spec):
        tried.append(spec.name)
        raise InvalidArgumentError(f"cannot connect to publisher {spec.name!r}: Too many open files",
                                   details={"errno": errno.EMFILE})

    monkeypatch.setattr(Subscription, "add", out_of_fds)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    code, err = _cli(["--port", "0", "--worker", "a=tcp://127.0.0.1:1", "--worker", "b=tcp://127.0.0.1:2"], capsys)
    assert code == 2 and err.startswith("kvslots indexer: ") and err.count("\n") == 1, err
    assert "worker 'a'" in err and "out of file descriptors (the limit, ulimit -n, is" in err, err
    assert tried == ["a"]


@pytest.mark.parametrize("value", ["0", "-1", str(2**20 + 1), "99999999999999999999"])
def test_max_connections_out_of_range_is_one_line(value, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    code, err = _cli(["--max-connections", value], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"max_connections {value}: must be an integer in [1, 1048576]" in err, err


@pytest.mark.parametrize("text", ["max_connections: 0", "max_connections: true", "max_connections: '8'",
                                  "max_connections: 1.5"])
def test_max_connections_in_the_file_is_checked(text, tmp_path):
    f = tmp_path / "idx.yaml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match="max_connections"):
        build_config(argparse.Namespace(config=str(f)))


@pytest.mark.parametrize("argv, cap", [(["--max-connections", "5"], 5), ([], None)])
def test_the_server_gets_the_connection_cap(argv, cap, capsys, monkeypatch):
    import uvicorn

    from kvslots.indexer import fds

    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: given.update(kw))
    monkeypatch.setattr(fds, "limit", lambda: 1000)
    monkeypatch.setattr(fds, "in_use", lambda: 20)
    code, err = _cli(["--port", "0", "--worker", "a=tcp://127.0.0.1:1", *argv], capsys)
    assert code == 0, err
    # By default, what the limit leaves: 1000 - 20 open - 64 spare - 6 for the one worker.
    assert given["http"].max_connections.value == (cap or 1000 - 20 - fds.SPARE - fds.FDS_PER_WORKER)


def test_default_max_connections_follows_the_fd_limit(monkeypatch):
    from kvslots.indexer import fds

    assert fds.in_use() >= 3  # stdin, stdout, stderr at least
    monkeypatch.setattr(fds, "in_use", lambda: 10)
    for soft, reserved, cap in ((1024, 100, 1024 - 10 - fds.SPARE - 100), (100, 100, fds.MIN_DEFAULT_CONNECTIONS),
                                (None, 0, fds.MAX_CONNECTIONS), (10**9, 0, fds.MAX_CONNECTIONS)):
        monkeypatch.setattr(fds, "limit", lambda soft=soft: soft)
        assert fds.default_max_connections(reserved) == cap


def test_the_connection_cap_follows_the_workers(monkeypatch):
    from kvslots.errors import OutOfDescriptorsError
    from kvslots.indexer import fds

    monkeypatch.setattr(fds, "limit", lambda: 200)
    monkeypatch.setattr(fds, "in_use", lambda: 20)
    room = 200 - 20 - fds.SPARE  # 116: connections' and workers' descriptors
    cap = fds.ConnectionCap(None, 2)
    assert cap.value == room - 2 * fds.FDS_PER_WORKER
    cap.reserve()  # a third worker: the cap is lowered before it is subscribed
    assert cap.value == room - 3 * fds.FDS_PER_WORKER
    cap.set_workers(3)
    cap.release()
    assert cap.value == room - 3 * fds.FDS_PER_WORKER
    # Workers fit while the connections keep at least MIN_DEFAULT_CONNECTIONS.
    most = (room - fds.MIN_DEFAULT_CONNECTIONS) // fds.FDS_PER_WORKER
    cap.set_workers(most - 1)
    cap.reserve()
    assert cap.value >= fds.MIN_DEFAULT_CONNECTIONS
    with pytest.raises(OutOfDescriptorsError, match=r"limit of 200 \(ulimit -n\) holds 16 workers") as e:
        cap.reserve("worker 'x'")
    assert e.value.errno == errno.EMFILE and str(e.value).startswith("worker 'x' would take 6 ")
    cap.release()
    cap.set_workers(0)  # removed: the connections get them back
    assert cap.value == room
    # An explicit cap is kept whatever the workers; one that would lose descriptors to them is refused.
    cap = fds.ConnectionCap(100, 0)
    assert cap.value == 100 and cap.workers_fit(2) and not cap.workers_fit(3)
    cap.set_workers(2)
    with pytest.raises(OutOfDescriptorsError, match="--max-connections 100"):
        cap.reserve()
    assert cap.value == 100
    monkeypatch.setattr(fds, "limit", lambda: None)  # no limit: nothing to keep
    cap = fds.ConnectionCap(None, 10**6)
    cap.reserve()
    assert cap.value == fds.MAX_CONNECTIONS


def test_workers_added_over_the_api_leave_the_connections_their_descriptors():
    """Under ulimit -n 128 the cap (58) was set once at start-up; 26 workers added over the API
    took the descriptors it counted on, and of 57 connections under it 3 were answered, the
    others closed unanswered. Now the adds that would take the connections' share are a 503
    saying so, the cap is lowered for those let in, and every connection gets an answer."""
    import http.client
    import json
    import os
    import re
    import resource
    import subprocess
    import sys
    import threading
    import time

    from ports import free_port

    token = "s3cret-s3cret-s3cret"
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvslots", "indexer", "--port", str(port), "--log-level", "info",
                          "--replay-timeout", "0.2"], env={**os.environ, "KVSLOTS_INDEXER_ADMIN_TOKEN": token},
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()

    def call(method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            c.request(method, path, body=body, headers={"authorization": f"Bearer {token}",
                                                        "content-type": "application/json"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    socks = []
    try:
        wait_for(lambda: p.poll() is not None or "HTTP connections at once" in "".join(lines), timeout=60)
        assert p.poll() is None, "".join(lines)[-3000:]
        cap = int(re.search(r"at most (\d+) HTTP connections", "".join(lines)).group(1))

        def up():
            try:
                return call("GET", "/healthz")[0] == 200
            except OSError:
                return False

        wait_for(up, timeout=30, what="the server")
        added = []
        for i in range(26):
            worker = {"name": f"w{i}", "endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "replay": f"tcp://127.0.0.1:{free_port()}"}
            status, body = call("POST", "/workers", json.dumps(worker))
            added.append(status)
            assert status in (201, 503), (status, body)
            if status == 503:
                assert b"set aside for HTTP connections" in body and b"128" in body, body
        assert 0 < added.count(201) < 26 and added.count(201) == added.index(503), added
        time.sleep(0.5)
        for _ in range(cap - 1):  # under the cap set at start-up: each is answered (200, or the cap's 503)
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        answers = []
        for s in socks:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                answers.append(s.recv(12)[9:12] or b"closed")
            except OSError as e:
                answers.append(type(e).__name__.encode())
        assert set(answers) <= {b"200", b"503"} and answers.count(b"200") >= 8, answers
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(2.5)  # the refused ones linger 2 s (httpguard.REFUSED_LINGER_S)
        # A worker removed gives its descriptors back: one more can be added.
        assert call("DELETE", "/workers/w0")[0] == 204
        again = {"name": "again", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
        status, body = call("POST", "/workers", json.dumps(again))
        assert status == 201, body
        assert call("GET", "/healthz")[0] == 200
    finally:
        for s in socks:
            s.close()
        p.terminate()
        p.wait(30)
