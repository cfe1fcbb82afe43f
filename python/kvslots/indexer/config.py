"""Configuration of ``kvslots indexer``: worker specs from the command line or a YAML file."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..config.loader import brief, read_config_text
from ..config.loader import load_yaml as load_config_yaml
from ..errors import ConfigError, KVSlotsError
from ..events.protocol import MAX_FRAME_BYTES, check_connect_endpoint
from .fds import check_max_connections

TIERS = ("GPU", "CPU", "STORAGE")
DEFAULT_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
ADMIN_TOKEN_ENV = "KVSLOTS_INDEXER_ADMIN_TOKEN"

#: A worker name (also the suffix of its Redis keys).
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: Largest tier weight: a score (weight x blocks, up to 2**24 blocks) stays finite and exact enough.
MAX_TIER_WEIGHT = 1e6
#: A Redis namespace: ':'-separated segments. No glob characters (it is a SCAN pattern), and no
#: segment "k" or "e" (those key kinds take a suffix, so such a namespace would overlap the keys
#: of the namespace before that segment).
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)*", re.ASCII)
_KEY_KINDS_WITH_SUFFIX = ("k", "e")


def check_endpoint(endpoint: str, what: str = "endpoint") -> None:
    """The subscriber's rule for a worker's address (:func:`kvslots.events.protocol.check_connect_endpoint`),
    as a ConfigError."""
    try:
        check_connect_endpoint(endpoint, what)
    except KVSlotsError as e:
        raise ConfigError(str(e)) from None


def same_address(a: str, b: str) -> bool:
    """Whether two endpoints that passed :func:`check_endpoint` name one address: a tcp one
    compared as (host, port number), the host name without case and an IPv6 address in its
    normal form (``tcp://H:01`` and ``tcp://h:1``, ``[::1]`` and ``[0::1]``); ipc and inproc
    ones as text."""
    return _address(a) == _address(b)


def _address(endpoint: str) -> tuple[str, str, int | str]:
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return scheme, rest, ""
    host, _, port = rest.rpartition(":")
    if host.startswith("["):
        try:
            host = f"[{ipaddress.IPv6Address(host[1:-1])}]"
        except ValueError:  # not an address (unchecked): its text is all there is to compare
            pass
    # A port is at most 5 digits once checked; the text of one that is not, as it is.
    return scheme, host.lower(), int(port) if port.isascii() and port.isdigit() and len(port) <= 16 else port


def check_worker_name(name: Any) -> None:
    """A worker's name (:data:`WORKER_NAME`), as a ConfigError; also the rule for the names
    ``kvslots proxy --decode URL=WORKER`` looks up in the indexer."""
    if not isinstance(name, str) or not WORKER_NAME.fullmatch(name):
        raise ConfigError(f"worker name {brief(name)}: use 1-128 letters, digits, '.', '_', ':', '-' "
                          "(starting with a letter or digit)")


def check_namespace(ns: str) -> None:
    """The Redis key namespace: segments of letters, digits, '_', '.', '-' joined by ':', none of
    them 'k' or 'e', at most 200 characters (see :data:`_NAMESPACE`)."""
    if (not isinstance(ns, str) or len(ns) > 200 or not _NAMESPACE.fullmatch(ns)
            or any(seg in _KEY_KINDS_WITH_SUFFIX for seg in ns.split(":"))):
        raise ConfigError(
            f"redis namespace {brief(ns)}: use 1-200 letters, digits, '_', '.', '-' in segments joined by ':' "
            "(none of them 'k' or 'e', which would overlap another namespace's keys), e.g. kvslots:indexer"
        )


def redact_url(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    return re.sub(r"(?<=://)[^@]*(?=@)", "***", url, count=1)


#: Query options of a Redis URL that redis-py parses without checking the value, and the rule
#: each must meet: a NaN, negative, zero or huge timeout (or a negative read size) failed at
#: connect time with a ValueError or OverflowError, every route a 500; retry_on_error parses as a
#: list of characters (a TypeError on the first error). Absent options keep the backend's values.
_REDIS_URL_OPTIONS: dict[str, tuple[Any, str]] = {
    "socket_timeout": (lambda v: 0 < v <= 86400, "must be a number of seconds in (0, 86400]"),
    "socket_connect_timeout": (lambda v: 0 < v <= 86400, "must be a number of seconds in (0, 86400]"),
    "health_check_interval": (lambda v: 0 <= v <= 86400, "must be a number of seconds in [0, 86400]"),
    "socket_read_size": (lambda v: v >= 1, "must be an integer >= 1"),
    "db": (lambda v: v >= 0, "must be a database number >= 0"),
    "retry_on_error": (lambda v: False, "cannot be given in a URL (it is a list of exception classes)"),
}


def check_redis_url(url: str) -> None:
    """What redis-py accepts as a connection URL (it is the judge of the form), with the values of
    :data:`_REDIS_URL_OPTIONS` checked, as a ConfigError."""
    try:
        import redis
    except ImportError:
        raise ConfigError("the redis backend needs redis-py: pip install 'kvslots[indexer]'") from None

    def bad(why: str) -> ConfigError:
        return ConfigError(f"redis_url {brief(redact_url(url))}: {why} (use redis://HOST:PORT/DB, "
                           "rediss://... or unix:///PATH)")

    # redis-py reads a path that is not a number as no database at all (redis://h/abc is db 0) and
    # strips every '/' of one that is (redis://h/1/2 is db 12), and takes the first of an option
    # given twice: each would be a database or a setting nobody asked for.
    try:
        parts = urlsplit(url)
    except ValueError as e:  # redis://[::1: redis-py's own parser says the same
        raise bad(str(e)) from None
    if parts.scheme in ("redis", "rediss") and parts.path not in ("", "/") \
            and not re.fullmatch(r"/-?[0-9]+", parts.path):  # a negative db: refused below, as db=-N
        raise bad(f"the path {brief(parts.path)} is not /DB (a database number)")
    names = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)]
    twice = sorted({k for k in names if names.count(k) > 1})
    if twice:
        raise bad(f"{', '.join(twice)} given twice")
    try:
        client = redis.Redis.from_url(url)
        client.connection_pool.make_connection()  # checks the URL's options; connects to nothing
    except (ValueError, TypeError, redis.RedisError) as e:  # protocol=9: a redis ConnectionError
        raise bad(str(e)) from None
    given = client.connection_pool.connection_kwargs
    host = given.get("host")
    if isinstance(host, str):
        # The socket module sends a host name through the IDNA codec: one it cannot encode
        # (a label of 64+ characters, an empty one as in "a..b", a lone surrogate from argv's
        # bad UTF-8) was a UnicodeError on every connect, not a redis error: every route a 500.
        try:
            host.encode("idna")
        except UnicodeError as e:
            raise bad(f"the host {brief(host)} is not a host name ({e})") from None
    if parts.scheme in ("redis", "rediss") and parts.port == 0:  # redis-py took it for 6379
        raise bad("port 0 is no port to connect to")
    for key, (ok, what) in _REDIS_URL_OPTIONS.items():
        if key in given and given[key] is not None and not ok(given[key]):
            raise bad(f"{key}={brief(given[key])} {what}")


@dataclass(frozen=True)
class WorkerSpec:
    """One event stream: a vLLM engine's (or kvslots') ZMQ publisher.

    ``tier`` is the tier of events that carry no medium, and the tier an ``AllBlocksCleared``
    on this stream clears (vLLM's GPU block pool publishes ``GPU``). ``eagle``: the worker runs
    an EAGLE-family drafter (EAGLE, EAGLE-3, MTP), so its scores count the last block of a
    prefix only when its engine serves it from cache (docs/indexer.md, "EAGLE workers").
    """

    name: str
    endpoint: str
    replay: str | None = None
    topic: str = ""
    tier: str = "GPU"
    eagle: bool = False

    def __post_init__(self) -> None:
        check_worker_name(self.name)
        check_endpoint(self.endpoint, f"worker {self.name!r}: endpoint")
        if self.replay is not None:
            check_endpoint(self.replay, f"worker {self.name!r}: replay")
            # One address cannot be both the PUB and the ROUTER socket; compared as addresses
            # (tcp://h:01 is tcp://h:1), not as text.
            if same_address(self.replay, self.endpoint):
                raise ConfigError(f"worker {self.name!r}: replay {self.replay!r} is the endpoint too: the publisher "
                                  "binds its replay socket on another address")
        if self.tier not in TIERS:
            raise ConfigError(f"worker {self.name!r}: tier {brief(self.tier)} is not one of {', '.join(TIERS)}")
        if not isinstance(self.topic, str) or len(self.topic) > 256:
            raise ConfigError(f"worker {self.name!r}: the topic must be a string of at most 256 characters")
        try:
            self.topic.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"worker {self.name!r}: the topic is not valid Unicode") from None
        if type(self.eagle) is not bool:
            raise ConfigError(f"worker {self.name!r}: eagle must be true or false, got {self.eagle!r}")

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """``NAME=tcp://host:port[,replay=tcp://host:port][,topic=T][,tier=GPU|CPU|STORAGE]
        [,eagle=true|false]``."""
        if not isinstance(text, str):
            raise ConfigError(f"--worker must be a string, got {type(text).__name__}")
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise ConfigError(f"--worker {text!r}: expected NAME=tcp://host:port[,replay=...][,topic=...][,tier=...]"
                              "[,eagle=...]")
        endpoint, *opts = rest.split(",")
        kw: dict[str, Any] = {}
        for opt in opts:
            k, eq, v = opt.partition("=")
            if not eq or k not in ("replay", "topic", "tier", "eagle"):
                raise ConfigError(f"--worker {text!r}: unknown option {opt!r} (replay=, topic=, tier=, eagle=)")
            if k in kw:  # tier=GPU,tier=CPU was the last one, silently
                raise ConfigError(f"--worker {text!r}: {k}= given twice")
            if k == "eagle":
                if v.lower() not in ("true", "false"):
                    raise ConfigError(f"--worker {text!r}: eagle={v!r}: use eagle=true or eagle=false")
                kw[k] = v.lower() == "true"
            else:
                kw[k] = v.upper() if k == "tier" else v
        return cls(name=name.strip(), endpoint=endpoint.strip(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerSpec:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"worker {d.get('name')!r}: unknown keys {sorted(unknown)}")
        if "name" not in d or "endpoint" not in d:
            raise ConfigError(f"worker {brief(d)}: 'name' and 'endpoint' are required")
        tier = str(d.get("tier", "GPU")).upper()
        return cls(
            name=str(d["name"]),
            endpoint=str(d["endpoint"]),
            replay=None if d.get("replay") is None else str(d["replay"]),
            topic=str(d.get("topic", "")),
            tier=tier,
            eagle=d.get("eagle", False),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class IndexerConfig:
    workers: list[WorkerSpec] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8200
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_namespace: str = "kvslots:indexer"
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    capacity: int | None = 4_000_000
    block_size: int = 16
    max_tokens: int = 262_144
    admin_token: str | None = None
    replay_timeout: float = 2.0
    #: Largest event frame taken from a worker (MiB); a bigger one drops the connection, which the
    #: subscriber reopens (events.subscriber). The default holds a step of about 7M tokens.
    max_frame_mb: int = MAX_FRAME_BYTES // 2**20
    #: Most HTTP connections open at once (503 beyond); None: what the file descriptor limit
    #: leaves once the workers' subscriptions are set aside, less for workers added later
    #: (:class:`kvslots.indexer.fds.ConnectionCap`).
    max_connections: int | None = None
    log_level: str = "info"

    @property
    def max_body_bytes(self) -> int:
        # A token id is at most 10 digits plus a separator in JSON; room for the other fields.
        return self.max_tokens * 12 + 4096

    def validate(self) -> None:
        """The settings' rules; also normalizes ``capacity`` 0 to ``None`` (no limit). The types
        are the YAML's (:data:`_YAML_SETTINGS`): a config built in code gets the same checks
        (port="x" was a TypeError comparing it)."""
        for k, (kinds, what) in _YAML_SETTINGS.items():
            _typed(getattr(self, k), k, kinds, what, None)
        if not isinstance(self.workers, list) or not all(isinstance(w, WorkerSpec) for w in self.workers):
            raise ConfigError(f"workers must be a list of WorkerSpec, got {brief(self.workers)}")
        if not isinstance(self.tier_weights, dict) or not all(
                isinstance(t, str) and isinstance(w, (int, float)) and not isinstance(w, bool)
                for t, w in self.tier_weights.items()):
            raise ConfigError(f"tier_weights must be a mapping of tier name to number, got {brief(self.tier_weights)}")
        if not self.host.strip():  # "" bound every address, silently (as 0.0.0.0 and :: would, said)
            raise ConfigError(f"host {self.host!r}: give an address to bind, e.g. 127.0.0.1 (0.0.0.0: every address)")
        if self.backend not in ("memory", "redis"):
            raise ConfigError(f"backend {self.backend!r}: use 'memory' or 'redis'")
        # Counted once (WorkerSpec checks each name is a str): names.count() for each was quadratic,
        # ~10 s of a 14,284-worker config's start.
        dup = {n for n, times in Counter(w.name for w in self.workers).items() if times > 1}
        if dup:
            raise ConfigError(f"worker names given twice: {sorted(dup)}")
        for t, w in self.tier_weights.items():
            if t not in TIERS:
                raise ConfigError(f"tier weight for {t!r}: tiers are {', '.join(TIERS)}")
            if not 0.0 <= w <= MAX_TIER_WEIGHT:
                raise ConfigError(f"tier weight {t}={w}: must be a number in [0, {MAX_TIER_WEIGHT:g}]")
        if self.capacity == 0:
            self.capacity = None
        if self.capacity is not None and not 0 <= self.capacity <= 2**63 - 1:
            raise ConfigError(f"capacity {self.capacity}: must be in [0, 2**63-1] (0 or null: no limit)")
        if not 1 <= self.block_size <= 65536:
            raise ConfigError(f"block_size {self.block_size}: must be in [1, 65536]")
        if not 1 <= self.max_tokens <= 16_777_216:
            raise ConfigError(f"max_tokens {self.max_tokens}: must be in [1, 16777216]")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port}: must be in [0, 65535]")
        if not 0 < self.replay_timeout <= MAX_REPLAY_TIMEOUT:
            raise ConfigError(f"replay_timeout {self.replay_timeout}: must be in (0, {MAX_REPLAY_TIMEOUT:g}] seconds")
        if not 1 <= self.max_frame_mb <= MAX_FRAME_MB:
            raise ConfigError(f"max_frame_mb {self.max_frame_mb}: must be in [1, {MAX_FRAME_MB}] (MiB)")
        if self.max_connections is not None:
            check_max_connections(self.max_connections)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        if self.admin_token is not None:
            if len(self.admin_token) < 16:
                raise ConfigError("admin token: use at least 16 characters")
            # HTTP headers are bytes: only printable ASCII can ever be sent back and match.
            if not (self.admin_token.isascii() and self.admin_token.isprintable()) \
                    or self.admin_token != self.admin_token.strip():
                raise ConfigError("admin token: use printable ASCII characters only (no leading or trailing spaces)")
        check_namespace(self.redis_namespace)
        if self.backend == "redis":
            check_redis_url(self.redis_url)


def parse_weight(text: str) -> tuple[str, float]:
    tier, eq, value = text.partition("=")
    try:
        if not eq:
            raise ValueError
        return tier.strip().upper(), float(value)
    except ValueError:
        raise ConfigError(f"--tier-weight {text!r}: expected TIER=WEIGHT, e.g. CPU=0.8") from None


def load_yaml(path: str) -> dict[str, Any]:
    """The ``--config`` file: read and parsed under the limits and rules of
    :mod:`kvslots.config.loader`; an empty file is an empty mapping."""
    data = load_config_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping, got {_kind(data)}", None, path)
    return data


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_REPLAY_TIMEOUT = 3600.0
MAX_FRAME_MB = 4096  # a single frame past 4 GiB is not an event batch


def _typed(value: Any, key: str, kinds: tuple[type, ...], what: str, path: str | None) -> Any:
    """``value`` if it is one of ``kinds`` (never a bool for a number), else a ConfigError."""
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ConfigError(f"must be {what}, got {_kind(value)} {brief(value)}", key, path)
    return value


#: The YAML's settings: (types accepted, what the message says). ``None`` is accepted where
#: ``type(None)`` is listed.
_YAML_SETTINGS: dict[str, tuple[tuple[type, ...], str]] = {
    "host": ((str,), "a string"),
    "port": ((int,), "an integer"),
    "backend": ((str,), "a string"),
    "redis_url": ((str,), "a string"),
    "redis_namespace": ((str,), "a string"),
    "capacity": ((int, type(None)), "an integer or null"),
    "block_size": ((int,), "an integer"),
    "max_tokens": ((int,), "an integer"),
    "admin_token": ((str, type(None)), "a string or null"),
    "replay_timeout": ((int, float), "a number"),
    "max_frame_mb": ((int,), "an integer"),
    "max_connections": ((int, type(None)), "an integer or null"),
    "log_level": ((str,), "a string"),
}


def _config_from_yaml(path: str) -> IndexerConfig:
    """The settings the ``--config`` file gives over the defaults, validated: every problem is a
    ConfigError naming the file (and the key)."""
    data = load_yaml(path)
    cfg = IndexerConfig()
    unknown = set(data) - _YAML_KEYS
    if unknown:
        raise ConfigError(f"unknown keys {sorted(map(str, unknown))}", None, path)
    workers = data.get("workers")
    if workers is not None:
        _typed(workers, "workers", (list,), "a list of mappings", path)
    for i, d in enumerate(workers or []):
        if not isinstance(d, dict):
            raise ConfigError(f"must be a mapping, got {_kind(d)} {brief(d)}", f"workers[{i}]", path)
        for k, v in d.items():
            if not isinstance(k, str):
                raise ConfigError(f"keys must be strings, got {_kind(k)} {brief(k)}", f"workers[{i}]", path)
            if k == "eagle":
                _typed(v, f"workers[{i}].{k}", (bool,), "true or false", path)
            elif v is not None or k != "replay":
                _typed(v, f"workers[{i}].{k}", (str, int), "a string", path)
        try:
            cfg.workers.append(WorkerSpec.from_dict(d))
        except ConfigError as e:
            raise ConfigError(str(e), None, path) from None
    for k, (kinds, what) in _YAML_SETTINGS.items():
        if k in data:
            setattr(cfg, k, _typed(data[k], k, kinds, what, path))
    weights = data.get("tier_weights")
    if weights is not None:
        _typed(weights, "tier_weights", (dict,), "a mapping of TIER: WEIGHT", path)
        seen: set[str] = set()
        for t, w in weights.items():
            _typed(w, f"tier_weights.{t}", (int, float), "a number", path)
            tier = str(t).upper()
            if tier in seen:  # gpu and GPU: one of the two would be dropped silently
                raise ConfigError(f"tier {tier} given twice (tier names ignore case)", f"tier_weights.{t}", path)
            seen.add(tier)
            cfg.tier_weights[tier] = float(w)
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(str(e), None, path) from None
    return cfg


_YAML_KEYS = {
    "workers", "host", "port", "backend", "redis_url", "redis_namespace", "tier_weights", "capacity",
    "block_size", "max_tokens", "admin_token", "replay_timeout", "max_frame_mb", "max_connections", "log_level",
}


def build_config(args: Any) -> IndexerConfig:
    """Command-line arguments over the YAML file over defaults."""
    config = getattr(args, "config", None)
    cfg = _config_from_yaml(config) if config is not None else IndexerConfig()  # "" is an error, not none
    for text in getattr(args, "worker", None) or []:
        cfg.workers.append(WorkerSpec.parse(text))
    flagged: set[str] = set()
    for text in getattr(args, "tier_weight", None) or []:
        t, w = parse_weight(text)
        if t in flagged:  # which one was meant? (the last one was taken silently)
            raise ConfigError(f"--tier-weight {text!r}: tier {t} is given twice")
        flagged.add(t)
        cfg.tier_weights[t] = w
    for k in ("host", "port", "backend", "redis_url", "redis_namespace", "block_size", "max_tokens",
              "replay_timeout", "max_frame_mb", "max_connections", "log_level"):
        v = getattr(args, k, None)
        if v is not None:
            setattr(cfg, k, v)
    if getattr(args, "capacity", None) is not None:
        cfg.capacity = args.capacity  # 0: no limit (validate)
    token = getattr(args, "admin_token", None)
    if getattr(args, "admin_token_file", None) is not None:
        token = read_config_text(args.admin_token_file, max_bytes=4096).strip()
    if token == "":  # given and empty: not silently the environment's or the YAML's token
        raise ConfigError("admin token: --admin-token / --admin-token-file gave an empty token")
    cfg.admin_token = token or os.environ.get(ADMIN_TOKEN_ENV) or cfg.admin_token
    cfg.validate()
    return cfg
