"""Reading a TRT-LLM engine YAML: syntax errors and duplicate keys become a
:class:`~kvslots.ConfigError` with the line number and the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import ConfigError


def yaml_module() -> Any:
    """PyYAML (a dependency), or a ConfigError saying how to install it."""
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency
        raise ConfigError("PyYAML is needed to read or write YAML (pip install pyyaml)") from e
    return yaml



def parse_trtllm_yaml(text: str, source: str | None = None) -> Any:
    """Parses YAML text; a syntax error becomes a :class:`ConfigError` with the line number.
    Duplicate keys are an error too (PyYAML would keep the last one silently)."""
    yaml = yaml_module()

    class _Loader(yaml.SafeLoader):
        pass

    def _mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        seen: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"duplicate key {key!r} at line {key_node.start_mark.line + 1}", None, source
                )
            seen[key] = loader.construct_object(value_node, deep=deep)
        return seen

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"invalid YAML: {problem}{where}", None, source) from e


def load_trtllm_yaml(path: str | os.PathLike[str]) -> Any:
    """Reads and parses a YAML file (errors name the file)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError("no such file", None, str(p)) from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e}", None, str(p)) from e
    return parse_trtllm_yaml(text, source=str(p))



__all__ = ["load_trtllm_yaml", "parse_trtllm_yaml", "yaml_module"]
