"""The P/D halves of the KVSlotsConnector without an engine: the hand-off parameters (hostile
ones included), the scheduler side's plans, and the worker side's holds, acks, timeouts and
pulls between two workers in one process (real Mooncake transport and TCP control channel on
loopback), with the faults: a producer restarted (another engine id), layouts that differ, a
hold that timed out before the pull ended, a producer that is gone."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvslots.errors import TransferError  # noqa: E402
from kvslots.vllm import ConnectorConfig, ConnectorConfigError  # noqa: E402
from kvslots.vllm.connector.pd import PDScheduler, PDStepMeta, PDWorker, RecvSpec, parse_remote_params  # noqa: E402
from kvslots.vllm.pd.control import control_call  # noqa: E402
from ports import free_port  # noqa: E402

BS = 32
NB = 16


@pytest.mark.parametrize("extra, named", [
    ({"pd_port": 0}, "pd_port"), ({"pd_port": 70000}, "pd_port"), ({"pd_port": "80"}, "pd_port"),
    ({"pd_port": True}, "pd_port"), ({"pd_host": "a:1"}, "pd_host"), ({"pd_host": ""}, "pd_host"),
    ({"pd_timeout_s": 0}, "pd_timeout_s"), ({"pd_timeout_s": float("nan")}, "pd_timeout_s"),
    ({"pd_timeout_s": "1"}, "pd_timeout_s"), ({"pd_timeout_s": 1e-300}, "pd_timeout_s"),
    ({"pd_timeout_s": 0.09}, "pd_timeout_s"),
])
def test_bad_pd_config_names_the_key(extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorConfig.from_extra_config(extra)


def _params(**over):
    p = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "127.0.0.1",
         "remote_port": 5000, "remote_block_ids": [4, 5, 6], "remote_block_size": BS, "num_tokens": 70}
    p.update(over)
    return p


@pytest.mark.parametrize("over", [
    {"remote_port": 0}, {"remote_port": "5000"}, {"remote_port": 1.5}, {"remote_block_ids": []},
    {"remote_block_ids": [1, -1]}, {"remote_block_ids": [1, True]}, {"remote_block_ids": "123"},
    {"remote_block_ids": [2**50]}, {"remote_host": ""}, {"remote_host": None}, {"remote_engine_id": 5},
    {"num_tokens": -3}, {"remote_block_size": 0}, {"remote_request_id": "x" * 600},
])
def test_hostile_handoff_is_a_transfer_error(over):
    with pytest.raises(TransferError) as ei:
        parse_remote_params(_params(**over))
    assert ei.value.kind == "layout"


def test_no_remote_prefill_is_none():
    assert parse_remote_params(None) is None
    assert parse_remote_params({"do_remote_decode": True}) is None
    assert parse_remote_params("junk") is None


def _req(rid, prompt_len, params, status=RequestStatus.WAITING):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(prompt_len)), kv_transfer_params=params,
                           status=status)


def _sched(**kw):
    return PDScheduler(engine_id="me", host="127.0.0.1", port=6000, block_size=BS, timeout_s=30.0,
                       producer=kw.get("producer", True), consumer=kw.get("consumer", True))


def test_consumer_plans_the_pull_after_a_local_hit():
    s = _sched()
    req = _req("d1", 70, _params(remote_block_ids=[4, 5, 6]))
    assert s.matched(req, 32) == (38, True)  # one block already here
    assert s.after_alloc(req, [10, 11, 12], 38)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    meta = s.build()
    (spec,) = meta.recvs
    assert (spec.remote_block_ids, spec.local_block_ids) == ([5, 6], [11, 12])
    assert s.build() is None
    assert s.matched(req, 0) is None  # one transfer per request


@pytest.mark.parametrize("over, why", [
    ({"remote_block_size": 16}, "block size"), ({"num_tokens": 69}, "computed"), ({"remote_block_ids": [1, 2]}, "blocks"),
])
def test_consumer_mismatch_computes_here_and_releases_the_producer(over, why, caplog):
    s = _sched()
    req = _req("d1", 70, _params(**over))
    assert s.matched(req, 0) == (0, False)
    assert why in caplog.text
    (spec,) = s.build().recvs
    assert spec.local_block_ids == [] and spec.remote_req_id == "r1"  # release only


def test_producer_holds_capped_requests_only():
    s = _sched()
    done = _req("p1", 70, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED)
    keep, params = s.request_finished(done, [7, 8, 9])
    assert keep and params["remote_block_ids"] == [7, 8, 9] and params["num_tokens"] == 70
    assert params["remote_request_id"] == "p1" and params["remote_port"] == 6000
    assert parse_remote_params(params)["remote_engine_id"] == "me"
    aborted = _req("p2", 70, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(aborted, [1]) == (False, None)
    plain = _req("p3", 70, None, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert s.request_finished(plain, [1]) == (False, None)
    assert s.build().holds == {"p1": 30.0}


def _caches(seed, layers=("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NB, 2, BS, 8, generator=g) for n in layers}


def _worker(producer, consumer, caches, *, engine_id, port=0, timeout_s=30.0, model="m"):
    w = PDWorker(engine_id=engine_id, host="127.0.0.1", port=port, block_size=BS, model=model, timeout_s=timeout_s,
                 producer=producer, consumer=consumer, control_timeout_s=3.0)
    w.register(caches, NB)
    return w


def _wait_finished(w, n=1, timeout=30.0):
    got = (set(), set(), set())
    deadline = time.time() + timeout
    while time.time() < deadline and len(got[1]) < n:
        s, r, f = w.take_finished()
        got = (got[0] | s, got[1] | r, got[2] | f)
        time.sleep(0.02)
    return got


@pytest.fixture
def pair():
    port = free_port()
    pc, dc = _caches(1), _caches(2)
    prod = _worker(True, False, pc, engine_id="P", port=port)
    cons = _worker(False, True, dc, engine_id="D")
    yield prod, cons, pc, dc, port
    cons.close()
    prod.close()


def _spec(port, req="d1", remote=(3, 4), local=(9, 10), engine="P", rreq="p1"):
    return RecvSpec(req, rreq, engine, "127.0.0.1", port, list(remote), list(local))


def test_pull_moves_all_layers_and_frees_the_producer(pair):
    prod, cons, pc, dc, port = pair
    prod.on_step(PDStepMeta(holds={"p1": 30.0}))
    assert prod.num_held() == 1
    cons.on_step(PDStepMeta(recvs=[_spec(port)]))
    _, recv, failed = _wait_finished(cons)
    assert recv == {"d1"} and not failed
    for name in pc:
        assert torch.equal(dc[name][[9, 10]], pc[name][[3, 4]]), name
    sending, _, _ = prod.take_finished()
    assert sending == {"p1"} and prod.num_held() == 0


def test_ack_before_the_hold_metadata_still_frees(pair):
    prod, cons, pc, dc, port = pair
    cons.on_step(PDStepMeta(recvs=[_spec(port)]))
    assert _wait_finished(cons)[1] == {"d1"}
    assert prod.take_finished()[0] == set()
    prod.on_step(PDStepMeta(holds={"p1": 30.0}))  # the hold arrives after the ack
    assert prod.take_finished()[0] == {"p1"} and prod.num_held() == 0


def test_release_only_is_not_reported_to_vllm(pair):
    prod, cons, _, _, port = pair
    prod.on_step(PDStepMeta(holds={"p1": 30.0}))
    cons.on_step(PDStepMeta(recvs=[_spec(port, remote=(), local=())]))
    deadline = time.time() + 20
    sending: set = set()
    while time.time() < deadline and not sending:
        sending = prod.take_finished()[0]
        time.sleep(0.02)
    assert sending == {"p1"}
    assert cons.take_finished() == (set(), set(), set())


def test_restarted_producer_fails_the_pull(pair):
    prod, cons, _, _, port = pair
    cons.on_step(PDStepMeta(recvs=[_spec(port, engine="P-before-restart")]))
    _, recv, failed = _wait_finished(cons)
    assert recv == failed == {"d1"}


@pytest.mark.parametrize("producer_kw, consumer_kw", [
    (dict(caches=lambda: _caches(1, layers=("a", "b"))), {}),  # another block layout
    (dict(model="llama/2L/draft=eagle"), dict(model="llama/2L/draft=none")),  # another model
], ids=["other_layout", "other_model"])
def test_a_mismatched_producer_fails_the_pull(producer_kw, consumer_kw):
    port = free_port()
    kw = dict(producer_kw)  # the parameter itself stays whole
    caches = kw.pop("caches", lambda: _caches(1))()
    prod = _worker(True, False, caches, engine_id="P", port=port, **kw)
    cons = _worker(False, True, _caches(2), engine_id="D", **consumer_kw)
    try:
        cons.on_step(PDStepMeta(recvs=[_spec(port)]))
        _, recv, failed = _wait_finished(cons)
        assert recv == failed == {"d1"}
    finally:
        cons.close()
        prod.close()


def test_hold_timeout_frees_and_a_late_pull_fails():
    port = free_port()
    prod = _worker(True, False, _caches(1), engine_id="P", port=port, timeout_s=0.2)
    cons = _worker(False, True, _caches(2), engine_id="D")
    try:
        prod.on_step(PDStepMeta(holds={"p1": 0.2}))
        time.sleep(0.4)
        assert prod.take_finished()[0] == {"p1"}  # freed by the timeout
        assert prod.stats["expired"] == 1
        cons.on_step(PDStepMeta(recvs=[_spec(port)]))
        _, recv, failed = _wait_finished(cons)
        assert recv == failed == {"d1"}  # the bytes may be stale: not used
    finally:
        cons.close()
        prod.close()


def test_gone_producer_fails_without_hanging():
    cons = _worker(False, True, _caches(2), engine_id="D")
    try:
        start = time.time()
        cons.on_step(PDStepMeta(recvs=[_spec(free_port())]))  # nobody listens there
        _, recv, failed = _wait_finished(cons, timeout=60)
        assert recv == failed == {"d1"}
        assert time.time() - start < 30
    finally:
        cons.close()


def test_control_channel_refuses_junk(pair):
    prod, _, _, _, port = pair
    with pytest.raises(TransferError, match="unknown op"):
        control_call("127.0.0.1", port, {"op": "format-disk"}, timeout_s=3)
    with pytest.raises(TransferError, match="done needs req"):
        control_call("127.0.0.1", port, {"op": "done", "req": 5}, timeout_s=3)
    assert control_call("127.0.0.1", port, {"op": "hello"}, timeout_s=3)["engine_id"] == "P"


def test_control_channel_bounds_a_hostile_peer(pair, monkeypatch):
    import socket
    import struct

    from kvslots.vllm.connector import pd as pd_mod
    from kvslots.vllm.pd import control

    prod, _, _, _, port = pair

    def raw(payload, wait_s=15.0):  # the suite runs this beside engines, whose threads spin
        with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
            s.sendall(struct.pack(">I", len(payload)) + payload)
            try:
                head = s.recv(4)
                return s.recv(1 << 20) if len(head) == 4 else None
            except OSError:
                return None

    # A request over the cap is dropped with its connection, unread and unanswered.
    assert raw(b"\x00" * (control.MAX_REQUEST_BYTES + 1), 2.0) is None
    assert b"RecursionError" in raw(b"\x91" * 60_000 + b"\xc0")  # deep nesting: an error reply
    # Acks for holds that never come are kept up to a bound, oldest dropped first.
    monkeypatch.setattr(pd_mod, "MAX_EARLY_ACKS", 50)
    for i in range(120):
        assert control_call("127.0.0.1", port, {"op": "done", "req": f"ghost{i}"}, timeout_s=3) == {"held": True}
    assert len(prod._early_acks) == 50 and "ghost119" in prod._early_acks and "ghost69" not in prod._early_acks
    assert control_call("127.0.0.1", port, {"op": "hello"}, timeout_s=3)["engine_id"] == "P"


def test_an_over_long_ack_is_refused_unstored(pair):
    # The early-ack store bounded the count, not the ids: 65,536 acks of 64 KiB ids held 4 GiB.
    from kvslots.vllm.connector import pd as pd_mod

    prod, _, _, _, port = pair
    long_id = "x" * (pd_mod.MAX_ID_CHARS + 1)
    with pytest.raises(TransferError, match="characters"):
        control_call("127.0.0.1", port, {"op": "done", "req": long_id}, timeout_s=3)
    assert long_id not in prod._early_acks and prod.stats["bad_acks"] == 1 and prod.stats["acks"] == 0
    longest = "y" * pd_mod.MAX_ID_CHARS  # as long as a hand-off's id may be: still taken
    assert control_call("127.0.0.1", port, {"op": "done", "req": longest}, timeout_s=3) == {"held": True}
    assert longest in prod._early_acks
    prod.on_step(PDStepMeta(holds={longest: 10.0}))  # its hold then is done at once
    assert longest in prod.take_finished()[0]


@pytest.mark.parametrize("reply", [b"\x81\xa2ok\xa2\xff\xfe", b"\x91" * 60_000 + b"\xc0", b"\xc1"],
                         ids=["bad_utf8", "deep", "malformed"])
def test_a_control_reply_that_does_not_decode_is_a_transfer_error(reply):
    import socket
    import struct
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def answer():
        conn, _ = srv.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(struct.pack(">I", len(reply)) + reply)
            conn.recv(1)  # until the caller closes

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(TransferError, match="does not decode") as e:
            control_call("127.0.0.1", port, {"op": "hello"}, timeout_s=5, retries=0)
        assert e.value.details["kind"] == "peer"
    finally:
        t.join(5)
        srv.close()
