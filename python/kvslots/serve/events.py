"""The KV events config ``kvslots serve`` gives vLLM (``--kv-events-config``): where vLLM's
publisher binds, the replay endpoint, and merging the one after ``--``.

vLLM 0.32's ``ZmqEventPublisher`` binds an endpoint containing ``*`` or ``::`` (or ``ipc://`` /
``inproc://``) and connects to any other, so the default endpoint is the IPv4-mapped loopback
``tcp://[::ffff:127.0.0.1]:5557`` (bound as 127.0.0.1:5557); the replay socket always binds, by
default on ``tcp://127.0.0.1:<port + data-parallel size>`` (vLLM adds the rank to both ports).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .._args import integer, text
from ..config.loader import brief as short
from ..errors import ArgumentTypeError, KVSlotsError, ServeError
from ..events.protocol import check_endpoint, vllm_binds
from .tail import merge_over_flags

DEFAULT_EVENTS_PORT = 5557
#: The IPv4-mapped IPv6 form of 127.0.0.1: it contains "::", so vLLM's publisher binds it (a plain
#: tcp://127.0.0.1:5557 would be connected to), and ZMQ binds it as the IPv4 loopback address.
LOOPBACK_BIND_HOST = "[::ffff:127.0.0.1]"
DEFAULT_EVENTS_ENDPOINT = f"tcp://{LOOPBACK_BIND_HOST}:{DEFAULT_EVENTS_PORT}"



#: A TCP endpoint and its port; at most 5 ASCII digits are read as a number (a longer run is not
#: a port, and int() of thousands of digits would raise).
_TCP_PORT = re.compile(r"tcp://(.+):([0-9]{1,5})", re.DOTALL)
_TCP_ANY_PORT = re.compile(r"tcp://.+:[0-9]+", re.DOTALL)


def _tcp_port(endpoint: str) -> tuple[str, int] | None:
    m = _TCP_PORT.fullmatch(endpoint)
    return (m.group(1), int(m.group(2))) if m else None


def _check_tail_values(cfg: dict[str, Any]) -> None:
    """What ``--kv-events-config`` after ``--`` may set is checked as the flags are (they were
    passed on: a port past 65535 or a pgm:// endpoint failed in vLLM once the engine was loaded,
    ``"enable_kv_cache_events": "yes"`` or a numeric topic at its start)."""
    where = "after --: --kv-events-config"
    for key in ("endpoint", "replay_endpoint"):
        value = cfg.get(key)
        if value is not None:
            try:
                check_endpoint(value, f"{where}: {key}")
            except KVSlotsError as e:
                raise ServeError(str(e)) from None
    for key, kind, what in (("enable_kv_cache_events", bool, "true or false"), ("topic", str, "a string"),
                            ("publisher", str, "a string")):
        if key in cfg and not isinstance(cfg[key], kind):
            raise ServeError(f"{where}: {key} must be {what}, got {short(cfg[key])}")
    if "topic" in cfg:
        _check_topic(cfg["topic"], f"{where}: topic")


def _check_topic(topic: str, name: str) -> None:
    """The topic is sent as UTF-8: one with a lone surrogate (bytes of the command line that are
    not UTF-8) failed in vLLM's publisher once the engine was loaded."""
    try:
        text(topic, name)
    except KVSlotsError as e:
        raise ServeError(str(e)) from None


def _clash(a: str, b: str, dp_size: int) -> bool:
    """Whether two bound endpoints share an address for some data-parallel rank: the same text,
    or TCP ports within ``dp_size`` of each other on the same host (``*`` is every host)."""
    ha, hb = _tcp_port(a), _tcp_port(b)
    if ha is None or hb is None:
        return a == b
    if 0 in (ha[1], hb[1]):  # port 0: the OS picks a free one
        return False
    hosts = {h.replace(LOOPBACK_BIND_HOST, "127.0.0.1") for h in (ha[0], hb[0])}
    return (len(hosts) == 1 or "*" in hosts) and abs(ha[1] - hb[1]) < max(1, dp_size)


def default_replay(endpoint: str, dp_size: int) -> str | None:
    hp = _tcp_port(endpoint)
    if hp is None or hp[1] == 0:
        return None
    port = hp[1] + max(1, dp_size)
    if port > 65535:
        return None
    return f"tcp://127.0.0.1:{port}"


_EVENT_FLAGS = {"endpoint": "--kv-events-endpoint", "replay_endpoint": "--kv-events-replay-endpoint",
                "topic": "--kv-events-topic"}


def events_config(args: argparse.Namespace, hints: dict[str, Any], tail_cfg: dict[str, Any] | None,
                   dp_size: int, notes: list[str]) -> dict[str, Any] | None:
    given = {k: getattr(args, "kv_events_" + k) for k in _EVENT_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if args.no_kv_events:
        if given:
            raise ServeError(f"{_EVENT_FLAGS[next(iter(given))]} configures the KV events, which "
                             "--no-kv-events turns off")
        if hints.get("kv_events"):
            notes.append("note: the YAML had TRT-LLM's KV cache events on; --no-kv-events leaves vLLM's off")
        return tail_cfg  # the user's own --kv-events-config after --, if any, as given
    if given.get("replay_endpoint", "").lower() == "none":
        given["replay_endpoint"] = None
    for k in ("endpoint", "replay_endpoint"):
        v = given.get(k)
        if v is not None and "://" not in v:
            raise ServeError(f"{_EVENT_FLAGS[k]} {v!r}: must be a ZMQ endpoint such as tcp://*:{DEFAULT_EVENTS_PORT}")
        if v is not None and _TCP_ANY_PORT.fullmatch(v):
            hp = _tcp_port(v)
            if hp is None or hp[1] > 65535:
                raise ServeError(f"{_EVENT_FLAGS[k]} {short(v, 80, plain=True)}: the port must be in 0..65535")
        if v is not None:  # the publisher's own rule (a scheme vLLM's ZMQ takes, the shifted port)
            try:
                check_endpoint(v, _EVENT_FLAGS[k], max(1, dp_size) - 1)
            except KVSlotsError as e:
                raise ServeError(f"{e} (a ZMQ endpoint such as tcp://*:{DEFAULT_EVENTS_PORT})") from None
    if "topic" in given:
        _check_topic(given["topic"], _EVENT_FLAGS["topic"])

    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": given.get("endpoint", DEFAULT_EVENTS_ENDPOINT)}
    if "topic" in given:
        cfg["topic"] = given["topic"]
    flags = {k: (v, f"{_EVENT_FLAGS[k]} {v}") for k, v in given.items()}
    merge_over_flags(cfg, tail_cfg or {}, "kv-events-config", flags, notes)
    if "replay_endpoint" not in cfg:
        cfg["replay_endpoint"] = (given["replay_endpoint"] if "replay_endpoint" in given
                                  else default_replay(str(cfg["endpoint"]), dp_size))
    if cfg["replay_endpoint"] is None:
        del cfg["replay_endpoint"]
    _check_tail_values(cfg)
    ep = str(cfg["endpoint"])
    replay = cfg.get("replay_endpoint")
    if replay is not None and vllm_binds(ep) and _clash(ep, str(replay), dp_size):
        # Both are bound: vLLM's second bind fails (EADDRINUSE) once the engine is loaded.
        raise ServeError(f"--kv-events-replay-endpoint {short(replay, 80, plain=True)} and --kv-events-endpoint {short(ep, 80, plain=True)} "
                         "bind the same address (vLLM adds the data-parallel rank to both ports): use "
                         "another one for the replay endpoint")
    if cfg.get("enable_kv_cache_events") and cfg.get("publisher") == "zmq" and not vllm_binds(ep):
        hp = _tcp_port(ep)
        hint = f"tcp://{LOOPBACK_BIND_HOST}:{hp[1]}" if hp else "an endpoint with '*' or '::'"
        notes.append(f"note: vLLM's publisher connects to {ep} (e.g. an XSUB proxy) instead of binding it: "
                     f"it binds only endpoints with '*' or '::'; to bind on loopback use {hint}")
    return cfg


def subscribe_endpoint(cfg: dict[str, Any] | None) -> str | None:
    """Where a subscriber on this host connects for the live events of ``cfg`` (None: events
    off, or an endpoint vLLM connects to instead of binding)."""
    if not cfg or not cfg.get("enable_kv_cache_events"):
        return None
    ep = str(cfg.get("endpoint", "tcp://*:5557"))
    if not vllm_binds(ep):
        return None
    return _connect_form(ep)


def replay_connect_endpoint(cfg: dict[str, Any] | None) -> str | None:
    """Where a subscriber on this host asks for replays (None: replay off; vLLM always binds
    the replay socket)."""
    ep = (cfg or {}).get("replay_endpoint")
    return _connect_form(str(ep)) if ep else None


def bound_tcp_addresses(cfg: dict[str, Any] | None, dp_size: int) -> list[tuple[str, int]]:
    """The (host, port) pairs vLLM's publisher and replay sockets bind over TCP, for every
    data-parallel rank (vLLM adds the rank to both ports); ``*`` is ``0.0.0.0`` (ZMQ binds IPv4
    there). Port 0 (the OS picks one) and ipc / inproc endpoints have nothing to check."""
    dp_size = integer(dp_size, "dp_size", 1)
    if cfg is not None and not isinstance(cfg, dict):
        raise ArgumentTypeError(f"cfg must be a dict, got {type(cfg).__name__}")
    if not cfg or not cfg.get("enable_kv_cache_events") or cfg.get("publisher", "zmq") != "zmq":
        return []
    ep = str(cfg.get("endpoint", DEFAULT_EVENTS_ENDPOINT))
    bound = [ep] if vllm_binds(ep) else []
    if cfg.get("replay_endpoint"):
        bound.append(str(cfg["replay_endpoint"]))
    out: list[tuple[str, int]] = []
    for ep in bound:
        hp = _tcp_port(ep)
        if hp is None or hp[1] == 0:
            continue
        host = {"*": "0.0.0.0", LOOPBACK_BIND_HOST: "127.0.0.1"}.get(hp[0], hp[0].strip("[]"))
        out.extend((host, hp[1] + rank) for rank in range(max(1, dp_size)) if hp[1] + rank <= 65535)
    return out


def _connect_form(bound: str) -> str:
    return bound.replace("*", "127.0.0.1").replace(LOOPBACK_BIND_HOST, "127.0.0.1")


__all__ = ["DEFAULT_EVENTS_ENDPOINT", "LOOPBACK_BIND_HOST", "bound_tcp_addresses", "default_replay", "events_config",
           "replay_connect_endpoint", "subscribe_endpoint", "vllm_binds"]
