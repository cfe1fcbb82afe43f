"""The P/D control channel with a shared secret: requests and replies carry an HMAC-SHA256 tag,
a server acts on no request without the right tag (its handler is not called), a caller takes
no reply without it; no secret and an address other than loopback is one warning at start.
Before, anyone who reached the port could ask for or release holds."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import msgspec
import pytest

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, TransferError
from kvslots.vllm.pd import control
from kvslots.vllm.pd.control import ControlServer, control_call

SECRET = b"0123456789abcdef-shared"
OTHER = b"fedcba9876543210-shared"


@pytest.fixture
def served():
    calls: list[dict] = []

    def handler(msg):
        calls.append(msg)
        return {"ok": msg.get("op")}

    srv = ControlServer("127.0.0.1", 0, handler, secret=SECRET)
    yield srv, calls
    srv.close()


def test_a_caller_with_the_secret_is_answered(served):
    srv, calls = served
    assert control_call("127.0.0.1", srv.port, {"op": "hello"}, timeout_s=5, secret=SECRET) == {"ok": "hello"}
    assert calls == [{"op": "hello"}] and srv.refused == 0


@pytest.mark.parametrize("secret", [None, OTHER], ids=["none", "another"])
def test_a_caller_without_the_secret_is_refused_and_nothing_is_done(served, secret, caplog):
    srv, calls = served
    caplog.set_level(logging.WARNING, logger=control.__name__)
    with pytest.raises(TransferError, match="not authenticated") as e:
        control_call("127.0.0.1", srv.port, {"op": "done", "req": "r"}, timeout_s=5, retries=0, secret=secret)
    assert e.value.details["kind"] == "peer"
    assert calls == [] and srv.refused == 1
    control_call("127.0.0.1", srv.port, {"op": "x"}, timeout_s=5, secret=SECRET)  # still serves
    assert len([r for r in caplog.records if "not authenticated" in r.getMessage()]) == 1


def raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(struct.pack(">I", len(payload)) + payload)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)


def test_a_tampered_or_short_request_is_refused(served):
    srv, calls = served
    body = msgspec.msgpack.encode({"op": "done", "req": "r"})
    tag = control._request_tag(SECRET, body)
    forged = msgspec.msgpack.encode({"op": "done", "req": "s"})
    for payload in (tag + forged, tag[:-1] + bytes([tag[-1] ^ 1]) + body, tag[:10], b"", body):
        reply = msgspec.msgpack.decode(raw(srv.port, payload))
        assert "not authenticated" in reply["error"]
    assert calls == [] and srv.refused == 5
    ok = raw(srv.port, tag + body)  # the same request, rightly tagged
    assert ok[:32] == control._reply_tag(SECRET, tag, ok[32:]) and msgspec.msgpack.decode(ok[32:]) == {"ok": "done"}


def test_a_reply_without_the_secret_is_refused_by_the_caller():
    # A server with no secret (or another party answering in its place): its reply has no tag.
    srv = ControlServer("127.0.0.1", 0, lambda m: {"held": True})
    try:
        with pytest.raises(TransferError, match="reply .* is not authenticated"):
            control_call("127.0.0.1", srv.port, {"op": "done", "req": "r"}, timeout_s=5, retries=0, secret=SECRET)
    finally:
        srv.close()


def test_a_reply_tagged_for_another_request_is_refused():
    # A reply recorded for one request sent back for another (a replayed 'held: True').
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    old_body = msgspec.msgpack.encode({"held": True})
    old = control._reply_tag(SECRET, control._request_tag(SECRET, b"another request"), old_body) + old_body

    def serve():
        c, _ = lst.accept()
        with c:
            (n,) = struct.unpack(">I", c.recv(4, socket.MSG_WAITALL))
            c.recv(n, socket.MSG_WAITALL)
            c.sendall(struct.pack(">I", len(old)) + old)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(TransferError, match="not authenticated"):
            control_call("127.0.0.1", lst.getsockname()[1], {"op": "done", "req": "r"}, timeout_s=5, retries=0,
                         secret=SECRET)
    finally:
        t.join(5)
        lst.close()


def test_identical_requests_have_their_own_tags_and_an_old_reply_is_no_reply(monkeypatch, served):
    # A request's bytes were always the same ({"op": "hello"}), so its tag was too: a reply
    # captured for one hello (an old Mooncake session) was a valid reply to every later hello.
    frames: list[bytes] = []
    real = control._exchange

    def exchange(host, port, frame, deadline):
        frames.append(frame)
        return real(host, port, frame, deadline)

    monkeypatch.setattr(control, "_exchange", exchange)
    srv, calls = served
    for _ in range(2):
        assert control_call("127.0.0.1", srv.port, {"op": "hello"}, timeout_s=5, secret=SECRET) == {"ok": "hello"}
    assert calls == [{"op": "hello"}] * 2  # the nonce is the tags' business, not the handler's
    assert frames[0][4:4 + control.TAG_BYTES] != frames[1][4:4 + control.TAG_BYTES]
    old = real("127.0.0.1", srv.port, frames[0], time.monotonic() + 5)  # a replay is answered (no nonce remembered) ...
    monkeypatch.setattr(control, "_exchange", lambda *a: old)
    with pytest.raises(TransferError, match="not authenticated"):  # ... and that answer is no one else's
        control_call("127.0.0.1", srv.port, {"op": "hello"}, timeout_s=5, secret=SECRET)


@pytest.mark.parametrize("bad, err", [("text-secret-0123456789", ArgumentTypeError), (b"short", InvalidArgumentError),
                                      (12345678901234567890, ArgumentTypeError)])
def test_a_bad_secret_is_refused_before_anything(bad, err):
    with pytest.raises(err):
        ControlServer("127.0.0.1", 0, lambda m: {}, secret=bad)
    with pytest.raises(err):
        control_call("127.0.0.1", 1, {"op": "x"}, timeout_s=1, secret=bad)


@pytest.mark.parametrize("host, secret, warned", [("0.0.0.0", None, True), ("127.0.0.1", None, False),
                                                  ("0.0.0.0", SECRET, False)])
def test_one_warning_when_unauthenticated_beyond_loopback(host, secret, warned, caplog):
    caplog.set_level(logging.WARNING, logger=control.__name__)
    srv = ControlServer(host, 0, lambda m: {}, secret=secret)
    srv.close()
    said = [r.getMessage() for r in caplog.records if "not authenticated" in r.getMessage()]
    assert len(said) == int(warned), said
    assert all("\n" not in m and "KVSLOTS_PD_SECRET" in m for m in said)


def test_the_workers_take_the_secret_from_the_environment(monkeypatch):
    pytest.importorskip("vllm", reason="the connector's package imports vLLM")
    from kvslots.config.connector import ConnectorConfigError
    from kvslots.vllm.connector import pd

    monkeypatch.delenv(pd.SECRET_ENV, raising=False)
    assert pd.pd_secret() is None
    monkeypatch.setenv(pd.SECRET_ENV, SECRET.decode())
    assert pd.pd_secret() == SECRET
    monkeypatch.setenv("MY_PD_SECRET", OTHER.decode())
    assert pd.pd_secret("MY_PD_SECRET") == OTHER
    monkeypatch.setenv(pd.SECRET_ENV, "short")
    with pytest.raises(ConnectorConfigError, match="at least 16"):
        pd.pd_secret()
    for bad in ("", "A=B", "a\0b", "\ud800", 5):
        with pytest.raises(ConnectorConfigError, match="pd_secret_env"):
            pd.pd_secret(bad)


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_a_variable_pd_secret_env_names_must_be_set(monkeypatch, value):
    # It silently meant no secret (a typo, or not exported to one worker): unauthenticated,
    # with no warning on a consumer or on loopback. Unset means off for KVSLOTS_PD_SECRET only.
    pytest.importorskip("vllm", reason="the connector's package imports vLLM")
    from kvslots.config.connector import ConnectorConfigError
    from kvslots.vllm.connector import pd

    monkeypatch.setenv(pd.SECRET_ENV, SECRET.decode())  # another variable's secret is not taken
    if value is None:
        monkeypatch.delenv("MY_PD_SECRT", raising=False)
    else:
        monkeypatch.setenv("MY_PD_SECRT", value)
    with pytest.raises(ConnectorConfigError, match=r"pd_secret_env names \$MY_PD_SECRT, which is not set or empty"):
        pd.pd_secret("MY_PD_SECRT")
    monkeypatch.delenv(pd.SECRET_ENV)
    assert pd.pd_secret() is None


@pytest.mark.parametrize("consumer_secret, pulled", [(SECRET, True), (None, False), (OTHER, False)],
                         ids=["same", "none", "another"])
def test_a_pull_between_workers_needs_the_same_secret(consumer_secret, pulled):
    pytest.importorskip("vllm", reason="the connector's package imports vLLM")
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed")
    from kvslots.vllm.connector.pd import PDStepMeta, PDWorker, RecvSpec
    from ports import free_port
    from test_pd_connector import BS, NB, _caches, _wait_finished

    def worker(producer, engine_id, port, secret):
        w = PDWorker(engine_id=engine_id, host="127.0.0.1", port=port, block_size=BS, model="m", timeout_s=30.0,
                     producer=producer, consumer=not producer, control_timeout_s=3.0, secret=secret)
        w.register(_caches(1 if producer else 2), NB)
        return w

    port = free_port()
    prod = worker(True, "P", port, SECRET)
    cons = worker(False, "D", 0, consumer_secret)
    try:
        prod.on_step(PDStepMeta(holds={"p1": 30.0}))
        cons.on_step(PDStepMeta(recvs=[RecvSpec("d1", "p1", "P", "127.0.0.1", port, [3], [9])]))
        _, recv, failed = _wait_finished(cons)
        assert recv == {"d1"} and (failed == set()) == pulled
        assert prod.num_held() == (0 if pulled else 1)  # a refused ack released nothing
        assert prod._server.refused == (0 if pulled else 2)  # the hello and the ack
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("bad", ["", "A=B", "a\0b", "\ud800", 5, True, ["X"]])
def test_pd_secret_env_is_a_config_key_checked_at_start(bad):
    # The variable's name is a kv_connector_extra_config key with the other keys' checks (it was
    # read with getattr from a config that had no such field: only KVSLOTS_PD_SECRET worked).
    from kvslots.config.connector import ConnectorConfig, ConnectorConfigError

    assert ConnectorConfig.from_extra_config({"pd_secret_env": "MY_PD_SECRET"}).pd_secret_env == "MY_PD_SECRET"
    assert ConnectorConfig.from_extra_config({}).pd_secret_env is None
    with pytest.raises(ConnectorConfigError, match="pd_secret_env"):
        ConnectorConfig.from_extra_config({"pd_secret_env": bad})
