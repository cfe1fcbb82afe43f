"""The converter's state and its typed value checks, shared by the key handlers (:mod:`.engine_keys`,
:mod:`.parallel`, :mod:`.kv_cache`, :mod:`.cuda_graphs`, :mod:`.speculative`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from ..loader import brief, text_problem
from ..schedule import DynamicSDSchedule
from .result import IgnoredKey, MappedKey


def describe(value: Any) -> str:
    """A value and its type, for error messages (``int 3``, ``null``)."""
    if value is None:
        return "null"
    return f"{type(value).__name__} {brief(value, 80)}"


class ConverterBase:
    """The converter's state and what every key handler uses: recording a key as mapped, noted,
    ignored or unknown, and reading a value of the expected type (a bad one raises a
    :class:`~kvslots.ConfigError` naming the key)."""

    def __init__(self, doc: Mapping[str, Any], source: str | None):
        self.doc = doc
        self.source = source
        self.args: dict[str, Any] = {}
        self.mapped: list[MappedKey] = []
        self.ignored: list[IgnoredKey] = []
        self.warnings: list[str] = []
        self.env: dict[str, str] = {}
        self.kvslots: dict[str, Any] = {}
        # Stashed for the post phase.
        self.tp: int | None = None
        self.ep: int | None = None
        self.ep_path = "moe_expert_parallel_size"
        self.attention_dp = False
        self.graphs: dict[str, Any] | None = None  # parsed cuda graph settings; None = not given
        self.graphs_path = "cuda_graph_config"
        self.spec_doc: Any = None
        self.spec_given = False
        self.draft_path: str | None = None  # the key that named the converted draft model
        self.schedule: DynamicSDSchedule | None = None

    def fail(self, path: str | None, message: str) -> ConfigError:
        return ConfigError(message, path, self.source)

    def map(self, path: str, target: str, value: Any) -> None:
        self.args[target] = value
        self.mapped.append(MappedKey(path, target, value))

    def note(self, path: str, target: str, value: Any) -> None:
        self.mapped.append(MappedKey(path, target, value))

    def ignore(self, path: str, value: Any, reason: str, known: bool = True) -> None:
        self.ignored.append(IgnoredKey(path, value, reason, known))

    def unknown(self, path: str, value: Any, where: str = "TRT-LLM option") -> None:
        self.ignored.append(IgnoredKey(path, value, f"not a known {where}; not converted", known=False))

    def int_(self, value: Any, path: str, minimum: int | None = None, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an integer, got {describe(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(path, f"must be <= {maximum}, got {value}")
        return value

    def bool_(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {describe(value)}")
        return value

    def str_(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {describe(value)}")
        # It becomes a command-line argument: no argv holds a NUL (kvslots serve failed to start
        # vLLM with a ValueError), and stdout cannot write a lone surrogate.
        problem = text_problem(value)
        if problem:
            raise self.fail(path, f"{problem}, got {describe(value)}")
        if value == "--":  # however written (--x --, --x=--), vLLM's parser reads no value: [] on Python < 3.13
            raise self.fail(path, "cannot be '--', which vLLM's argument parser reads as the end of its options")
        return value

    def fraction(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"must be a number in (0, 1], got {describe(value)}")
        if not 0 < value <= 1:
            raise self.fail(path, f"must be in (0, 1], got {value}")
        return float(value)

    def mapping(self, value: Any, path: str, *, allow_none: bool = True) -> dict[str, Any]:
        if value is None and allow_none:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping, got {describe(value)}")
        for k in value:
            if not isinstance(k, str):
                raise self.fail(f"{path}.{k}", f"keys must be strings, got {describe(k)}")
        return dict(value)

    def int_list(self, value: Any, path: str, minimum: int = 1) -> list[int]:
        if not isinstance(value, list) or not value:
            raise self.fail(path, f"must be a non-empty list of integers, got {describe(value)}")
        return [self.int_(v, f"{path}[{i}]", minimum) for i, v in enumerate(value)]



__all__ = ["ConverterBase", "describe"]
