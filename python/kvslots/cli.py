"""The ``kvslots`` command line. Each subcommand lives in its own module, which provides
``add_parser(subparsers)`` registering a parser whose ``func`` default runs it."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in --help order.
COMMAND_MODULES = [
    "kvslots._dev.simulate",
    "kvslots.config.cli",
    "kvslots.indexer.cli",
    "kvslots.serve.cli",
    "kvslots.demo.run",
]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="kvslots",
        description="KV-cache block slot manager for speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"kvslots {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
