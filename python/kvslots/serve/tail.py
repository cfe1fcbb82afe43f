"""vLLM's own arguments, after ``--``: found and read without vLLM.

Names are normalised the way vLLM's ``FlexibleArgumentParser`` reads them (dashes or
underscores, ``--x=v``, ``--no-x``, the dotted ``--x.key value`` form, vLLM's short aliases); values
are read only for the arguments ``kvslots serve`` manages, and the JSON-valued ones it merges
(:data:`MERGED_OPTIONS`) are added up to one JSON object each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.loader import MAX_DEPTH, brief, check_values, parse_json
from ..config.vllm_args import exec_size, to_json
from ..errors import ConfigError, ServeError

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
#: How to turn off what kvslots serve adds for a merged option.
_TURN_OFF = {"speculative-config": "no speculative decoding: no --speculative-config and no YAML speculative_config",
             "kv-transfer-config": "kvslots serve --no-connector runs vLLM without the KVSlotsConnector",
             "kv-events-config": "kvslots serve --no-kv-events leaves vLLM's KV events off"}
#: vLLM arguments after ``--`` whose value kvslots serve reads (they take exactly one value).
_VALUED_OPTIONS = {*MERGED_OPTIONS, "host", "port", "model", "data-parallel-size", "scheduler-cls", "config"}
#: The vLLM options kvslots serve reads, checks or builds itself (build_plan): a vLLM ``--config``
#: file may not set them, as vLLM would apply them under everything kvslots checked.
MANAGED_OPTIONS = frozenset(_VALUED_OPTIONS - {"config"} | {
    "tensor-parallel-size", "pipeline-parallel-size", "enable-prefix-caching"})


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


def check_argv(argv: Any, what: str) -> None:
    """A list (or tuple) of str, each one a command-line argument can be (no NUL): a ServeError
    otherwise (a str was scanned character by character, an int was an AttributeError, a NUL
    Popen's ValueError)."""
    if not isinstance(argv, (list, tuple)):
        raise ServeError(f"{what} must be a list of strings, got {type(argv).__name__}")
    for a in argv:
        # exec_size: the rule of what a program can get (a lone surrogate such as '\ud800' was a
        # UnicodeEncodeError from Popen or from the plan's size check).
        if not isinstance(a, str) or exec_size(a) is None:
            raise ServeError(f"{what}: {brief(a)} is not a command-line argument (a string without NUL "
                             "or lone surrogates)")


def scan_vllm_args(tail: Sequence[str]) -> list[TailOption]:
    """The vLLM arguments in ``tail`` (without vLLM: names are normalised the way vLLM's
    FlexibleArgumentParser does; values are read only for the arguments kvslots serve manages)."""
    check_argv(tail, "vLLM's arguments")
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
        if len(keys) >= MAX_DEPTH:  # the merge recurses per key
            raise ServeError(f"after --: {head[:80]}...: more than {MAX_DEPTH - 1} dotted keys")
        append = bool(keys) and keys[-1].endswith("+")
        if append:
            keys[-1] = keys[-1][:-1]
        negated = False
        if base.startswith("no-") and not keys:
            base, negated = base[3:], True
            if base in MERGED_OPTIONS:  # vLLM has no --no-x for them either
                raise ServeError(f"after --: {tok}: --{base} cannot be negated; leave it out "
                                 f"({_TURN_OFF[base]})")
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


def check_config_files(opts: list[TailOption]) -> None:
    """vLLM's ``--config FILE`` after ``--`` (its options as YAML, which vLLM puts before every
    other argument): read under kvslots' file rules (:func:`~kvslots.config.loader.load_yaml`: a
    FIFO, ``/dev/zero``, an alias bomb or a duplicate key is a ServeError naming the file, not
    a vLLM that hangs or fails once started), a mapping, and setting none of
    :data:`MANAGED_OPTIONS`: those were handed to vLLM unchecked (a speculative config with
    K = 999, another connector, another scheduler, a port kvslots did not check)."""
    from ..config.loader import MAX_ENGINE_NODES, load_yaml

    files = [o for o in opts if o.name == "config" and not o.keys]
    if len(files) > 1:  # vLLM asserts there is one
        raise ServeError("after --: --config is given more than once (vLLM reads one config file)")
    for o in files:
        if o.value is None:
            raise ServeError(f"after --: {o.text} has no value")
        try:
            doc = load_yaml(o.value, max_nodes=MAX_ENGINE_NODES)
        except ConfigError as e:
            raise ServeError(f"after --: --config: {e}") from None
        if not isinstance(doc, dict):  # an empty file too: vLLM's None.items() failed once started
            raise ServeError(f"after --: --config {o.value}: must be a mapping of vLLM options, "
                             f"got {'an empty file' if doc is None else type(doc).__name__}")
        for key in doc:
            # As vLLM reads the key: --KEY, underscores or dashes, a dotted --x.key, --no-x.
            flag = str(key).split(".")[0].replace("_", "-")
            if flag.removeprefix("no-") in MANAGED_OPTIONS:
                raise ServeError(f"after --: --config {o.value} sets {brief(str(key))}, which kvslots serve "
                                 f"reads and checks: give --{flag} after -- or as kvslots serve's own option")


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


def tail_json(opts: list[TailOption], name: str) -> dict[str, Any] | None:
    """The JSON object the tail's ``--name`` occurrences (JSON or dotted form) add up to."""
    found = [o for o in opts if o.name == name]
    if not found:
        return None
    merged: dict[str, Any] = {}
    for o in found:
        if o.value is None:  # scan_vllm_args refuses a negated merged option; a caller may not
            raise ServeError(f"after --: {o.text} has no value")
        where = f"after --: {o.text}"
        if o.keys:
            value: Any = o.value.split(",") if o.append else _dotted_value(o.value, where)
            merged = _merge(merged, _nested(o.keys, value))
        else:
            merged = _merge(merged, json_object(o.value, f"after --: --{name}"))
    _checked(merged, f"after --: --{name}")
    return merged


def _dotted_value(raw: str, where: str) -> Any:
    """A dotted ``--x.key value``: JSON when it reads as JSON, else the text (vLLM's rule: what
    ``json.loads`` cannot read is a string). JSON kvslots' strict parser refuses is an error."""
    try:
        json.loads(raw)  # only vLLM's test of "is it JSON"; the value comes from the strict parser
    except json.JSONDecodeError:
        return raw
    except (RecursionError, ValueError):
        pass  # JSON, but too deep or an integer too long: parse_json says which
    return _parse(raw, where)


def json_object(text: str, what: str) -> dict[str, Any]:
    value = _parse(text, what)
    if not isinstance(value, dict):
        raise ServeError(f"{what}: must be a JSON object, got {type(value).__name__}")
    return value


def _parse(text: str, what: str) -> Any:
    """kvslots' strict JSON (no NaN, no duplicate keys, 64-bit integers, bounded nesting)."""
    try:
        return parse_json(text, what)
    except ConfigError as e:
        raise ServeError(str(e)) from None


def _checked(value: Any, what: str) -> None:
    """The merged dotted values under the same limits as a JSON value."""
    try:
        check_values(value, what)
    except ConfigError as e:
        raise ServeError(str(e)) from None


def merge_over_flags(cfg: dict[str, Any], tail_cfg: Mapping[str, Any], option: str,
                     flags: Mapping[str, tuple[Any, str]], notes: list[str]) -> None:
    """Merges the keys of ``--<option>`` after ``--`` into ``cfg``, the one built from the flags.

    The precedence rule of kvslots serve: a key a flag set explicitly (``flags``: key -> (its
    value, how to name it)) given again with another value is an error; a key that replaces
    another value is noted."""
    for k, v in tail_cfg.items():
        if k in flags and flags[k][0] != v:
            raise ServeError(f"after --: --{option} sets {k}={to_json(v)}, conflicting with {flags[k][1]}")
        if k in cfg and cfg[k] != v:
            notes.append(f"note: after --: --{option} overrides {k} ({to_json(cfg[k])} -> {to_json(v)})")
        cfg[k] = v


__all__ = ["MANAGED_OPTIONS", "MERGED_OPTIONS", "VLLM_SHORT_OPTIONS", "TailOption", "check_config_files", "json_object", "merge_over_flags", "scan_vllm_args",
           "tail_json"]
