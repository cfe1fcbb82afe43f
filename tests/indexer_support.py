"""Test support for the indexer: a publisher speaking vLLM's ZMQ wire protocol, a brute-force
oracle, a real redis-server, and small helpers."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import xxhash
import zmq

from kvslots.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from ports import free_port

WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
TIERS = ("GPU", "CPU", "STORAGE")


def wait_for(cond: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> object:
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class TestPublisher:
    """vLLM's ZmqEventPublisher on the wire: PUB frames (topic, 8-byte big-endian seq, payload);
    ROUTER replay answering (id, b"", topic, seq, payload) per buffered batch with seq >= start,
    then (id, b"", b"", -1, b""). Publishing is synchronous; `drop=True` buffers a batch without
    sending it (a message lost on the way)."""

    __test__ = False  # not a pytest class

    def __init__(self, topic: str = "", buffer_steps: int = 10_000, replay: bool = True, host: str = "127.0.0.1"):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.IPV6, host.startswith("["))  # a bracketed host: an IPv6 literal
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.port = free_port()
        self.replay_port = free_port() if replay else None
        self.endpoint = f"tcp://{host}:{self.port}"
        self.replay_endpoint = f"tcp://{host}:{self.replay_port}" if replay else None
        self.replays_served = 0
        self._open()

    def _open(self) -> None:
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        _bind(self.pub, self.endpoint)
        self._stop = threading.Event()
        self._thread = None
        if self.replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            _bind(self.router, self.replay_endpoint)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            self.replays_served += 1

    def publish_raw(self, payload: bytes, *, drop: bool = False) -> int:
        seq = self.seq
        self.seq += 1
        with self._lock:
            self.buffer.append((seq, payload))
            del self.buffer[: max(0, len(self.buffer) - self.buffer_steps)]
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def publish(self, events: list, *, drop: bool = False) -> int:
        return self.publish_raw(encode_batch(KVEventBatch(time.time(), events, 0)), drop=drop)

    def send_frames(self, frames: list[bytes]) -> None:
        """Anything on the PUB socket (malformed-frame tests)."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new publisher process on the same addresses: seq back to 0, empty buffer."""
        self.close(term=False)
        self._open()

    def close(self, term: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.pub.close(linger=0)
        if self.replay_endpoint:
            self.router.close(linger=0)
        if term:
            self.ctx.term()


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    for _ in range(100):  # the port of a just-closed socket can take a moment to free
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError:
            time.sleep(0.02)
    sock.bind(endpoint)


def engine_hashes(seed: int, tokens: list[int], bs: int) -> list[int]:
    """A stand-in engine hash chain (any algorithm: the index never recomputes it)."""
    out, h = [], seed
    for i in range(len(tokens) // bs):
        h = xxhash.xxh64_intdigest(repr((h, tokens[i * bs : (i + 1) * bs])).encode())
        out.append(h)
    return out


def store(seed: int, tokens: list[int], bs: int, *, start: int = 0, medium: str | None = None,
          lora_id: int | None = None) -> BlockStored:
    """BlockStored for blocks [start, n) of `tokens`, chained to block start-1, as vLLM sends."""
    hs = engine_hashes(seed, tokens, bs)
    n = len(hs)
    return BlockStored(hs[start:], hs[start - 1] if start else None, tokens[start * bs : n * bs], bs,
                       lora_id, medium, None)


def remove(seed: int, tokens: list[int], bs: int, blocks: Iterable[int], medium: str | None = None) -> BlockRemoved:
    hs = engine_hashes(seed, tokens, bs)
    return BlockRemoved([hs[i] for i in blocks], medium)


@dataclass
class Oracle:
    """Brute force, by token prefixes (never by hashes): per worker, engine hash ->
    (identity = (lora, block_size, blocks of the full prefix), tiers)."""

    workers: dict[str, dict[int, tuple[tuple, set]]] = field(default_factory=dict)
    default_tier: dict[str, str] = field(default_factory=dict)

    def add_worker(self, name: str, tier: str = "GPU") -> None:
        self.workers[name] = {}
        self.default_tier[name] = tier

    def apply(self, worker: str, events: list) -> None:
        m = self.workers[worker]
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                t = self.default_tier[worker]
                for h in list(m):
                    m[h][1].discard(t)
                    if not m[h][1]:
                        del m[h]
                continue
            tier = ev.medium or self.default_tier[worker]
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if h in m and tier in m[h][1]:
                        m[h][1].discard(tier)
                        if not m[h][1]:
                            del m[h]
                continue
            if not ev.token_ids:  # placeholder: only known hashes gain the tier
                for h in ev.block_hashes:
                    if h in m:
                        m[h][1].add(tier)
                continue
            bs = ev.block_size
            if bs <= 0 or len(ev.token_ids) != bs * len(ev.block_hashes):
                continue
            if ev.parent_block_hash is None:
                prefix: tuple = (ev.lora_id, bs, ())
            elif ev.parent_block_hash in m:
                prefix = m[ev.parent_block_hash][0]
            else:
                continue  # orphan
            for i, h in enumerate(ev.block_hashes):
                blk = tuple(ev.token_ids[i * bs : (i + 1) * bs])
                ident = (prefix[0], prefix[1], prefix[2] + (blk,))
                if h in m and m[h][0] == ident:
                    m[h][1].add(tier)
                else:
                    m[h] = (ident, {tier})
                prefix = ident

    def clear(self, worker: str) -> None:
        self.workers[worker].clear()

    def lookup(self, tokens: list[int], bs: int, lora_id: int | None = None) -> dict[str, tuple]:
        """worker -> (blocks, (gpu, cpu, storage), score) for workers matching >= 1 block."""
        out = {}
        blocks = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(tokens) // bs)]
        for w, m in self.workers.items():
            n, tb, score, alive = 0, [0, 0, 0], 0.0, set(TIERS)
            for k in range(1, len(blocks) + 1):
                ident = (lora_id, bs, tuple(blocks[:k]))
                held = set()
                for idt, tiers in m.values():
                    if idt == ident:
                        held |= tiers
                if not held:
                    break
                n += 1
                score += max(WEIGHTS[t] for t in held)
                alive &= held
                for i, t in enumerate(TIERS):
                    tb[i] += t in alive
            if n:
                out[w] = (n, tuple(tb), round(score, 9))
        return out


def rust_lookup(index, tokens: list[int], bs: int, lora_id: int | None = None) -> dict[str, tuple]:
    return {w: (b, tuple(t), round(s, 9)) for w, b, t, s in index.lookup(tokens, bs, lora_id)}


def score_view(resp: dict) -> dict[str, tuple]:
    """The /score answer in the oracle's shape (matched workers only)."""
    out = {}
    for w, d in resp["workers"].items():
        if d["blocks"]:
            out[w] = (d["blocks"], tuple(d["tiers"][t]["blocks"] for t in TIERS), round(d["score"], 9))
    return out


class RedisServer:
    """A real redis-server on a free loopback port, no persistence (a restart loses the data)."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (see scripts/system-deps.txt)")
        self.exe = exe
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvslots-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        r = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_for(lambda: _pings(r), 10, "redis-server to start")
        r.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(r) -> bool:
    import redis

    try:
        return bool(r.ping())
    except redis.RedisError:
        return False


def have_redis() -> bool:
    return shutil.which("redis-server") is not None or os.environ.get("KVSLOTS_REQUIRE_REDIS") == "1"
