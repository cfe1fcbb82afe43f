"""The result of a conversion: the vLLM engine arguments and the account of every TRT-LLM key
(mapped, ignored with a reason, or unknown), in the forms the CLI and ``kvslots serve`` print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ..schedule import DynamicSDSchedule
from ..vllm_args import engine_flag
from ..loader import brief, dump_json, yaml_module


@dataclass(frozen=True)
class MappedKey:
    """A TRT-LLM key (dotted ``path``) and the vLLM argument it became (``target``: an
    ``EngineArgs`` field, ``speculative_config.<key>``, ``env:<VAR>`` or ``kvslots.<hint>``)."""

    path: str
    target: str
    value: Any


@dataclass(frozen=True)
class IgnoredKey:
    """A TRT-LLM key with no vLLM argument. ``known`` is False for keys kvslots does not
    recognise as TRT-LLM options (typos, newer TRT-LLM versions, other tools' keys)."""

    path: str
    value: Any
    reason: str
    known: bool = True


@dataclass
class ConversionResult:
    """The vLLM configuration equivalent to a TRT-LLM engine YAML."""

    engine_args: dict[str, Any]
    """``EngineArgs`` keyword arguments (``vllm.EngineArgs(**engine_args)``); ``model`` only when
    the YAML names one or the caller passed it."""
    mapped: list[MappedKey] = field(default_factory=list)
    ignored: list[IgnoredKey] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    schedule: DynamicSDSchedule | None = None
    """The dynamic speculative-decoding schedule (also in the speculative config), if any."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables vLLM reads instead of arguments (``VLLM_PP_LAYER_PARTITION``)."""
    kvslots: dict[str, Any] = field(default_factory=dict)
    """Hints for ``kvslots serve``: ``host_cache_bytes`` (kv_cache_config.host_cache_size, the
    host tier kvslots provides), ``kv_events`` (TRT-LLM had KV cache events on)."""
    source: str | None = None

    @property
    def model(self) -> str | None:
        return self.engine_args.get("model")

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        return self.engine_args.get("speculative_config")

    @property
    def unknown(self) -> list[IgnoredKey]:
        return [i for i in self.ignored if not i.known]

    def cli_args(self, *, include_model: bool = False) -> list[str]:
        """``vllm serve`` flags (``--max-num-seqs 8 --speculative-config {...}``). The model is
        ``vllm serve``'s positional argument and is left out unless ``include_model``
        (then it comes first, positional)."""
        out: list[str] = []
        if include_model and self.model is not None:
            out.append(str(self.model))
        for key, value in self.engine_args.items():
            if key == "model":
                continue
            out.extend(engine_flag(key, value))
        return out

    def command(self, model: str | None = None, prefix: tuple[str, ...] = ("vllm", "serve")) -> list[str]:
        """The full ``vllm serve MODEL FLAGS`` command line."""
        m = model or self.model
        if m is None:
            raise ConfigError("no model: pass model= (the TRT-LLM YAML names none)", "model", self.source)
        return [*prefix, str(m), *self.cli_args()]

    def to_json(self) -> str:
        """The engine arguments as JSON (``EngineArgs`` field names); never a bare ``NaN``."""
        return dump_json(self.engine_args, indent=2)

    def to_yaml(self) -> str:
        """The engine arguments as a ``vllm serve --config`` YAML (dashed option names)."""
        yaml = yaml_module()
        doc = {k.replace("_", "-") if k != "model" else k: v for k, v in self.engine_args.items()}
        try:
            return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
        except yaml.YAMLError as e:  # a value YAML cannot write (an object put in engine_args), as to_json
            raise ConfigError(f"cannot be written as YAML: {e}") from None

    def report(self) -> dict[str, Any]:
        """Everything, as plain data (for logs, ``serve`` and tests)."""
        return {
            "source": self.source,
            "engine_args": self.engine_args,
            "cli_args": self.cli_args(),
            "mapped": [{"path": m.path, "target": m.target, "value": m.value} for m in self.mapped],
            "ignored": [
                {"path": i.path, "value": i.value, "reason": i.reason, "known": i.known} for i in self.ignored
            ],
            "warnings": list(self.warnings),
            "schedule": self.schedule.to_list() if self.schedule else None,
            "env": dict(self.env),
            "kvslots": dict(self.kvslots),
        }

    def notes(self) -> list[str]:
        """Human-readable lines: warnings, then ignored and unknown keys with reasons."""
        lines = [f"warning: {w}" for w in self.warnings]
        for i in self.ignored:
            kind = "ignored" if i.known else "unknown"
            lines.append(f"{kind}: {i.path} = {brief(i.value, plain=True)} ({i.reason})")
        for k, v in self.env.items():
            lines.append(f"env: {k}={v}")
        return lines


__all__ = ["ConversionResult", "IgnoredKey", "MappedKey"]
