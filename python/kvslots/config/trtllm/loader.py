"""Reading a TRT-LLM engine YAML: the limits and rules of :mod:`kvslots.config.loader` (size,
nesting, aliases, duplicate and non-scalar keys, non-finite numbers); every failure is a
:class:`~kvslots.ConfigError` naming the file and, where there is one, the line or the field."""

from __future__ import annotations

import os
from typing import Any

from ..loader import MAX_ENGINE_NODES, load_yaml, parse_yaml, yaml_module


def parse_trtllm_yaml(text: str, source: str | None = None) -> Any:
    """Parses YAML text (:func:`kvslots.config.loader.parse_yaml`); a syntax error becomes a
    :class:`ConfigError` with the line number. Duplicate keys are an error too (PyYAML would
    keep the last one silently). At most :data:`~kvslots.config.loader.MAX_ENGINE_NODES` nodes."""
    return parse_yaml(text, source, max_nodes=MAX_ENGINE_NODES)


def load_trtllm_yaml(path: str | os.PathLike[str]) -> Any:
    """Reads and parses a YAML file (errors name the file)."""
    return load_yaml(path, max_nodes=MAX_ENGINE_NODES)


__all__ = ["load_trtllm_yaml", "parse_trtllm_yaml", "yaml_module"]
