"""The index shared by several indexer replicas through Redis.

One replica at a time is the *writer*: it holds a lease (``{ns}:leader``, renewed well before it
expires), subscribes to the workers, keeps the index in process (the Rust index, with a change
journal) and mirrors every applied batch into Redis with one Lua script: the script checks the
lease and the data epoch, writes the changed entries and the worker's cursor, all atomically. A
stale writer (lease lost) cannot write, and a batch is in Redis entirely or not at all.

Every replica (the writer included) answers ``/score`` from Redis, so all replicas serve the same
scores, including one started later.

Layout (``ns`` = ``--redis-namespace``):
- ``{ns}:k:{key}``     hash  worker -> tier bitmask (bit 0 GPU, 1 CPU, 2 STORAGE)
- ``{ns}:e:{worker}``  hash  engine hash -> "key g_gpu g_cpu g_storage" (group bitmasks)
- ``{ns}:cursor``      hash  worker -> last applied seq
- ``{ns}:workers``     hash  worker -> spec (JSON): the worker registry, shared
- ``{ns}:epoch``       the data generation; ``{ns}:state`` "ready" once complete
- ``{ns}:leader``      the writer's id (lease); ``{ns}:status`` its stream status (JSON)

Failures:
- Redis restarted (data lost): the epoch is gone, the writer's next write fails, it re-takes the
  lease and rewrites everything from its in-process index (``state`` = "syncing" meanwhile, so
  readers answer ``stale: true``). Batches that arrived while Redis was down were applied in
  process and are included.
- Redis unreachable: readers answer ``stale: true`` (the writer from its own index, the others
  with no matches); the writer keeps applying in process and resyncs when Redis is back.
- Writer gone: its lease expires, another replica takes it, loads the entries and cursors from
  Redis and asks each publisher to replay from its cursor. Until then readers answer
  ``stale: true`` (no live writer).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, cast

import redis

from .._core import ApplyStats, PrefixIndex
from ..config.loader import loads_strict_json
from ..errors import ConfigError
from .backend import Backend, ScoreResult
from .config import WORKER_NAME, IndexerConfig, WorkerSpec, check_namespace, check_redis_url, redact_url

log = logging.getLogger("kvslots.indexer")

LEASE_MS = 3000
TICK_S = 0.25
VACANT_GRACE_S = 0.75
CHUNK = 2000  # entries per pipeline when dumping or loading

_APPLY = """
local ns = ARGV[1]
if redis.call('GET', ns .. ':leader') ~= ARGV[2] then return redis.error_reply('NOTLEADER') end
if redis.call('GET', ns .. ':epoch') ~= ARGV[3] then return redis.error_reply('EPOCH') end
local i = 7
for _ = 1, tonumber(ARGV[6]) do
  local w, e, v = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if v == '' then redis.call('HDEL', ns .. ':e:' .. w, e) else redis.call('HSET', ns .. ':e:' .. w, e, v) end
  i = i + 3
end
local nh = tonumber(ARGV[i])
i = i + 1
for _ = 1, nh do
  local k, w, t = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if t == '0' then redis.call('HDEL', ns .. ':k:' .. k, w) else redis.call('HSET', ns .. ':k:' .. k, w, t) end
  i = i + 3
end
if ARGV[4] ~= '' then
  if ARGV[5] == '' then redis.call('HDEL', ns .. ':cursor', ARGV[4])
  else redis.call('HSET', ns .. ':cursor', ARGV[4], ARGV[5]) end
end
return 1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


_DIGITS = re.compile(rb"[0-9]+")
_WORKER = re.compile(WORKER_NAME.pattern.encode())


class NotWriter(Exception):
    """This replica lost the lease: it must stop writing."""


def check_redis_resolves(url: str) -> None:
    """A ConfigError when the resolver does not answer for the host of the Redis URL ``url`` (a
    checked one: :func:`check_redis_url`) within :data:`kvslots._listen.RESOLVE_TIMEOUT_S`. redis-py
    looks it up with getaddrinfo, which has no timeout (its connect timeout starts after): a
    resolver that never answered hung ``kvslots indexer --backend redis`` at its first tick, before
    it served. A host the resolver answers it does not know is left to the backend (Redis
    unreachable: answered ``stale`` until it resolves), as before."""
    from .. import _listen

    given = redis.Redis.from_url(url).connection_pool.connection_kwargs
    host = given.get("host")
    if not isinstance(host, str) or not host:  # unix://: no lookup
        return
    try:
        _listen._resolve(host, int(given.get("port") or 6379))
    except socket.gaierror as e:
        # only _resolve's own timeout (an EAI_AGAIN the resolver gave is its answer)
        if e.errno == socket.EAI_AGAIN and "did not answer" in str(e.strerror):
            raise ConfigError(f"redis URL host {host!r}: cannot resolve it ({e.strerror})") from None
    except (UnicodeError, ValueError, OSError):
        pass  # the backend's to report, as before


def _connect_tcp(conn: Any) -> socket.socket:
    """redis.Connection._connect (redis-py 5.1-8) with the host looked up by kvslots._listen.resolve:
    redis-py resolves again at each reconnect with no timeout (socket_connect_timeout starts after
    the lookup), so a resolver that hung while Redis was away hung the upkeep thread and every
    /score. A connect waits for the lookup at most its socket_connect_timeout (the lookup runs on,
    shared, and its answer serves the next connect); an address needs no lookup."""
    from .. import _listen

    err: OSError | None = None
    for family, kind, proto, _, address in _listen.resolve(conn.host, conn.port, conn.socket_type,
                                                           socket.SOCK_STREAM, wait=conn.socket_connect_timeout):
        sock = None
        try:
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if conn.socket_keepalive:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for k, v in conn.socket_keepalive_options.items():
                    sock.setsockopt(socket.IPPROTO_TCP, k, v)
            sock.settimeout(conn.socket_connect_timeout)
            sock.connect(address)
            sock.settimeout(conn.socket_timeout)
            return sock
        except OSError as e:
            err = e
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
    if err is not None:
        raise err
    raise OSError("socket.getaddrinfo returned an empty list")


class _BoundedConnection(redis.Connection):
    def _connect(self) -> socket.socket:
        return _connect_tcp(self)


class _BoundedSSLConnection(redis.SSLConnection):
    # TLS is wrapped as redis-py does, with server_hostname the URL's host (verified as before)
    def _connect(self) -> Any:
        sock = _connect_tcp(self)
        try:
            return self._wrap_socket_with_ssl(sock)
        except (OSError, redis.RedisError):
            sock.close()
            raise


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """redis.Redis.from_url(url, **kwargs) whose TCP and TLS connections look the host up with a
    bound at each (re)connect (_connect_tcp); a unix socket needs no lookup."""
    chosen = redis.connection.parse_url(url).get("connection_class", redis.Connection)
    bounded = {redis.Connection: _BoundedConnection, redis.SSLConnection: _BoundedSSLConnection}.get(chosen)
    if bounded is not None:
        kwargs["connection_class"] = bounded
    return redis.Redis.from_url(url, **kwargs)


class RedisBackend(Backend):
    name = "redis"
    unavailable = (redis.RedisError,)

    def __init__(self, cfg: IndexerConfig, client: redis.Redis | None = None):
        super().__init__(cfg)
        check_namespace(cfg.redis_namespace)  # (cfg.validate() checks these too; a config built in code may skip it)
        if client is None:
            check_redis_url(cfg.redis_url)
        self.ns = cfg.redis_namespace
        self.id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.r = client or redis_client(
            cfg.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0, health_check_interval=5
        )
        self._apply_script = self.r.register_script(_APPLY)
        self._renew_script = self.r.register_script(_RENEW)
        self._lock = threading.RLock()  # local index + journal + epoch
        self.local: PrefixIndex | None = None  # the writer's in-process index
        self.epoch: str | None = None
        self.is_writer = False
        self.needs_resync = False
        self.redis_ok = False
        self.cursors: dict[str, int] = {}  # last applied seq per worker (writer)
        self._resume: dict[str, int] = {}  # cursors read from Redis when taking over
        self._specs: dict[str, WorkerSpec] = {}  # last registry read (or written) by us
        self._service: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._vacant_since: float | None = None
        self.errors = 0  # Redis errors
        self.upkeep_errors = 0  # anything else a tick raised (logged; the tick goes on)
        self._last_upkeep_error: str | None = None
        self._failing: dict[str, str] = {}  # worker -> why it cannot be subscribed (logged once)
        self._bad_specs: set[tuple[bytes, bytes]] = set()  # registry entries ignored (logged once)

    def k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # ---- lifecycle ----

    def start(self, service: Any) -> None:
        self._service = service
        self._safe_tick()
        self._thread = threading.Thread(target=self._loop, name="kvslots-indexer-redis", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.is_writer:
            try:  # hand the lease over at once instead of letting it expire
                self.r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
                            1, self.k("leader"), self.id)
            except redis.RedisError:
                pass
        self.r.close()

    def should_subscribe(self) -> bool:
        return self.is_writer

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            self._safe_tick()

    def _safe_tick(self) -> None:
        # Nothing may end this thread: it renews the lease and notices Redis coming back.
        try:
            self._tick()
        except Exception as e:
            self.upkeep_errors += 1
            what = f"{type(e).__name__}: {e}"
            if what != self._last_upkeep_error:  # once per distinct error, not 4 times a second
                log.exception("redis upkeep: %s (going on)", what)
            self._last_upkeep_error = what
        else:
            self._last_upkeep_error = None

    def _tick(self) -> None:
        try:
            self.r.ping()
            if not self.redis_ok:
                log.info("redis %s reachable", redact_url(self.cfg.redis_url))
            self.redis_ok = True
            if self.is_writer:
                self._keep_lease()
            else:
                self._try_take_lease()
            if self.is_writer:
                if self.needs_resync or self._epoch_lost():
                    self._resync()
                self._publish_status()
            self._reconcile()
        except NotWriter:
            self._lose_lease()
        except redis.RedisError as e:
            if self.redis_ok:
                log.warning("redis unreachable: %s", e)
            self.redis_ok = False
            self.errors += 1
            if self.is_writer:
                self.needs_resync = True

    # ---- the lease ----

    def _try_take_lease(self) -> None:
        # Take a vacant lease only after it has stayed vacant a little: when Redis restarts, the
        # previous writer (whose in-process index is the most complete copy) re-takes it first.
        if self.r.exists(self.k("leader")):
            self._vacant_since = None
            return
        now = time.monotonic()
        if self._vacant_since is None:
            self._vacant_since = now
        if now - self._vacant_since < VACANT_GRACE_S:
            return
        if not self.r.set(self.k("leader"), self.id, nx=True, px=LEASE_MS):
            return
        self._vacant_since = None
        log.info("replica %s is now the writer", self.id)
        try:
            self._take_over()
        except Exception:
            self._lose_lease()
            raise

    def _keep_lease(self) -> None:
        if self._renew_script(keys=[self.k("leader")], args=[self.id, LEASE_MS]):
            return
        # Our lease is gone. If nobody holds it (Redis restarted), take it back at once and keep
        # our in-process index: it is the most complete copy there is.
        if self.r.set(self.k("leader"), self.id, nx=True, px=LEASE_MS):
            log.warning("writer lease was lost (redis restart?); re-taken, resyncing")
            self.needs_resync = True
            return
        raise NotWriter

    def _lose_lease(self) -> None:
        if not self.is_writer:
            return
        log.warning("replica %s lost the writer lease", self.id)
        self.is_writer = False
        with self._lock:  # first, so unsubscribing below deletes nothing from Redis
            self.local = None
            self.cursors.clear()
        if self._service is not None:
            self._service.sync_subscriptions({})

    def _take_over(self) -> None:
        """Become the writer: load the shared state (if complete), then subscribe from the
        cursors (the subscription replays from each publisher)."""
        with self._lock:
            self.local = PrefixIndex(capacity=self.cfg.capacity, tier_weights=dict(self.cfg.tier_weights),
                                     journal=True)
            self.cursors.clear()
            self._resume.clear()
            epoch, state = self.r.mget(self.k("epoch"), self.k("state"))
            known = dict(self._specs)
            specs = self._read_specs() or known  # a registry lost with Redis: restore ours
            if epoch is not None and state == b"ready":
                self.epoch = cast(bytes, epoch).decode()  # the client does not decode responses
                for w, seq in self.r.hgetall(self.k("cursor")).items():
                    self._resume[cast(bytes, w).decode()] = int(seq) + 1
                for name, spec in specs.items():
                    self.local.add_worker(name)
                    self.local.set_worker_eagle(name, spec.eagle)
                    self._load_worker(name)
                self.local.take_changes()  # loaded state is already in Redis
                self.is_writer = True
                log.info("loaded %d entries from redis", self.local.stats()["entries"])
            else:
                # Nothing complete to build on: start a fresh generation; publishers replay.
                self.is_writer = True
                self._specs = dict(specs)
                self._resync()

    def _load_worker(self, name: str) -> None:
        assert self.local is not None
        entries = []
        for engine, v in self.r.hscan_iter(self.k("e", name), count=CHUNK):
            key, g0, g1, g2, *last = v.split()  # "key g0 g1 g2 [last]" (older writers: no last)
            entries.append((int(engine), int(key), (int(g0), int(g1), int(g2)), int(last[0]) if last else 0))
        self.local.load(name, entries)

    def _epoch_lost(self) -> bool:
        return self.r.get(self.k("epoch")) != (self.epoch or "").encode()

    # ---- the registry ----

    def _read_specs(self) -> dict[str, WorkerSpec]:
        """The registry in Redis where it can be trusted, else our last copy of it. Not trusted:
        an empty registry with no epoch (lost with Redis) and any registry read while a resync
        rewrites it (``state`` "syncing": after a restart the epoch is set before the registry
        is written back). Trusting that one made the writer unsubscribe every worker and drop
        its index, which no later resync brought back."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.k("workers"))
        pipe.exists(self.k("epoch"))
        pipe.get(self.k("state"))
        registry, has_epoch, state = pipe.execute()
        out = {}
        for name, raw in registry.items():
            try:
                out[name.decode()] = WorkerSpec.from_dict(json.loads(raw))
            except (ValueError, TypeError, AttributeError) as e:
                if (name, raw) not in self._bad_specs:
                    self._bad_specs.add((name, raw))
                    log.warning("ignoring bad worker spec %r in redis: %s", name, e)
        if state == b"syncing" or not (out or has_epoch):
            return dict(self._specs)
        # A copy: register() and unregister() change ours from HTTP threads while the upkeep
        # thread iterates the one returned ("dictionary changed size during iteration").
        self._specs = dict(out)
        return out

    def register(self, spec: WorkerSpec, *, replace: bool = True) -> bool:
        raw = json.dumps(spec.to_dict())
        if replace:
            self.r.hset(self.k("workers"), spec.name, raw)
            ok = True
        else:
            ok = bool(self.r.hsetnx(self.k("workers"), spec.name, raw))
        if ok:
            self._specs[spec.name] = spec
        return ok

    def unregister(self, name: str, *, spec: WorkerSpec | None = None) -> bool:
        gone = bool(self.r.hdel(self.k("workers"), name))  # first: if Redis fails, nothing changed
        self._specs.pop(name, None)
        return gone

    def specs(self) -> dict[str, WorkerSpec]:
        try:
            return self._read_specs()
        except redis.RedisError:
            return dict(self._specs)

    def _reconcile(self) -> None:
        if self._service is None:
            return
        if not self.is_writer:
            self._read_specs()
            self._service.sync_subscriptions({})
            self._failing = {}
            return
        failed = self._service.sync_subscriptions(self._read_specs)
        for name, e in failed.items():  # tried again each tick; logged once per reason
            why = f"{type(e).__name__}: {e}"
            if self._failing.get(name) != why:
                if "max_connections" in (getattr(e, "details", None) or {}):  # kept for HTTP (fds.ConnectionCap)
                    log.warning("worker %s: not subscribed (will retry): %s", name, e)
                else:
                    log.error("worker %s: cannot subscribe to its stream (will retry): %s", name, why)
        self._failing = {name: f"{type(e).__name__}: {e}" for name, e in failed.items()}

    # ---- writing (subscription thread, writer only) ----

    def add_worker(self, name: str, *, eagle: bool = False) -> None:
        with self._lock:
            if self.local is not None:
                if name not in self.local.workers():
                    self.local.add_worker(name)
                self.local.set_worker_eagle(name, eagle)

    def remove_worker(self, name: str) -> None:
        with self._lock:
            if self.local is None or name not in self.local.workers():
                return
            self.local.remove_worker(name)
            self.cursors.pop(name, None)
            self._resume.pop(name, None)
            self._flush(name, None)

    def clear_worker(self, name: str) -> None:
        with self._lock:
            if self.local is None or name not in self.local.workers():
                return
            self.local.clear_worker(name)
            self.cursors.pop(name, None)
            self._flush(name, None)

    def resume_seq(self, worker: str) -> int:
        return self._resume.get(worker, 0)

    def apply(self, worker: str, seq: int, payload: bytes, tier: str) -> ApplyStats:
        with self._lock:
            if self.local is None:
                raise NotWriter
            try:
                st = self.local.apply(worker, payload, tier)
            finally:
                self.cursors[worker] = seq
            self._flush(worker, seq)
            return st

    def _flush(self, worker: str, seq: int | None) -> None:
        """Mirrors the journal into Redis atomically (with the worker's cursor). On any failure
        the journal is gone, so the whole index is rewritten later (resync)."""
        assert self.local is not None
        engines, holders = self.local.take_changes()
        if self.needs_resync or not self.redis_ok:
            self.needs_resync = True
            return
        args: list[Any] = [self.ns, self.id, self.epoch or "", worker, "" if seq is None else seq, len(engines)]
        for w, engine, key, groups, last in engines:
            args += [w, engine, "" if key is None else f"{key} {groups[0]} {groups[1]} {groups[2]} {last}"]
        args.append(len(holders))
        for key, w, value in holders:
            args += [key, w, value]
        try:
            self._apply_script(args=args)
        except redis.ResponseError as e:
            if "NOTLEADER" in str(e):
                self.needs_resync = True
                log.warning("write refused: this replica is no longer the writer")
            else:
                self.needs_resync = True
                log.warning("write refused (%s); will resync", e)
        except redis.RedisError as e:
            self.needs_resync = True
            self.redis_ok = False
            self.errors += 1
            log.warning("redis write failed (%s); will resync", e)

    def _resync(self) -> None:
        """Rewrites the shared index from the in-process one, under a new epoch."""
        with self._lock:
            assert self.local is not None
            self.local.take_changes()
            epoch = uuid.uuid4().hex
            log.info("resyncing redis (epoch %s)", epoch)
            self.r.set(self.k("state"), "syncing")
            self.r.set(self.k("epoch"), epoch)  # any write under the old epoch now fails
            self._delete_data()
            pipe = self.r.pipeline(transaction=False)
            for name, spec in list(self._specs.items()):  # a snapshot: HTTP threads change it
                pipe.hset(self.k("workers"), name, json.dumps(spec.to_dict()))
            n = 0
            for worker, engine, key, groups, last in self.local.dump():
                pipe.hset(self.k("e", worker), engine, f"{key} {groups[0]} {groups[1]} {groups[2]} {last}")
                n += 1
                if n % CHUNK == 0:
                    pipe.execute()
            holders = self.local.dump_holders()
            for key, worker, value in holders:
                pipe.hset(self.k("k", str(key)), worker, value)
                n += 1
                if n % CHUNK == 0:
                    pipe.execute()
            for worker, seq in self.cursors.items():
                pipe.hset(self.k("cursor"), worker, seq)
            pipe.set(self.k("state"), "ready")
            pipe.execute()
            self.epoch = epoch
            self.needs_resync = False
            log.info("resync done: %d entries", len(holders))

    def _delete_data(self) -> None:
        """Deletes this namespace's entries, cursors and status, and nothing else: only keys of
        the shapes it writes (``{ns}:k:<digits>``, ``{ns}:e:<worker>``), so a namespace that
        extends this one (``{ns}:x``, see config.check_namespace) keeps its keys."""
        batch = [self.k("cursor"), self.k("status")]
        for kind, suffix in (("k", _DIGITS), ("e", _WORKER)):
            head = self.k(kind, "").encode()
            for key in self.r.scan_iter(match=self.k(kind, "*"), count=1000):
                if key.startswith(head) and suffix.fullmatch(key[len(head):]):
                    batch.append(key)
                if len(batch) >= 1000:
                    self.r.delete(*batch)
                    batch.clear()
        if batch:
            self.r.delete(*batch)

    def _publish_status(self) -> None:
        if self._service is None:
            return
        doc = {"writer": self.id, "streams": self._service.local_stream_status(), "size": self._local_size()}
        self.r.set(self.k("status"), json.dumps(doc), px=LEASE_MS * 2)

    def _local_size(self) -> dict[str, int]:
        with self._lock:
            if self.local is None:
                return {}
            st = self.local.stats()  # these three are counts, never None
            return {"keys": cast(int, st["keys"]), "entries": cast(int, st["entries"]),
                    "evictions": cast(int, st["evictions"])}

    # ---- reading (any replica) ----

    def score(self, tokens, block_size, lora_id, lora_name) -> ScoreResult:
        reasons = []
        try:
            keys = self.hasher.chain_keys(tokens, block_size, lora_id, lora_name)
            pipe = self.r.pipeline(transaction=False)
            pipe.mget(self.k("leader"), self.k("state"), self.k("epoch"))
            blocks: list[dict[str, int]] = []
            i, want = 0, 8
            first = True
            while i < len(keys) or first:
                for key in keys[i : i + want]:
                    pipe.hgetall(self.k("k", str(key)))
                res = pipe.execute()
                if first:
                    leader, state, _epoch = res[0]
                    res = res[1:]
                    if leader is None:
                        reasons.append("no live writer")
                    if state != b"ready":
                        reasons.append("redis index is being rebuilt")
                    first = False
                stop = False
                for h in res:
                    if not h:
                        stop = True
                        break
                    blocks.append(_entry(h))
                if stop or i + want >= len(keys):
                    break
                i += want
                want = min(want * 4, 512)
                pipe = self.r.pipeline(transaction=False)
            eagle = [name for name, spec in self.specs().items() if spec.eagle]
            matches = self.hasher.score_blocks(blocks, tokens, block_size, eagle)
            return ScoreResult(matches, stale=bool(reasons), stale_reasons=reasons)
        except redis.RedisError as e:
            self.errors += 1
            reasons.append(f"redis unreachable: {type(e).__name__}")
            with self._lock:
                if self.local is not None:  # the writer still has the freshest copy
                    return ScoreResult(self.local.lookup(tokens, block_size, lora_id, lora_name), True, reasons)
            return ScoreResult([], stale=True, stale_reasons=reasons)

    def size(self) -> dict[str, int]:
        size = (self.status_doc() or {}).get("size")
        if isinstance(size, dict) and all(
                isinstance(size.get(k), int) and not isinstance(size.get(k), bool) for k in ("keys", "entries", "evictions")):
            return size
        return self._local_size()

    def status_doc(self) -> dict | None:
        """The writer's published status; None when there is none, or none this replica can read
        (not a JSON object: a writer of another version, a damaged key). It is read on
        /workers, /metrics and /healthz: a bad one was a 500 on each."""
        try:
            raw = self.r.get(self.k("status"))
        except redis.RedisError:
            return None
        if not raw:
            return None
        try:
            doc = loads_strict_json(raw)
        except ConfigError:
            return None
        return doc if isinstance(doc, dict) else None

    def status_of_streams(self) -> dict[str, dict] | None:
        doc = self.status_doc()
        if doc is None:
            return None
        streams = doc.get("streams", {})
        if not isinstance(streams, dict):
            return {}
        return {name: st for name, st in streams.items() if isinstance(st, dict)}

    def health(self) -> tuple[bool, dict]:
        # A dead upkeep thread renews no lease and never notices Redis again: unhealthy.
        upkeep = self._thread is not None and self._thread.is_alive()
        return self.redis_ok and upkeep, {
            "redis": "ok" if self.redis_ok else "unreachable",
            "upkeep": "running" if upkeep else "stopped",
            "upkeep_errors": self.upkeep_errors,
            "writer": self.is_writer,
            "replica": self.id,
            "resyncing": self.needs_resync,
            "unsubscribed_workers": sorted(self._failing),
        }

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """For tests and tools: until some writer has published a complete index."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                leader, state = self.r.mget(self.k("leader"), self.k("state"))
                if leader is not None and state == b"ready":
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.05)
        return False


def _entry(h: dict[bytes, bytes]) -> dict[str, int]:
    """A block's hash ``{worker: tier bits}`` as Redis holds it; fields that are not a worker
    name and an integer in [0, 2**64) (a damaged key, a writer of another version) are left out, so a
    /score reading them is not a 500."""
    out: dict[str, int] = {}
    for w, t in h.items():
        try:
            name, bits = w.decode(), int(t)
        except (UnicodeDecodeError, ValueError):
            continue
        if 0 <= bits < 2**64:
            out[name] = bits
    return out
