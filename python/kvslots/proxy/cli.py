"""``kvslots proxy``: the command."""

from __future__ import annotations

import argparse
import logging
from urllib.parse import urlparse

from ..errors import ServeError


def _url(text: str) -> str:
    u = urlparse(text)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text.rstrip("/")


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
    p.add_argument("--prefill", action="append", type=_url, required=True, metavar="URL",
                   help="a prefill worker's HTTP address, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL[=WORKER]",
                   help="a decode worker's HTTP address, with its name in the indexer after '=' (repeatable)")
    p.add_argument("--indexer", type=_url, metavar="URL",
                   help="kvslots indexer to pick the decode worker holding most of a token-id prompt")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8300, help="port (default 8300)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per backend request (default 600)")
    p.set_defaults(func=run)


def decode_workers(specs: list[str]) -> list:
    from .app import DecodeWorker

    out = []
    for spec in specs:
        url, _, name = spec.partition("=")
        try:
            url = _url(url)
        except argparse.ArgumentTypeError as e:
            raise ServeError(f"--decode {spec!r}: {e}") from None
        out.append(DecodeWorker(url, name or None))
    return out


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ServeError(f"--port {args.port} is not a TCP port")
    if not args.timeout > 0:
        raise ServeError(f"--timeout {args.timeout} must be > 0")
    workers = decode_workers(args.decode)
    import uvicorn

    from .app import create_app

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(args.prefill, workers, indexer_url=args.indexer, timeout_s=args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
