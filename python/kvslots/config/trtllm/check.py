"""Checking a conversion against the installed vLLM (imported only when called): its argument
parser, ``EngineArgs`` and, with ``build``, the full engine config."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .result import ConversionResult

# A minimal model config for parse-only checks: vLLM's EngineArgs resolves the model path on
# construction, so a placeholder local directory keeps the check offline.
_PLACEHOLDER_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 4096,
}


def check_with_vllm(result: ConversionResult, *, model: str | None = None, build: bool = False) -> Any:
    """Checks a conversion against the installed vLLM.

    Parses ``result.cli_args()`` with vLLM's own argument parser, builds ``EngineArgs`` from the
    parsed namespace and from ``engine_args`` directly, and requires every converted field to
    agree (an unknown argument name or a bad value fails inside vLLM). Without ``build`` the
    model is a placeholder local directory, so nothing is looked up on the Hub.

    With ``build``, builds the engine configuration (``create_engine_config()``) for ``model``
    (default: the result's model), which validates the speculative config against the real
    target and draft configs: their config.json must be reachable (local directories work
    offline; no weights are loaded). Returns the ``VllmConfig`` when building, else the
    ``EngineArgs``. Raises ``ImportError`` without vLLM, :class:`~kvslots.ConfigError` on a
    disagreement, and vLLM's own exceptions when vLLM rejects a value.
    """
    import tempfile

    m = model or result.model
    if build and not m:
        raise ConfigError("building the engine config needs a model (pass model=)", "model")

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with tempfile.TemporaryDirectory(prefix="kvslots-check-") as tmp:
        if not build:
            Path(tmp, "config.json").write_text(json.dumps(_PLACEHOLDER_MODEL_CONFIG))
            m = tmp
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        argv = ["--model", str(m), *result.cli_args()]
        try:
            ns = parser.parse_args(argv)
        except SystemExit as e:
            raise ConfigError(f"vLLM's argument parser rejected: {shlex.join(argv)}") from e
        kwargs = dict(result.engine_args)
        kwargs["model"] = str(m)
        skip = {"model"}
        if not build and "tokenizer" in kwargs:
            # EngineArgs resolves the tokenizer path too: check the parsed value, then use the placeholder.
            if ns.tokenizer != kwargs["tokenizer"]:
                raise ConfigError(f"vLLM parsed tokenizer as {ns.tokenizer!r}, not {kwargs['tokenizer']!r}",
                                  "tokenizer")
            ns.tokenizer = kwargs["tokenizer"] = str(m)
            skip.add("tokenizer")
        from_cli = EngineArgs.from_cli_args(ns)
        direct = EngineArgs(**kwargs)
        for key in result.engine_args:
            if key in skip:
                continue
            a, b = getattr(from_cli, key), getattr(direct, key)
            if a != b:
                raise ConfigError(f"vLLM parsed {key} from the flags as {a!r} but the engine args say {b!r}", key)
        if build:
            return direct.create_engine_config()
        return direct


__all__ = ["check_with_vllm"]
