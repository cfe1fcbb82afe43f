"""The ``kvslots serve`` command line: its parser (everything after ``--`` is vLLM's) and the
command, which prints the plan's vLLM command and runs it under the supervisor.

    kvslots serve MODEL [--extra-engine-args FILE.yaml] [--speculative-config JSON] [--verifier MODEL]
                        [--slot-manager {kvslots,vllm}] [--host-cache-gb N] [--disk-path DIR] [--disk-gb N]
                        [--connector-config JSON] [--no-connector]
                        [--role {prefill,decode,both}] [--is-prefill-worker] [--pd-host ADDR] [--pd-port PORT]
                        [--kv-events-endpoint EP] [--kv-events-replay-endpoint EP] [--kv-events-topic T]
                        [--no-kv-events] [--host 127.0.0.1] [--port 8000] [--grace-period 15]
                        [--dry-run] [-q] [-- VLLM_ARGS...]

Bad input exits with status 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._listen import check_listen
from ..cli import OneLineParser, one_line, output
from ..errors import ConfigError, ServeError
from .events import DEFAULT_EVENTS_ENDPOINT
from .plan import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    PROG,
    SCHEDULER_CLS,
    SLOT_MANAGERS,
    ServePlan,
    build_plan,
)
from .supervisor import DEFAULT_GRACE_S, supervise
from .tail import check_argv


class _ServeParser(OneLineParser):
    """Everything after the first ``--`` is vLLM's (``vllm_args``); errors are one line (without
    OneLineParser's "see --help"); an option's value ``--`` is OneLineParser's rule."""

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
        # one_line: an unknown option is shown as given, and a newline in it made two lines.
        print(one_line(f"{PROG}: error: {message}"), file=sys.stderr)
        raise SystemExit(2)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):  # inf GiB or seconds would overflow a size or a deadline
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
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


DEFAULT_PD_PORT = 17600


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
    m = p.add_argument_group("device KV blocks")
    # default None, not "kvslots": an explicit --slot-manager that contradicts a --scheduler-cls
    # after -- is an error, the default is not.
    m.add_argument("--slot-manager", choices=SLOT_MANAGERS, default=None,
                   help=f"who allocates vLLM's device KV blocks. kvslots (default): scheduler mode, the "
                        f"kvslots Rust core is vLLM's KV cache manager (--scheduler-cls {SCHEDULER_CLS}, "
                        "its async variant when vLLM schedules asynchronously); vllm: vLLM's own KV cache "
                        "manager. Use vllm for what scheduler mode refuses at start-up (hybrid models, "
                        "sliding window, encoder caches, ...). A --scheduler-cls after -- replaces the "
                        "default; contradicting an explicit --slot-manager is an error")
    g = p.add_argument_group("KVSlotsConnector")
    g.add_argument("--host-cache-gb", type=_positive_float, metavar="N",
                   help="host-memory tier per worker in GiB (default: the YAML's "
                        "kv_cache_config.host_cache_size, else the connector's 4)")
    g.add_argument("--disk-path", metavar="DIR",
                   help="disk tier under the host tier: a directory for its file (default: no disk tier)")
    g.add_argument("--disk-gb", type=_positive_float, metavar="N",
                   help="disk tier size per worker in GiB (default 16; needs --disk-path)")
    g.add_argument("--connector-config", metavar="JSON",
                   help="more kv_connector_extra_config keys, e.g. '{\"copy_threads\": 2}'")
    g.add_argument("--no-connector", action="store_true", help="run vLLM without the KVSlotsConnector")
    d = p.add_argument_group("disaggregated prefill/decode (KV of target and draft layers over Mooncake)")
    d.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                   help="prefill: compute prompts and hold their KV for a decode worker (kv_producer); "
                        "decode: pull it and decode (kv_consumer); both (default): no disaggregation")
    d.add_argument("--is-prefill-worker", action="store_true", help="the same as --role prefill (Dynamo's flag)")
    d.add_argument("--pd-host", metavar="ADDR",
                   help="address peers reach this worker's Mooncake engine and control socket at: a host name "
                        "or IPv4 address, not a wildcard (default 127.0.0.1)")
    d.add_argument("--pd-port", type=_port, metavar="PORT",
                   help=f"prefill worker: its control port, which decode workers reach (default {DEFAULT_PD_PORT})")
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


_DESCRIPTION = f"""\
Start vLLM's OpenAI-compatible server in kvslots scheduler mode: the kvslots
Rust core allocates vLLM's device KV blocks (vLLM's --scheduler-cls
{SCHEDULER_CLS}); --slot-manager vllm keeps vLLM's own
KV cache manager. With the KVSlotsConnector, a converted TensorRT-LLM engine
YAML, speculative decoding and KV events. Prints the vLLM command first; Ctrl-C
stops the server and every process it started."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    saved = sub._parser_class
    sub._parser_class = _ServeParser
    try:
        p = sub.add_parser("serve", help="start vLLM in kvslots scheduler mode with the KVSlotsConnector, "
                                         "converted config and KV events",
                           description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    finally:
        sub._parser_class = saved
    _add_arguments(p)
    p.set_defaults(func=run)


class _PlanParser(_ServeParser):
    """:func:`plan_from_argv`'s parser: an argument error is a ServeError, as every other bad
    input of a Python call is (it was a line on stderr and SystemExit; ``--help`` printed the
    help and exited 0). No ``-h``/``--help``: an unknown option there."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ServeError(one_line(message))


def plan_from_argv(argv: Sequence[str], *, python: str | None = None) -> ServePlan:
    """Parses ``kvslots serve`` arguments (without ``serve``) and builds the plan. Bad input,
    an argument error included, raises :class:`~kvslots.ServeError` (or a ConfigError)."""
    check_argv(argv, "argv")
    if python is not None:
        check_argv([python], "python")  # an int or a NUL went into the command as given
        if not python:  # was taken as "no interpreter given"
            raise ServeError("python: an empty path names no interpreter")
    parser = _PlanParser(prog=PROG, allow_abbrev=False, add_help=False)
    _add_arguments(parser)
    return build_plan(parser.parse_args(list(argv)), python=python)


#: Exit status after a Ctrl-C (SIGINT) that came before vLLM started: 128 + SIGINT, as a shell reports it.
INTERRUPTED_STATUS = 130


def run(args: argparse.Namespace) -> int:
    # Bad input (a ServeError, or a ConfigError from the converters) raises; kvslots.cli.main
    # prints it as one line and exits with status 2.
    try:
        return _run(args)
    except KeyboardInterrupt:
        # Ctrl-C before supervise's handlers are in place (a slow model directory or config, a
        # host name to resolve) was a KeyboardInterrupt traceback. Nothing was started by then
        # (supervise forwards a Ctrl-C to vLLM once it runs): one line and 128 + SIGINT.
        print(f"{PROG}: interrupted before vLLM started", file=sys.stderr, flush=True)
        return INTERRUPTED_STATUS


def _run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    # Every check comes before the first line is printed: an error is then the only line (a
    # note and the vLLM command came first when the address check below failed).
    out = output() if args.dry_run else sys.stdout  # output(): stdout closed is an error of --dry-run
    if not args.dry_run:
        # vLLM would find a port in use or a host that does not resolve only once it runs (its
        # traceback, exit status 1): one line here instead, before anything starts.
        check_listen(plan.host if plan.host is not None else DEFAULT_HOST,
                     plan.port if plan.port is not None else DEFAULT_PORT)
        # Likewise the events sockets: a port in use failed vLLM's publisher once the engine
        # was loaded (ZMQError: Address already in use, after the model load).
        for host, port in plan.events_bind_addresses():
            try:
                check_listen(host, port)
            except ConfigError as e:
                raise ServeError(f"KV events: {e} (--kv-events-endpoint / --kv-events-replay-endpoint, "
                                 "or --no-kv-events)") from None
        # And the P/D control socket: a --pd-port in use failed the connector once the model
        # was loaded (TransferError 'P/D control socket cannot bind', vLLM's traceback).
        pd = plan.pd_bind_address()
        if pd is not None:
            try:
                check_listen(*pd)
            except ConfigError as e:
                raise ServeError(f"P/D control socket: {e} (--pd-host / --pd-port)") from None
    if not args.quiet:
        for line in plan.notes:
            print(one_line(f"{PROG}: {line}"), file=sys.stderr)  # a YAML key may hold a newline or an escape
    print(plan.shell(), file=out, flush=True)
    if args.dry_run:
        return 0
    if not args.quiet:
        sub = plan.events_subscribe_endpoint()
        if sub:
            replay = (plan.kv_events_config or {}).get("replay_endpoint")
            print(f"{PROG}: KV events: subscribe at {sub}" + (f", replay at {replay}" if replay else ""),
                  file=sys.stderr, flush=True)
            print(f"{PROG}: prefix-cache index: kvslots indexer --worker {plan.indexer_worker()}",
                  file=sys.stderr, flush=True)
    sys.stderr.flush()
    # restore_signals=False: a Ctrl-C or SIGTERM after vLLM exited (one more press while it
    # stopped) ended kvslots serve by that signal, or as "interrupted before vLLM started".
    return supervise(plan.argv, env={**os.environ, **plan.env}, grace=args.grace_period, restore_signals=False)


__all__ = ["add_parser", "make_parser", "plan_from_argv", "run"]
