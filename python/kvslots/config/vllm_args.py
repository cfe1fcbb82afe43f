"""vLLM engine arguments as command-line flags: the one way kvslots writes them.

``EngineArgs`` field ``max_model_len`` is the flag ``--max-model-len``; a boolean is ``--x`` or
``--no-x``; a list is the flag followed by its items; a dict (``speculative_config``, the JSON
configs) is compact JSON; a value that starts with ``-`` and is no number is ``--x=-value``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ArgumentTypeError, ConfigError, short_repr


def flag_name(key: str) -> str:
    """``max_model_len`` -> ``--max-model-len``."""
    if type(key) is not str:  # exact: a str subclass's own replace() ran
        raise ArgumentTypeError(f"an engine argument's name must be a str, got {type(key).__name__}")
    return "--" + key.replace("_", "-")


def to_json(value: Any) -> str:
    """Compact JSON, as a JSON-valued vLLM argument is written; a ConfigError for a value JSON
    has no text for (NaN, an object, a key that is no str or number, nesting past Python's
    recursion limit)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"a value that is no JSON: {short_repr(value)} ({type(e).__name__})") from None


def engine_flag(key: str, value: Any) -> list[str]:
    """The flag (and its values) for ``EngineArgs`` field ``key`` set to ``value``."""
    name = flag_name(key)
    if isinstance(value, bool):
        return [name] if value else [flag_name("no_" + key)]
    if isinstance(value, (list, tuple)):
        return [name, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [name, to_json(value)]
    text = str(value)
    if text.startswith("-"):
        # As "--tokenizer=-x": a separate "-x" (or "--enforce-eager", or "-inf", which argparse's
        # negative-number rule does not cover) is read as an option, and vLLM refused the command
        # ("expected one argument") once started. Attached, any value is the value.
        return [f"{name}={text}"]
    return [name, text]


#: The largest tensor, pipeline or data parallel size kvslots passes on (from a YAML or after
#: ``--`` in ``kvslots serve``): the events endpoints are laid out per data-parallel rank and the
#: connector's CPU core reservation is sized by tensor x pipeline parallel, so a larger one was a
#: reservation of 2**126 cores or a port past 65535. The one home of that bound.
MAX_PARALLEL_SIZE = 65535


#: The longest string Linux passes to a program as one argument or environment entry, its NUL
#: included (MAX_ARG_STRLEN, 32 pages of 4 KiB): execve refuses a longer one (E2BIG).
MAX_ARG_BYTES = 32 * 4096


def check_exec_strings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Every argument and environment entry of a vLLM command fits execve; a ConfigError naming
    the first that does not (the option it is the value of, or the variable) and its size. The
    one home of the rule: ``kvslots serve`` checks the command it runs, ``convert-config
    --format flags`` the arguments it prints (a long dynamic schedule, 20000 draft_len_schedule
    thresholds, is a 300 KB --speculative-config: it was printed or planned, and failed only to
    start, 'Argument list too long', exit status 127)."""
    # Exact types: a generator or range of 10**12 items was read on, a str subclass' __str__ ran.
    if type(argv) not in (list, tuple) or any(type(a) is not str for a in argv):
        raise ArgumentTypeError(f"argv must be a list of str, got {short_repr(argv)}")
    if env is not None and (not isinstance(env, Mapping)
                            or any(type(k) is not str or type(v) is not str for k, v in env.items())):
        raise ArgumentTypeError(f"env must be a mapping of str to str, got {short_repr(env)}")
    entries = [(a, None) for a in argv] + [(f"{k}={v}", k) for k, v in (env or {}).items()]
    total = 0
    for i, (text, env_key) in enumerate(entries):
        size = exec_size(text)
        if size is None or size > MAX_ARG_BYTES:
            what = f"environment variable {env_key}" if env_key is not None else (
                f"argument of {argv[i - 1]}" if i > 0 and argv[i - 1].startswith("--") else f"argument {i}")
            if size is None:
                raise ConfigError(f"the vLLM command's {what} holds a NUL or a lone surrogate that is no byte of "
                                  f"a command line: {short_repr(text)}")
            raise ConfigError(f"the vLLM command's {what} is {size} bytes; Linux passes at most "
                              f"{MAX_ARG_BYTES} to a program as one argument or environment entry")
        total += size + 8  # and its pointer
    limit = arg_max()
    if limit is not None and total > limit:
        # Each string within MAX_ARG_BYTES, all of them together past the system's limit: the
        # same E2BIG at start (kvslots serve's own arguments fit; the YAML's and the configs it
        # adds made the vLLM command longer).
        raise ConfigError(f"the vLLM command{' and its environment' if env else ''} take {total} bytes; "
                          f"this system passes at most {limit} to a program (getconf ARG_MAX)")


def arg_max() -> int | None:
    """The most bytes of arguments and environment (strings and their pointers) a program can
    be started with here (``getconf ARG_MAX``: a quarter of the stack limit on Linux); None when
    the system does not say."""
    try:
        limit = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        return None
    return limit if limit > 0 else None


def exec_size(text: str) -> int | None:
    """Bytes ``text`` takes as one argument or environment entry of a program, its NUL included;
    None when no program can get it: a NUL inside, or a lone surrogate that is no byte of a
    command line escaped by Python (only U+DC80..U+DCFF are: ``os.fsencode``'s rule, which
    subprocess applies). '\\ud800' was a UnicodeEncodeError from the size check and from Popen."""
    if "\0" in text:
        return None
    try:
        return len(text.encode("utf-8", "surrogateescape")) + 1
    except UnicodeEncodeError:
        return None


__all__ = ["MAX_ARG_BYTES", "MAX_PARALLEL_SIZE", "arg_max", "check_exec_strings", "engine_flag", "exec_size", "flag_name", "to_json"]
