"""``kvslots convert-config``: a TensorRT-LLM engine YAML -> vLLM engine arguments.

Prints the arguments on stdout (``--format flags``: a ``vllm serve`` command-line tail;
``json``: ``EngineArgs`` keyword arguments; ``yaml``: a ``vllm serve --config`` file) and the
warnings, ignored keys (with reasons) and unknown keys on stderr. Bad input (a ``--check`` that
fails included) exits with status 2 and one line naming the field.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..cli import one_line, output, write_file
from ..errors import ConfigError
from .trtllm import ConversionResult, check_with_vllm, convert_trtllm_config
from .vllm_args import check_exec_strings

PROG = "kvslots convert-config"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-config",
        help="convert a TensorRT-LLM engine YAML to vLLM engine arguments",
        description=(
            "Convert a TensorRT-LLM engine YAML (--extra_llm_api_options / --extra-engine-args) "
            "to vLLM engine arguments. Ignored and unknown keys are listed on stderr with reasons."
        ),
    )
    p.add_argument("file", metavar="FILE.yaml", help="TensorRT-LLM engine YAML")
    p.add_argument(
        "--format", choices=("flags", "json", "yaml"), default="flags",
        help="flags: vllm serve arguments (default); json: EngineArgs keyword arguments; "
             "yaml: a vllm serve --config file",
    )
    p.add_argument("--model", help="target model (overrides the YAML's model and a speculators verifier)")
    p.add_argument(
        "--speculators-dir", metavar="DIR",
        help="speculators-format draft checkpoint: its method, K and verifier replace the YAML's speculative_config",
    )
    p.add_argument("--verifier", help="target model to use instead of the speculators checkpoint's verifier")
    p.add_argument("-o", "--output", metavar="PATH", help="write the arguments to PATH instead of stdout ('-': stdout)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print warnings and ignored keys")
    p.add_argument(
        "--check", action="store_true",
        help="also check the result with the installed vLLM (its argument parser and EngineArgs)",
    )
    p.set_defaults(func=run)


def _render(result: ConversionResult, fmt: str) -> str:
    if fmt == "json":
        return result.to_json() + "\n"
    if fmt == "yaml":
        return result.to_yaml()
    argv = result.cli_args(include_model=True)
    check_exec_strings(argv, result.env)  # serve's rule: a tail vLLM could not be started with
    return shlex.join(argv) + "\n"


def run(args: argparse.Namespace) -> int:
    """The command; bad input raises a :class:`~kvslots.KVSlotsError`, which
    :func:`kvslots.cli.main` prints as one line (exit status 2)."""
    result = convert_trtllm_config(
        args.file, model=args.model, speculators_dir=args.speculators_dir, verifier=args.verifier
    )
    text = _render(result, args.format)
    # Every check, and writing the output, comes before the notes: an error is then the only
    # line on stderr (the warnings and ignored keys came first when --check or -o failed).
    if args.output is not None and not args.output:  # was taken as no -o: stdout
        raise ConfigError("an empty path names no file", "-o/--output")
    if args.check:
        # A failed check is bad input like any other: one line, exit status 2 (it was 1).
        try:
            check_with_vllm(result)
        except ImportError as e:
            raise ConfigError(f"cannot check: vLLM is not importable ({e})") from None
        except ConfigError as e:
            raise ConfigError(f"vLLM check failed: {e}") from None
        except Exception as e:  # vLLM's own validation errors
            first = str(e).splitlines()[0] if str(e) else ""
            raise ConfigError(f"vLLM rejected the arguments: {type(e).__name__}: {first}") from None
    if args.output is not None and args.output != "-":  # "-": stdout, as for other tools (a file "-" was made)
        if _same_file(args.output, args.file):
            # Written over the YAML it was made from: the input was gone, the flags in its place.
            raise ConfigError("is the input file: give another path (the YAML would be overwritten)",
                              "-o/--output", args.output)
        write_file(args.output, text)  # whole or not at all: an existing file is kept on failure
    else:
        out = output()
        out.write(text)
        out.flush()  # a closed pipe or a full disk is the error line, before any note
    if not args.quiet:
        for line in result.notes():
            print(one_line(line), file=sys.stderr)  # a key from the file may hold a newline or an escape
        if args.check:
            print("checked: vLLM accepts the arguments", file=sys.stderr)
    return 0


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file (a link or another spelling too)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them is not there, or no path (a NUL)
        return False


__all__ = ["add_parser", "run"]
