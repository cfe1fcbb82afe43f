"""``kvslots proxy``: the command. Bad input (a URL, the port, the timeout, the body cap, the
connection caps, an address it cannot listen on) is one line, ``kvslots proxy: error: ...``, and
exit status 2."""

from __future__ import annotations

import argparse
import logging
import math
import os
from urllib.parse import urlparse

from ..errors import InvalidArgumentError, KVSlotsError, ServeError, short_repr


def http_url(text: str, what: str = "URL") -> str:
    """``text`` without a trailing ``/`` when it is an http(s) URL httpx can send to (scheme,
    host, a port in range); an :class:`~kvslots.InvalidArgumentError` naming ``what`` otherwise.
    The one check of a backend's URL (the command line and :func:`~kvslots.proxy.app.create_app`)."""
    import httpx

    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what} must be a str, got {type(text).__name__}")
    try:
        u = urlparse(text)
        u.port  # noqa: B018 - reading it checks the port's range
        httpx.URL(text)
    except (ValueError, httpx.InvalidURL) as e:  # "http://[::1" is a ValueError of urlparse
        raise InvalidArgumentError(f"{what} {text!r} is not an http(s) URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise InvalidArgumentError(f"{what} {text!r} is not an http(s) URL")
    if u.port == 0:  # nothing can be reached there: every request would fail at connect
        raise InvalidArgumentError(f"{what} {text!r}: port 0 is no port to send to")
    if not text.isascii() or not text.isprintable():  # it goes into a response header too
        raise InvalidArgumentError(f"{what} {text!r}: printable ASCII only (punycode for a non-ASCII host name)")
    if "?" in text or "#" in text:  # the proxy appends /v1/... or /score: it would land in them
        raise InvalidArgumentError(f"{what} {text!r}: no query or fragment (the proxy appends a path to it)")
    return text.rstrip("/")


def seconds(value: object, what: str = "timeout") -> float:
    """``value`` as a finite number of seconds > 0; an :class:`~kvslots.InvalidArgumentError`
    naming ``what`` otherwise. The one check of the proxy's timeout (the command line and
    :func:`~kvslots.proxy.app.create_app`)."""
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            if math.isfinite(value) and value > 0:
                return float(value)
        except OverflowError:  # an int past float's range (was this OverflowError)
            pass
    raise InvalidArgumentError(f"{what} {short_repr(value)} must be a finite number of seconds > 0")


#: Largest ``--max-requests-per-client``: past the most backend connections it limits nothing.
MAX_REQUESTS_PER_CLIENT = 1 << 16


def default_requests_per_client(backend_connections: int) -> int:
    """``--max-requests-per-client``'s default: ``backend_connections`` less a quarter of them (768
    of 1024), at least 1. One address (a client opening many connections) can then never hold
    every backend connection: a quarter (256 by default: vLLM's usual max_num_seqs) stays for the
    others, while a gateway in front of the proxy (every request from one address) still gets
    three quarters at once; 0 lifts the limit."""
    return max(1, backend_connections - backend_connections // 4)


def requests_per_client(value: object, what: str = "max_requests_per_client") -> int:
    """``value`` when it is an integer in 0..:data:`MAX_REQUESTS_PER_CLIENT` (0: no limit); an
    :class:`~kvslots.InvalidArgumentError` naming ``what`` otherwise. The one check of the
    per-client limit (the command line and :func:`~kvslots.proxy.app.create_app`)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REQUESTS_PER_CLIENT:
        raise InvalidArgumentError(f"{what} {short_repr(value)} must be an integer in 0..{MAX_REQUESTS_PER_CLIENT} "
                                   "(0: no limit)")
    return value


def shown_url(url: str) -> str:
    """``url`` without its user and password, as clients and logs see it (an ``/healthz``, a
    response header, an error message)."""
    u = urlparse(url)
    return u._replace(netloc=u.netloc.rpartition("@")[2]).geturl() if "@" in u.netloc else url


def userinfo_urls(urls: list[str]) -> list[str]:
    """Those of ``urls`` with a ``user:password@`` (httpx sends it as Basic auth, in place of any
    Authorization header)."""
    return [u for u in urls if "@" in urlparse(u).netloc]


#: Where ``--backend-api-key`` is read from when it is not given.
API_KEY_ENV = "KVSLOTS_BACKEND_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy",
        help="front door for disaggregated prefill/decode: prompt on a prefill worker, decode on a decode worker",
        description=(
            "OpenAI-compatible server (/v1/completions, /v1/chat/completions) that sends each request to a "
            "prefill worker (kvslots serve --role prefill; max_tokens 1, kv_transfer_params back), then to a "
            "decode worker (kvslots serve --role decode) with those kv_transfer_params, and returns (streams) "
            "the decode worker's answer. A failed prefill is recomputed on the decode worker."
        ),
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill worker's HTTP address, e.g. http://127.0.0.1:8100 (repeatable; a "
                        "user:password@ in it is sent to that worker as Basic auth, in place of the client's "
                        "Authorization; not with --backend-api-key)")
    p.add_argument("--decode", action="append", required=True, metavar="URL[=WORKER]",
                   help="a decode worker's HTTP address, with its name in the indexer after '=' (repeatable; "
                        "user:password@ as for --prefill)")
    p.add_argument("--indexer", metavar="URL",
                   help="kvslots indexer to pick the decode worker holding most of a token-id prompt")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8300, help="port (default 8300)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per backend request (default 600)")
    p.add_argument("--max-body-mb", type=int, default=64, metavar="MB",
                   help="largest request body accepted, in MiB (default 64; larger: 413)")
    p.add_argument("--max-connections", type=int, metavar="N",
                   help="most client connections open at once; one more is answered 503 and closed (default: what "
                        "the file descriptor limit, ulimit -n, leaves once the backend connections are set aside)")
    p.add_argument("--backend-connections", type=int, metavar="N",
                   help="most connections to the prefill and decode workers open at once; a request finding them "
                        "all in use waits, up to --timeout (default 1024, or half of what the file descriptor "
                        "limit, ulimit -n, leaves when that is less)")
    p.add_argument("--max-requests-per-client", type=int, metavar="N",
                   help="most completions one client address may have in flight at once; one more is answered "
                        "429 with Retry-After (default: --backend-connections less a quarter, so one client "
                        "cannot take every backend connection; 0: no limit)")
    p.add_argument("--backend-api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV) or None,  # "": unset
                   help="send 'Authorization: Bearer KEY' to the prefill and decode workers (their vLLM --api-key) "
                        "instead of the client's Authorization header, which is passed on without it (default: "
                        f"${API_KEY_ENV}, which keeps the key out of the process list). The proxy checks no "
                        "client's key: anyone who reaches it uses the workers' key")
    p.add_argument("--client-id-header", metavar="NAME",
                   help="behind a trusted load balancer: --max-requests-per-client counts each value of this header "
                        "(its last item, e.g. X-Forwarded-For's address the load balancer appended) as one client, "
                        "not the connection's address (default: the address; a client that reaches the proxy "
                        "directly could name itself anew in each request, and so can every client behind a load "
                        "balancer that passes the header on without appending to it; behind several hops, e.g. "
                        "a CDN then a load balancer, the last item is the previous hop's address)")
    p.set_defaults(func=run)


def _flag_url(flag: str, url: str) -> str:
    try:
        return http_url(url, flag)
    except InvalidArgumentError as e:
        raise ServeError(str(e)) from None


def decode_workers(specs: list[str]) -> list:
    from ..indexer.config import check_worker_name
    from .app import DecodeWorker

    out = []
    for spec in specs:
        url, sep, name = spec.partition("=")
        # The indexer's rule: another name could never be found there. An empty one too
        # ("URL=$NAME" with NAME unset was a worker without a name, never scored).
        if sep:
            try:
                check_worker_name(name)
            except KVSlotsError as e:
                raise ServeError(f"--decode {spec!r}: {e}") from None
        out.append(DecodeWorker(_flag_url("--decode", url), name or None))
    try:
        check_unique_names(out)
    except InvalidArgumentError as e:
        raise ServeError(f"--decode: {e}") from None
    return out


def check_unique_names(workers: list) -> None:
    """An indexer name given to two decode workers is an :class:`~kvslots.InvalidArgumentError`:
    both get its score, and the first always won, so the other was never picked by score."""
    seen: dict[str, str] = {}
    for w in workers:
        if w.indexer_name is not None and seen.setdefault(w.indexer_name, w.url) != w.url:
            raise InvalidArgumentError(f"worker name {w.indexer_name!r} is given to {shown_url(seen[w.indexer_name])} "
                                       f"and {shown_url(w.url)}: one indexer worker is one decode worker")


def run(args: argparse.Namespace) -> int:
    from .._fds import raise_limit

    raise_limit()  # first: the default connection caps below are derived from it
    # Checked here, not by argparse types: every bad value is one line (argparse adds its usage).
    prefill = [_flag_url("--prefill", u) for u in args.prefill]
    indexer = _flag_url("--indexer", args.indexer) if args.indexer is not None else None
    workers = decode_workers(args.decode)
    if not args.host.strip():  # "" bound every address, silently
        raise ServeError(f"--host {args.host!r}: give an address to bind, e.g. 127.0.0.1 (0.0.0.0: every address)")
    if not 0 < args.port < 65536:
        raise ServeError(f"--port {args.port} is not a TCP port")
    try:
        seconds(args.timeout, "--timeout")
    except InvalidArgumentError as e:
        raise ServeError(str(e)) from None
    if not 0 < args.max_body_mb <= 65536:
        raise ServeError(f"--max-body-mb {args.max_body_mb} must be in 1..65536")
    from ..indexer import fds

    if args.max_connections is not None and not 0 < args.max_connections <= fds.MAX_CONNECTIONS:
        raise ServeError(f"--max-connections {args.max_connections} must be in 1..{fds.MAX_CONNECTIONS}")
    from .app import (BACKEND_CONNECTIONS, MAX_BACKEND_CONNECTIONS, SIDE_CONNECTIONS, check_api_key,
                      check_header_name, check_one_credential, create_app)

    if args.backend_api_key is not None:
        what = f"--backend-api-key (or ${API_KEY_ENV})"
        try:
            check_api_key(args.backend_api_key, what)
            check_one_credential([*prefill, *(w.url for w in workers)], what)
        except InvalidArgumentError as e:
            raise ServeError(str(e)) from None
    if args.client_id_header is not None:
        try:
            check_header_name(args.client_id_header, "--client-id-header")
        except InvalidArgumentError as e:
            raise ServeError(str(e)) from None

    backend = args.backend_connections
    if backend is None:
        backend = fds.default_backend_connections(BACKEND_CONNECTIONS)
    elif not 0 < backend <= MAX_BACKEND_CONNECTIONS:
        raise ServeError(f"--backend-connections {backend} must be in 1..{MAX_BACKEND_CONNECTIONS}")
    else:
        try:
            fds.check_backend_connections(backend, SIDE_CONNECTIONS)
        except KVSlotsError as e:
            raise ServeError(str(e)) from None
    per_client = args.max_requests_per_client
    if per_client is None:
        per_client = default_requests_per_client(backend)
    try:
        requests_per_client(per_client, "--max-requests-per-client")
    except InvalidArgumentError as e:
        raise ServeError(str(e)) from None
    import uvicorn

    from .._listen import check_listen
    from ..indexer.httpguard import uvicorn_options

    # Before uvicorn: a host that does not resolve or a port in use is one line, exit 2 (uvicorn
    # would log it and exit with status 3).
    check_listen(args.host, args.port)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .._ratelog import quiet_logs

    quiet_logs()  # (uvicorn's logging set-up keeps a logger's filters)
    app = create_app(prefill, workers, indexer_url=indexer, timeout_s=args.timeout, max_body_mb=args.max_body_mb,
                     backend_connections=backend, max_requests_per_client=per_client,
                     backend_api_key=args.backend_api_key, client_id_header=args.client_id_header)
    max_connections = args.max_connections or fds.default_max_connections(backend + SIDE_CONNECTIONS)
    logging.getLogger("kvslots.proxy").info(
        "at most %d client connections at once (%s), %d to the workers, %s", max_connections,
        "--max-connections" if args.max_connections else "what the file descriptor limit leaves", backend,
        (f"{per_client} requests at once per client "
         + (f"({args.client_id_header} header, else address)" if args.client_id_header else "address"))
        if per_client != 0 else "no limit per client")
    # uvicorn_options: at most max_connections connections, a request's head is at most 64 KiB
    # and it must arrive within 60 s, no WebSockets (see httpguard).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **uvicorn_options(max_connections))
    return 0
