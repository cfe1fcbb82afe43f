"""vLLM engine arguments as command-line flags: the one way kvslots writes them.

``EngineArgs`` field ``max_model_len`` is the flag ``--max-model-len``; a boolean is ``--x`` or
``--no-x``; a list is the flag followed by its items; a dict (``speculative_config``, the JSON
configs) is compact JSON; a value that starts with ``-`` and is no number is ``--x=-value``.
"""

from __future__ import annotations

import json
from typing import Any


def flag_name(key: str) -> str:
    """``max_model_len`` -> ``--max-model-len``."""
    return "--" + key.replace("_", "-")


def to_json(value: Any) -> str:
    """Compact JSON, as a JSON-valued vLLM argument is written."""
    return json.dumps(value, separators=(",", ":"))


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


def brief(value: Any, limit: int = 80) -> str:
    """An argument's value as written on the command line, cut to ``limit`` characters for a note."""
    text = value if isinstance(value, str) else to_json(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["brief", "engine_flag", "flag_name", "to_json"]
