"""Outside probes of the P/D transport (kvslots.vllm.pd): hostile arguments to its public calls
and hostile peers on its sockets. Each test names what failed before."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvslots.errors import InvalidArgumentError, KVSlotsError

NB, BB, NS = 16, 256, 2


@pytest.fixture
def transport():
    os.environ.setdefault("GLOG_minloglevel", "1")
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")
    from kvslots.vllm.pd import BlockLayout, MooncakeTransport

    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    layout = BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS)
    t = MooncakeTransport("127.0.0.1")
    t.register(layout)
    yield t, layout, buf
    t.close()


@pytest.mark.parametrize("which", ["remote_ids", "local_ids"])
@pytest.mark.parametrize("ids", [range(10**12), range(2**70), range(10**8)], ids=["1e12", "2_70", "1e8"])
def test_a_huge_id_range_is_refused_at_once(transport, which, ids):
    # numpy built the whole array before any check: range(10**12) was a MemoryError (7 TiB asked
    # for), range(10**8) some 800 MB and seconds, range(2**70) an OverflowError; a read of more
    # ids than the local blocks they go to is refused anyway.
    t, layout, buf = transport
    args = {"remote_ids": [0], "local_ids": [0], which: ids}
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match=which):
        t.plan(layout, **args)
    with pytest.raises(KVSlotsError):
        t.read_blocks("127.0.0.1:1", layout, **args)
    assert time.monotonic() - start < 2
    # As many ids as blocks still plan: one entry per segment.
    assert len(t.plan(layout, range(NB), range(NB))[0]) == NS
    assert not buf.any()


# ---- the control channel (kvslots.vllm.pd.control) against peers that never stop sending ----

def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def _zmtp_greeting(socket_type: bytes) -> tuple[bytes, bytes]:
    """A ZMTP 3.0 NULL greeting and READY command: what a ZMQ peer (or one posing as it) sends."""
    import struct

    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return greeting, b"\x04" + bytes([len(body)]) + body


def _stream_frames_forever(sock, stop) -> None:
    """Frames of 60 KiB, each flagged 'more to come', until ``stop`` (or the other side closes):
    one message that never ends."""
    import struct

    chunk = b"\0" * (60 << 10)
    frame = b"\x03" + struct.pack(">Q", len(chunk)) + chunk
    try:
        sock.sendall(b"\x01\x00")  # the empty delimiter frame, 'more'
        while not stop.is_set():
            sock.sendall(frame)
    except OSError:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_a_peer_streaming_one_endless_request_does_not_grow_the_server():
    # The control server was a ZMQ ROUTER: libzmq queues every frame of a multipart message until
    # its last one arrives, and its 64 KiB cap is per frame. One connection streaming frames
    # that never end grew the prefill worker by ~500 MB a second (the whole host's memory in a
    # minute). Now each connection holds at most one request of MAX_REQUEST_BYTES.
    import socket
    import threading

    from kvslots.vllm.pd.control import ControlServer, control_call

    srv = ControlServer("127.0.0.1", 0, lambda msg: {"op": msg.get("op")})
    stop = threading.Event()
    peers = []
    try:
        before = _rss_mib()
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            greeting, ready = _zmtp_greeting(b"DEALER")
            s.sendall(greeting)
            try:
                s.recv(64)
                s.sendall(ready)
            except OSError:
                pass
            t = threading.Thread(target=_stream_frames_forever, args=(s, stop), daemon=True)
            t.start()
            peers.append((s, t))
        grown = 0
        for _ in range(30):
            time.sleep(0.1)
            grown = max(grown, _rss_mib() - before)
        assert grown < 150, f"the server grew by {grown} MiB in 3 s"
        assert control_call("127.0.0.1", srv.port, {"op": "hello"}, timeout_s=5) == {"op": "hello"}
    finally:
        stop.set()
        for s, t in peers:
            s.close()
            t.join(5)
        srv.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_a_peer_streaming_one_endless_reply_does_not_grow_the_caller():
    # A decode worker calls the host and port a hand-off names (kv_transfer_params, from the
    # client's request). Its ZMQ DEALER queued an endless multipart reply frame by frame (16 MiB
    # each allowed) until the call's timeout: gigabytes. Now a reply's length is checked first.
    import socket
    import threading

    from kvslots.errors import TransferError
    from kvslots.vllm.pd.control import control_call

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn:
            greeting, ready = _zmtp_greeting(b"ROUTER")
            try:
                conn.sendall(greeting)
                conn.recv(64)
                conn.sendall(ready)
            except OSError:
                return
            _stream_frames_forever(conn, stop)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    before = _rss_mib()
    peak = [0]

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mib() - before)
            time.sleep(0.05)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        with pytest.raises(TransferError):
            control_call("127.0.0.1", port, {"op": "hello"}, timeout_s=3, retries=0)
    finally:
        stop.set()
        srv.close()
        t.join(5)
        w.join(5)
    assert peak[0] < 150, f"the caller grew by {peak[0]} MiB"


_OUT_OF_DESCRIPTORS = r'''
import os, resource, socket, time
from kvslots.vllm.pd.control import ControlServer, control_call
srv = ControlServer("127.0.0.1", 0, lambda m: {"ok": 1})
time.sleep(0.2)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
socks = []
try:
    for _ in range(50):
        socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=2))
except OSError:
    pass
time.sleep(0.3)
t0 = time.process_time()
time.sleep(1.0)
cpu = time.process_time() - t0
for s in socks:
    s.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(cpu, control_call("127.0.0.1", srv.port, {"op": "x"}, timeout_s=15), srv._thread.is_alive(), flush=True)
'''


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_server_out_of_descriptors_neither_spins_nor_dies():
    # Connections waiting in the backlog while the process has no descriptor left keep the
    # listening socket readable: accepting must not turn into a busy loop, and the server must
    # answer again once descriptors are free.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu, *rest = out.stdout.split(maxsplit=1)
    assert rest == ["{'ok': 1} True\n"], out.stdout
    assert float(cpu) < 0.5, f"{cpu} s of CPU in 1 s with the descriptors used up"


_STOPPABLE_SERVER = r'''
import sys
from kvslots.vllm.pd.control import ControlServer
seen = []
def handle(msg):
    if msg.get("op") == "seen":
        return {"seen": list(seen)}
    seen.append(msg.get("op"))
    return {"held": True}
srv = ControlServer("127.0.0.1", 0, handle)
print(srv.port, flush=True)
sys.stdin.read()
'''


def _wait_stopped(pid: int) -> None:
    """Until the kernel shows every thread of ``pid`` stopped: kill() only queues SIGSTOP, and on a
    loaded machine the server could still take the next call before it acted on it (CI saw the
    call answered)."""
    deadline = time.monotonic() + 10
    states: list[str] = []
    while time.monotonic() < deadline:
        try:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # no /proc: give it time
            time.sleep(0.5)
            return
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s (thread states {states})")


def test_a_call_given_up_while_the_server_was_stopped_is_not_acted_on_later():
    # A decode worker's ack to a prefill worker stopped (SIGSTOP) past the call's timeout: the
    # caller takes the call as failed. Over TCP the kernel accepts the connection and keeps the
    # request for the stopped process, which acted on it once it ran again (an ack that freed
    # the held blocks after the caller had given up); ZMQ dropped it with the caller's socket.
    import signal
    import subprocess
    import sys

    from kvslots.errors import TransferError
    from kvslots.vllm.pd.control import control_call

    proc = subprocess.Popen([sys.executable, "-c", _STOPPABLE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        assert control_call("127.0.0.1", port, {"op": "first"}, timeout_s=10) == {"held": True}
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_stopped(proc.pid)
        try:
            with pytest.raises(TransferError) as e:
                control_call("127.0.0.1", port, {"op": "late"}, timeout_s=0.5, retries=1)
            assert e.value.kind == "timeout"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert control_call("127.0.0.1", port, {"op": "seen"}, timeout_s=10) == {"seen": ["first"]}
    finally:
        proc.stdin.close()
        proc.wait(10)
