"""The P/D block transport over Mooncake: two processes on loopback, byte-exact block reads, and
failures (peer killed, peer silent, bad layouts, bad ids) that raise TransferError without
hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("GLOG_minloglevel", "1")  # before Mooncake loads: no per-connection INFO lines
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError, TransferError  # noqa: E402
from kvslots.vllm.pd import BlockLayout, MooncakeTransport  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from pd_transport_peer import peer_buffer  # noqa: E402
from sigstop import sigstop  # noqa: E402

PEER = Path(__file__).parent / "pd_transport_peer.py"
NB, BB, NS = 64, 4096, 3  # blocks, bytes per block per segment, segments (layers)


def _start_peer(seed: int, num_blocks: int = NB, block_bytes: int = BB, num_segments: int = NS):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent / "python"))
    proc = subprocess.Popen([sys.executable, str(PEER), str(seed), str(num_blocks), str(block_bytes), str(num_segments)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert line, "peer died before it was ready"
    info = json.loads(line)
    return proc, info["session"], BlockLayout.from_wire(info["layout"])


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def peer():
    proc, session, layout = _start_peer(seed=7)
    yield proc, session, layout
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    _stop(proc)


@pytest.fixture
def local():
    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    t = MooncakeTransport("127.0.0.1")
    t.register(BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS))
    yield t, buf
    t.close()


def _blocks(buf: np.ndarray, seg: int, ids) -> np.ndarray:
    return buf.reshape(NS, NB, BB)[seg, ids]


def test_random_blocks_arrive_byte_exact(peer, local):
    _, session, remote = peer
    t, buf = local
    expect = peer_buffer(7, NB, BB, NS)
    rng = np.random.default_rng(1)
    for _ in range(5):
        n = int(rng.integers(1, NB))
        src = rng.choice(NB, n, replace=False)
        dst = rng.choice(NB, n, replace=False)
        # some consecutive runs too, the path that coalesces entries
        if n > 8:
            src[:5] = np.arange(10, 15)
            dst[:5] = np.arange(20, 25)
            dst = np.concatenate((dst[:5], [x for x in dst[5:] if not 20 <= x < 25]))[:n]
            src = src[: len(dst)]
        buf[:] = 0
        moved = t.read_blocks(session, remote, src, dst)
        assert moved == len(src) * NS * BB
        for s in range(NS):
            assert np.array_equal(_blocks(buf, s, dst), _blocks(expect, s, src)), f"segment {s} differs"
        untouched = np.setdiff1d(np.arange(NB), dst)
        assert not buf.reshape(NS, NB, BB)[:, untouched].any(), "a block outside local_ids was written"


def test_runs_coalesce_to_one_entry_per_segment(peer, local):
    _, _, remote = peer
    t, _ = local
    lp, rp, ln = t.plan(remote, list(range(3, 13)), list(range(30, 40)))
    assert len(lp) == NS and ln == [10 * BB] * NS
    lp, _, _ = t.plan(remote, [3, 5, 4], [30, 31, 32])  # remote not consecutive in local order
    assert len(lp) == 3 * NS


def test_submit_read_async(peer, local):
    _, session, remote = peer
    t, buf = local
    pending = t.submit_read(session, remote, [0, 1, 2], [5, 6, 7])
    assert pending.result(timeout=30) == 3 * NS * BB
    assert pending.done() and pending.settled()
    assert np.array_equal(_blocks(buf, 1, [5, 6, 7]), _blocks(peer_buffer(7, NB, BB, NS), 1, [0, 1, 2]))


@pytest.mark.parametrize("timeout, exc", [("x", ArgumentTypeError), (float("nan"), InvalidArgumentError),
                                          ([1], ArgumentTypeError), (True, ArgumentTypeError)])
def test_pending_read_result_refuses_a_timeout_that_is_no_number(peer, local, timeout, exc):
    # "x" was a TypeError, [1] too; NaN said "not done after nan s".
    _, session, remote = peer
    t, _ = local
    pending = t.submit_read(session, remote, [0], [5])
    with pytest.raises(exc, match="timeout"):
        pending.result(timeout)
    assert pending.result(float("inf")) == NS * BB  # inf waits as None does (was an OverflowError)
    assert pending.result(-1) == NS * BB  # done: a negative timeout does not wait, and needs not


def test_peer_killed_raises_transfer_error(peer, local):
    proc, session, remote = peer
    t, _ = local
    t.read_blocks(session, remote, [0], [0])  # connected once
    proc.kill()
    proc.wait()
    start = time.monotonic()
    with pytest.raises(TransferError) as ei:
        t.read_blocks(session, remote, [1, 2], [1, 2])
    assert ei.value.kind == "peer"
    assert time.monotonic() - start < 10
    # the transport still works with another peer afterwards
    proc2, session2, remote2 = _start_peer(seed=9)
    try:
        t.read_blocks(session2, remote2, [4], [4])
    finally:
        _stop(proc2)


def test_never_existing_peer_raises(local):
    t, _ = local
    remote = BlockLayout.from_buffer(1 << 20, block_bytes=BB, num_blocks=NB, num_segments=NS)
    with pytest.raises(TransferError) as ei:
        t.read_blocks("127.0.0.1:1", remote, [0], [0])
    assert ei.value.kind == "peer"


def test_silent_peer_times_out_without_hanging(peer, local):
    proc, session, remote = peer
    t, _ = local
    t.read_blocks(session, remote, [0], [0])
    sigstop(proc.pid)
    try:
        start = time.monotonic()
        pending = t.submit_read(session, remote, [1], [1])
        with pytest.raises(TransferError) as ei:
            pending.result(timeout=1.0)
        assert ei.value.kind == "timeout"
        assert time.monotonic() - start < 5
        assert not pending.settled()  # Mooncake may still write; the caller must not reuse the block yet
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # once the peer is back the outstanding read completes (or fails) and settles
    try:
        pending.result(timeout=60)
    except TransferError:
        pass
    assert pending.settled()


def test_mismatched_layouts_raise_layout_error(peer, local):
    _, session, remote = peer
    t, _ = local
    other = BlockLayout.from_buffer(remote.segments[0].addr, block_bytes=BB * 2, num_blocks=NB, num_segments=NS)
    with pytest.raises(TransferError, match="layouts differ") as ei:
        t.read_blocks(session, other, [0], [0])
    assert ei.value.kind == "layout"
    fewer = BlockLayout.from_buffer(remote.segments[0].addr, block_bytes=BB, num_blocks=NB, num_segments=NS - 1)
    with pytest.raises(TransferError, match="segments") as ei:
        t.read_blocks(session, fewer, [0], [0])


@pytest.mark.parametrize("remote_ids, local_ids, exc", [
    ([0, 1], [0], InvalidArgumentError),
    ([0, 1], [3, 3], InvalidArgumentError),
    ([-1], [0], InvalidArgumentError),
    ([NB], [0], InvalidArgumentError),
    ([0], [2**70], KVSlotsError),
    ([0.5], [0], ArgumentTypeError),
    ("ab", [0], ArgumentTypeError),
    ([True], [0], ArgumentTypeError),
    ([[0]], [0], ArgumentTypeError),
])
def test_hostile_ids_raise_kvslots_errors(peer, local, remote_ids, local_ids, exc):
    _, session, remote = peer
    t, buf = local
    with pytest.raises(exc):
        t.read_blocks(session, remote, remote_ids, local_ids)
    assert not buf.any()


@pytest.mark.parametrize("wire", [
    None, 5, "x", {"num_blocks": 4}, {"num_blocks": 4, "segments": [["a", 0, 0, 0, 4]]},
    {"num_blocks": 4, "segments": [["a", -5, 16, 16, 4]]}, {"num_blocks": 4, "segments": [["a", 0, 16, 8, 4]]},
    {"num_blocks": 0, "segments": []}, {"num_blocks": 4, "segments": [["a", 0, 16, 16, 5]]},
])
def test_malformed_wire_layout(wire):
    with pytest.raises(TransferError) as ei:
        BlockLayout.from_wire(wire)
    assert ei.value.kind == "layout"


@pytest.mark.parametrize("wire", [
    {"num_blocks": 4, "segments": [["a", 2**70, 16, 16, 4]]},  # an OverflowError in plan
    {"num_blocks": 4, "segments": [["a", 2**64 - 16, 16, 16, 4]]},
    {"num_blocks": 4, "segments": [["a", 0, 16, 2**62, 4]]},  # planned as a wrapped, negative address
    {"num_blocks": 2**62, "segments": [["a", 0, 16, 16, 2**62]]},
    {"num_blocks": 4, "segments": [["a", 0, 2**70, 2**70, 4]]},
    {"num_blocks": 4, "segments": [["\udc80", 0, 16, 16, 4]]},  # did not encode in a hello reply
    {"num_blocks": 4, "segments": [["a", 0, 16, 16, 4]] * 70_000},
], ids=["addr_2_70", "addr_2_64", "stride_2_62", "blocks_2_62", "block_bytes_2_70", "surrogate", "70k_segments"])
def test_a_wire_layout_past_the_address_space_is_a_layout_error(wire):
    # A peer's layout whose bytes end past 2**63 was accepted; planning a read from it raised an
    # OverflowError or handed Mooncake wrapped, negative addresses.
    with pytest.raises(TransferError) as ei:
        BlockLayout.from_wire(wire)
    assert ei.value.kind == "layout"


@pytest.mark.parametrize("kwargs, exc", [
    ({"addr": 2**70}, InvalidArgumentError), ({"addr": 2**64 - 1}, InvalidArgumentError),
    ({"block_bytes": 2**70}, InvalidArgumentError), ({"num_blocks": 2**62}, InvalidArgumentError),
    ({"num_segments": 10**7}, InvalidArgumentError), ({"name": "\udc80"}, InvalidArgumentError),
    ({"name": 5}, ArgumentTypeError),
])
def test_from_buffer_refuses_hostile_sizes_quickly(kwargs, exc):
    # 10**7 segments took half a minute; an end past 2**63 registered as a pybind TypeError.
    args = {"addr": 1 << 20, "block_bytes": BB, "num_blocks": NB, **kwargs}
    start = time.monotonic()
    with pytest.raises(exc):
        BlockLayout.from_buffer(args.pop("addr"), **args)
    assert time.monotonic() - start < 5


def test_from_tensors_refuses_what_is_no_layer_mapping():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 2)
    for layers in ([t], None, "abc"):  # AttributeErrors
        with pytest.raises(ArgumentTypeError):
            BlockLayout.from_tensors(layers, 4)
    for value in (5, "xyz"):  # a TypeError; a str walked character by character
        with pytest.raises(InvalidArgumentError, match="expected a tensor"):
            BlockLayout.from_tensors({"a": value}, 4)
    for dim in ("0", 0.0, True):  # TypeErrors, or True taken as dimension 1
        with pytest.raises(ArgumentTypeError, match="block_dim"):
            BlockLayout.from_tensors({"a": t}, 4, block_dim=dim)
    with pytest.raises(ArgumentTypeError, match="layer name"):  # a Segment that no longer round-trips
        BlockLayout.from_tensors({5: t}, 4)
    with pytest.raises(InvalidArgumentError, match="layer name"):
        BlockLayout.from_tensors({"\udc80": t}, 4)
    layout = BlockLayout.from_tensors({"a": t, "b": [t.clone()]}, 4)
    assert BlockLayout.from_wire(layout.to_wire()) == layout


def test_layout_of_tensors_target_and_draft():
    torch = pytest.importorskip("torch")
    n = 10
    caches = {
        "model.layers.0.attn": torch.zeros(n, 2, 16, 8),  # CPU backend: blocks first
        "model.layers.1.attn": torch.zeros(2, n, 16, 2, 4),  # flash-attn: K and V segments
        "drafter.layers.0.attn": torch.zeros(n, 2, 16, 8),
    }
    caches["shared"] = caches["model.layers.0.attn"]
    layout = BlockLayout.from_tensors(caches, n)
    names = [s.name for s in layout.segments]
    assert names == ["model.layers.0.attn", "model.layers.1.attn.0", "model.layers.1.attn.1", "drafter.layers.0.attn"]
    assert layout.bytes_per_block == (2 * 16 * 8) * 4 * 2 + (16 * 2 * 4) * 4 * 2
    assert BlockLayout.from_wire(json.loads(json.dumps(layout.to_wire()))) == layout
    with pytest.raises(InvalidArgumentError):
        BlockLayout.from_tensors({"x": torch.zeros(n, n)}, n)
    with pytest.raises(InvalidArgumentError):
        BlockLayout.from_tensors({"x": torch.zeros(4, n).t()}, n)


def test_closed_transport_refuses(peer):
    _, session, remote = peer
    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    t = MooncakeTransport("127.0.0.1")
    t.register(BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS))
    t.close()
    t.close()
    with pytest.raises(TransferError):
        t.read_blocks(session, remote, [0], [0])
    with pytest.raises(InvalidArgumentError):
        MooncakeTransport("127.0.0.1:5")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 10**30, True, "5", None.__class__])
def test_transfer_timeout_refuses_bad_values_before_touching_the_environment(bad, monkeypatch):
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    with pytest.raises(InvalidArgumentError, match="transfer_timeout_s"):
        MooncakeTransport("127.0.0.1", transfer_timeout_s=bad)
    assert "MC_TRANSFER_TIMEOUT" not in os.environ


@pytest.mark.parametrize("kwargs, exc", [
    ({"hostname": "\udc80"}, InvalidArgumentError), ({"hostname": "a\0b"}, InvalidArgumentError),
    ({"hostname": " "}, InvalidArgumentError), ({"hostname": "a\nb"}, InvalidArgumentError),
    ({"device_name": 5}, ArgumentTypeError), ({"device_name": "\udc80"}, InvalidArgumentError),
    ({"device_name": "mlx5_0\0"}, InvalidArgumentError),
])
def test_constructor_text_mooncake_cannot_take_is_a_kvslots_error(kwargs, exc):
    # A lone surrogate or a device_name that is no str was pybind's TypeError from initialize;
    # a NUL or a blank made a session id ("a\0b:port") no peer can use.
    with pytest.raises(exc):
        MooncakeTransport(**{"hostname": "127.0.0.1", **kwargs})


@pytest.mark.parametrize("session", ["\udc80:1", "a\0b:1", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:abc",
                                     ":1", "127.0.0.1:", "127.0.0.1:\u0663", "a b:1", 5, None, b"127.0.0.1:1"])
def test_hostile_remote_sessions_are_peer_errors(local, session):
    # "\udc80:1" was pybind's TypeError; the others went to Mooncake as given.
    t, buf = local
    remote = BlockLayout.from_buffer(1 << 20, block_bytes=BB, num_blocks=NB, num_segments=NS)
    with pytest.raises(TransferError, match="bad remote session") as ei:
        t.read_blocks(session, remote, [0], [0])
    assert ei.value.kind == "peer"
    with pytest.raises(TransferError, match="bad remote session"):
        t.submit_read(session, remote, [0], [0])  # an argument error: raised here, not by result()
    assert not buf.any()


class _SilentPeer:
    """A TCP listener that accepts every connection and never answers: a peer that is stopped,
    hung, or no Mooncake engine at all (the kernel completes the connection either way)."""

    def __init__(self):
        import socket
        import threading

        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.session = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self._conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            self._conns.append(conn)

    def close(self):
        self._srv.close()
        for c in self._conns:
            c.close()


def _probe_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "kvslots-pd-probe"]


def _first_contact_with_a_silent_peer(handshake_kw, limit_s):
    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    t = MooncakeTransport("127.0.0.1", **handshake_kw)
    t.register(BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS))
    remote = BlockLayout.from_buffer(1 << 20, block_bytes=BB, num_blocks=NB, num_segments=NS)
    peer = _SilentPeer()
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="did not answer") as ei:
            t.read_blocks(peer.session, remote, [0, 1], [0, 1])
        took = time.monotonic() - start
        assert ei.value.kind == "timeout"
        assert took < limit_s, took
        return t, buf, remote, peer
    except BaseException:
        peer.close()
        t.close()
        raise


def test_a_silent_peer_at_first_contact_fails_within_the_handshake_timeout():
    # Mooncake's hand-shake waited its fixed 60 s for a peer that accepts the connection and
    # stays silent, holding the reading thread (a vLLM pull thread) all along.
    before = len(_probe_threads())  # another test's probe may still be ending
    t, buf, remote, peer = _first_contact_with_a_silent_peer({"handshake_timeout_s": 1.0}, 15)
    try:
        with pytest.raises(TransferError, match="did not answer"):  # the same probe, not another
            t.read_blocks(peer.session, remote, [2], [2])
        with pytest.raises(TransferError) as ei:
            t.submit_read(peer.session, remote, [3], [3]).result(30)
        assert ei.value.kind == "timeout"
        assert len(_probe_threads()) <= before + 1
        assert not buf.any()  # Mooncake never started a read
    finally:
        peer.close()  # the probe sees the connection close and ends
        t.close()
    deadline = time.monotonic() + 60
    while len(_probe_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_probe_threads()) <= before, "the probe thread outlived its peer"


def test_the_default_handshake_timeout_bounds_a_first_contact():
    from kvslots.vllm.pd import transport

    # The default (10 s) against Mooncake's 60 s: a generous bound a loaded machine keeps.
    t, _, _, peer = _first_contact_with_a_silent_peer({}, 40)
    peer.close()
    t.close()
    assert t.handshake_timeout_s == transport.DEFAULT_HANDSHAKE_TIMEOUT_S


def test_a_peer_that_answers_is_probed_once(peer, local):
    _, session, remote = peer
    t, _ = local
    calls = []
    real = t.engine.send_probe

    class Spy:  # the engine is a pybind object: its methods cannot be patched
        def __getattr__(self, name):
            return getattr(real.__self__, name)

        def send_probe(self, s):
            calls.append(s)
            return real(s)

    t._engine = Spy()
    for i in range(3):
        t.read_blocks(session, remote, [i], [i])
    assert calls == [session]


def test_the_handshake_timeout_follows_a_shorter_transfer_timeout():
    # The P/D consumer sets only transfer_timeout_s (its pd_timeout_s, capped): a first contact
    # must not wait longer than that either.
    from kvslots.vllm.pd import transport

    cases = [({"transfer_timeout_s": 2}, 2), ({"transfer_timeout_s": 30}, transport.DEFAULT_HANDSHAKE_TIMEOUT_S),
             ({}, transport.DEFAULT_HANDSHAKE_TIMEOUT_S), ({"transfer_timeout_s": 2, "handshake_timeout_s": 5}, 5),
             ({"handshake_timeout_s": None}, None)]
    for kwargs, expect in cases:
        t = MooncakeTransport("127.0.0.1", **kwargs)
        try:
            assert t.handshake_timeout_s == expect, kwargs
        finally:
            t.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True, 10**6])
def test_handshake_timeout_refuses_bad_values(bad):
    with pytest.raises(InvalidArgumentError, match="handshake_timeout_s"):
        MooncakeTransport("127.0.0.1", handshake_timeout_s=bad)


_TIMED_READ = """
import json, os, signal, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_pd_transport import NB, BB, NS, _start_peer
from sigstop import sigstop
from kvslots.errors import TransferError
from kvslots.vllm.pd import BlockLayout, MooncakeTransport

proc, session, remote = _start_peer(seed=3)
buf = np.zeros(NS * NB * BB, dtype=np.uint8)
t = MooncakeTransport("127.0.0.1", transfer_timeout_s=float(sys.argv[2]))
t.register(BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS))
t.read_blocks(session, remote, [0], [0])  # Mooncake's own hand-shake with the peer, once
sigstop(proc.pid)
time.sleep(0.5)
start = time.monotonic()
try:
    t.read_blocks(session, remote, [1], [1])
    kind = None
except TransferError as e:
    kind = e.kind
took = time.monotonic() - start
os.kill(proc.pid, signal.SIGCONT)
proc.stdin.close()
proc.wait(30)
t.close()
print(json.dumps({"kind": kind, "took": took, "env": os.environ.get("MC_TRANSFER_TIMEOUT")}))
"""


@pytest.mark.parametrize("operator", [None, "2"])
def test_transfer_timeout_bounds_a_read_from_a_silent_peer(tmp_path, operator):
    """transfer_timeout_s=1.5 becomes Mooncake's MC_TRANSFER_TIMEOUT=2 while the engine is made:
    a read from a peer that stopped after the hand-shake fails within it rather than Mooncake's
    30 s, and the variable is gone again (child processes and later engines do not inherit it).
    An operator's MC_TRANSFER_TIMEOUT wins (here 2 against transfer_timeout_s=20) and stays."""
    script = tmp_path / "timed_read.py"
    script.write_text(_TIMED_READ)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent / "python"))
    env.pop("MC_TRANSFER_TIMEOUT", None)
    timeout = "1.5"
    if operator is not None:
        env["MC_TRANSFER_TIMEOUT"], timeout = operator, "20"
    out = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), timeout], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["env"] == operator  # set only while the engine was made, unless the operator set it
    assert res["kind"] == "peer", res
    assert 1.5 <= res["took"] < 10, res


def _xfer_threads():
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("kvslots-pd-xfer")}


@pytest.mark.parametrize("submit", [False, True], ids=["read_blocks", "submit_read"])
def test_register_and_close_during_a_read_in_flight(peer, submit):
    # register() unregistered the memory under a running read (and close() under a read_blocks
    # of another thread), which Mooncake went on writing into.
    import gc
    import threading

    from kvslots.errors import InvalidStateError

    proc, session, remote = peer
    before = _xfer_threads()
    fds = len(os.listdir("/proc/self/fd"))
    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    other = np.zeros_like(buf)
    layout = BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS)
    t = MooncakeTransport("127.0.0.1")
    t.register(layout)
    t.read_blocks(session, remote, [0], [0])  # the hand-shake: the next read waits on the peer only
    outcome = []

    def read():
        try:
            if submit:
                outcome.append(t.submit_read(session, remote, [1, 2], [1, 2]).result(60))
            else:
                outcome.append(t.read_blocks(session, remote, [1, 2], [1, 2]))
        except BaseException as e:  # noqa: BLE001 - judged below
            outcome.append(e)

    sigstop(proc.pid)  # the read waits on the peer until SIGCONT
    reader = threading.Thread(target=read, daemon=True)
    closer = threading.Thread(target=t.close, daemon=True)
    try:
        reader.start()
        deadline = time.monotonic() + 10
        while not getattr(t, "_reads", 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # into Mooncake's call
        with pytest.raises(InvalidStateError, match="in flight"):
            t.register(BlockLayout.from_buffer(other.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS))
        assert t.layout is layout  # unchanged
        closer.start()
        time.sleep(0.3)
        assert closer.is_alive() and t.layout is layout, "close() unregistered the memory under the read"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        reader.join(60)
        closer.join(60) if closer.ident else t.close()
    assert not reader.is_alive() and not closer.is_alive()
    (res,) = outcome
    if isinstance(res, TransferError):
        pass  # a failed read is an allowed outcome; a crash or another exception is not
    else:
        assert res == 2 * NS * BB, res
        assert np.array_equal(_blocks(buf, 2, [1, 2]), _blocks(peer_buffer(7, NB, BB, NS), 2, [1, 2]))
    assert t.layout is None and not other.any()
    with pytest.raises(TransferError, match="closed"):
        t.read_blocks(session, remote, [3], [3])
    assert _xfer_threads() <= before, "the transport's read thread outlived close()"
    del t, read, reader, closer  # Mooncake's engine holds its sockets until it is freed
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds, "a socket outlived the transport"
