"""``kvslots indexer``: the command."""

from __future__ import annotations

import argparse
import logging
import sys

from .._fds import raise_limit
from .._listen import check_listen
from .._ratelog import quiet_logs
from .config import ADMIN_TOKEN_ENV, build_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "indexer",
        help="prefix-cache index service: which worker holds how much of a prompt",
        description=(
            "Subscribes to workers' KV event streams (vLLM --kv-events-config ZMQ publishers, and "
            "kvslots' host-tier ones), keeps a prefix index of which worker holds which block on "
            "which tier, and answers POST /score over HTTP. See docs/indexer.md."
        ),
    )
    p.add_argument("--worker", action="append",
                   metavar="NAME=tcp://HOST:PORT[,replay=...][,topic=...][,tier=...][,eagle=true]",
                   help="a worker's event stream (repeatable); tier= is the tier of events without a medium; "
                        "eagle=true for an EAGLE-family drafter (its last matched block counts only when served)")
    p.add_argument("--config", metavar="FILE.yaml", help="settings and workers from a YAML file")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8200)")
    p.add_argument("--backend", choices=["memory", "redis"], help="where the index lives (default memory)")
    p.add_argument("--redis-url", help="redis://host:port/db for --backend redis")
    p.add_argument("--redis-namespace", help="key prefix in Redis (default kvslots:indexer)")
    p.add_argument("--tier-weight", action="append", metavar="TIER=WEIGHT",
                   help="score weight of a tier (default GPU=1.0 CPU=0.8 STORAGE=0.5)")
    p.add_argument("--capacity", type=int,
                   help="most (block, worker) entries kept, LRU-evicted beyond (default 4000000; 0 = no limit)")
    p.add_argument("--block-size", type=int, help="block size of /score requests that name none (default 16)")
    p.add_argument("--max-tokens", type=int, help="most token ids /score scores: of a longer prompt the first "
                   "(truncated: true); bodies are capped accordingly (default 262144)")
    p.add_argument("--replay-timeout", type=float, help="seconds to wait for a replay answer (default 2)")
    p.add_argument("--max-frame-mb", type=int, metavar="MIB",
                   help="largest event frame taken from a worker; a bigger one drops the connection, which is "
                        "reopened (default 64, about a 7M-token step)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="most HTTP connections open at once; one more is answered 503 and closed (default: what "
                        "the file descriptor limit, ulimit -n, leaves once the workers' subscriptions are set aside)")
    p.add_argument("--admin-token", help=f"bearer token enabling POST/DELETE /workers (prefer {ADMIN_TOKEN_ENV} "
                                         "or --admin-token-file: arguments are visible to other users)")
    p.add_argument("--admin-token-file", metavar="FILE", help="read the admin token from FILE")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="the service's log level (default info)")
    p.set_defaults(func=run, error_label=None)  # errors read "kvslots indexer: ..."


def run(args: argparse.Namespace) -> int:
    # A bad setting or --config file raises a ConfigError naming it; kvslots.cli.main prints it
    # as one line, "kvslots indexer: FILE: PROBLEM", and exits with status 2.
    raise_limit()  # first: how many workers and connections fit is derived from it
    cfg = build_config(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from . import fds
        from .app import create_app
        from .httpguard import uvicorn_options
        from .service import IndexerService
    except ImportError as e:
        print(f"kvslots indexer: {e.name} is missing; install the service's extra: pip install 'kvslots[indexer]'",
              file=sys.stderr)
        return 2

    check_listen(cfg.host, cfg.port)
    # uvicorn's lines a peer can trigger (one per malformed request) rate-limited, as the proxy's
    # (uvicorn's logging set-up keeps a logger's filters)
    quiet_logs()
    if cfg.backend == "redis":  # its host looked up with a bound, as the one to listen on
        from .redis_backend import check_redis_resolves

        check_redis_resolves(cfg.redis_url)
    service = IndexerService(cfg)
    log = logging.getLogger("kvslots.indexer")
    if cfg.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("binding %s: the API is reachable from other hosts (scores are not secret, but the "
                    "admin API %s)", cfg.host, "is enabled" if cfg.admin_token else "is off")
    # Started here, not in the app's startup: a worker that cannot be subscribed (more workers
    # than the file descriptor limit holds) is a ConfigError, one line and exit status 2, where
    # uvicorn printed a traceback and exited with status 3. Not stopped when it fails: the
    # process ends, and its threads are daemons (after 'Too many open files' the subscriber can
    # hold a socket it never registered, and stopping it then waited for ever).
    service.start()
    # The workers added later (POST /workers) take their descriptors from the connections' share:
    # the cap follows them, and refuses one that would leave the connections less than their least.
    max_connections = fds.ConnectionCap(cfg.max_connections, len(cfg.workers))
    service.use_connection_cap(max_connections)
    log.info("at most %d HTTP connections at once (%s)", max_connections.value,
             "--max-connections" if cfg.max_connections else
             f"what the file descriptor limit leaves, {fds.FDS_PER_WORKER} fewer for each worker added")
    # The app stops the service on shutdown (SIGINT/SIGTERM); here too, if uvicorn fails.
    # uvicorn_options: at most max_connections connections, a request's head is at most 64 KiB
    # and it must arrive within 60 s, no WebSockets (see httpguard).
    try:
        uvicorn.run(create_app(service, own_service=True), host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                    access_log=False, **uvicorn_options(max_connections))
    finally:
        service.stop()
    return 0


