"""Speculators-format checkpoints (https://github.com/vllm-project/speculators) -> vLLM speculative config.

A speculators checkpoint is a draft model directory whose ``config.json`` carries::

    "speculators_model_type": "eagle3",
    "transformer_layer_config": {...},
    "speculators_config": {
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}, ...],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", ...}
    }

vLLM detects such a directory when it is passed as the *model* and swaps in the verifier as the
target, but it takes ``verifier.name_or_path`` verbatim: a relative local path is resolved
against the server's working directory and vLLM rejects it ("Invalid repository ID or local
directory"). :func:`load_speculators_checkpoint` resolves a local verifier against the checkpoint
directory (or takes an explicit override), checks that it is a local directory or a Hub id
(:func:`~kvslots.config.speculative.classify_model`), and returns the target model plus
the explicit speculative config, so vLLM can be started as
``vllm serve <verifier> --speculative-config <json>`` without relying on its detection.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .loader import brief
# What a checkpoint's type means to vLLM, and whether a directory is a checkpoint, are decided
# in .speculative (with every other model-reference rule); re-exported here.
from .speculative import (
    MAX_NUM_SPECULATIVE_TOKENS,
    SPECULATORS_METHODS,
    check_num_speculative_tokens,
    classify_model,
    is_speculators_checkpoint,
    read_model_config,
    reference_text,
)


@dataclass
class SpeculatorsCheckpoint:
    """A validated speculators checkpoint and the vLLM configuration it implies."""

    path: str
    """Absolute path of the draft checkpoint directory."""
    speculators_model_type: str
    method: str
    num_speculative_tokens: int
    verifier: str
    """The target model: an absolute local path or a Hugging Face Hub id."""
    verifier_is_local: bool
    verifier_declared: str
    """``speculators_config.verifier.name_or_path`` as written in config.json."""
    speculative_config: dict[str, Any]
    """vLLM ``--speculative-config``: method, model (this checkpoint) and num_speculative_tokens."""
    warnings: list[str] = field(default_factory=list)


#: Longest quote of a path in a message (brief): enough for a real one.
_PATH_CHARS = 200


def _resolve_verifier(
    declared: str, base: Path, field_name: str, source: str | None
) -> tuple[str, bool]:
    """(target, is_local): a local directory (a relative name resolved against ``base``) or a
    Hugging Face Hub id; anything else is an error suggesting an explicit verifier."""
    ref = classify_model(declared, base=base)
    # Paths quoted briefly (_PATH_CHARS): the file's own value, of any length (a 3 MB name was a
    # 4,130-character error, a deep existing directory a 7,677-character warning).
    if ref.kind == "not_dir":
        raise ConfigError(f"local verifier {brief(ref.path, _PATH_CHARS)} is not a directory", field_name, source)
    if ref.kind == "missing":
        raise ConfigError(
            f"local verifier path {brief(declared, _PATH_CHARS)} does not exist (looked for "
            f"{brief(ref.path, _PATH_CHARS)}); "
            "pass the target model explicitly (verifier=... / --verifier)",
            field_name,
            source,
        )
    return (ref.path, True) if ref.is_local else (declared, False)


def load_speculators_checkpoint(
    model_dir: str | os.PathLike[str],
    *,
    verifier: str | os.PathLike[str] | None = None,
    num_speculative_tokens: int | None = None,
) -> SpeculatorsCheckpoint:
    """Reads and validates a speculators checkpoint.

    ``verifier`` overrides ``speculators_config.verifier.name_or_path`` (a local directory, made
    absolute, or a Hub id); ``num_speculative_tokens`` overrides K from the first proposal method
    (vLLM takes K from the first method, whatever ``default_proposal_method`` says).

    Raises :class:`~kvslots.ConfigError` naming the config.json field on a malformed config.
    """
    base, doc, source = read_model_config(model_dir, "speculators checkpoint")
    spec = doc.get("speculators_config")
    if spec is None:
        raise ConfigError("not a speculators checkpoint: config.json has no speculators_config",
                          "speculators_config", source)
    if not isinstance(spec, dict):
        raise ConfigError(f"must be an object, got {type(spec).__name__}", "speculators_config", source)
    warnings: list[str] = []

    model_type = doc.get("speculators_model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"must be a non-empty string, got {brief(model_type)}", "speculators_model_type", source)
    if model_type not in SPECULATORS_METHODS:
        raise ConfigError(
            f"unsupported speculators model type {brief(model_type)}; vLLM 0.32 loads "
            f"{', '.join(sorted(SPECULATORS_METHODS))}",
            "speculators_model_type",
            source,
        )
    method, extra = SPECULATORS_METHODS[model_type]

    tlc = doc.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise ConfigError(
            "must be an object (vLLM builds the draft model's config from it), got "
            f"{type(tlc).__name__ if tlc is not None else 'nothing'}",
            "transformer_layer_config",
            source,
        )

    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods:
        raise ConfigError("must be a non-empty list of proposal methods",
                          "speculators_config.proposal_methods", source)
    first = methods[0]
    if not isinstance(first, dict):
        raise ConfigError(f"must be an object, got {type(first).__name__}",
                          "speculators_config.proposal_methods[0]", source)
    k = first.get("speculative_tokens")
    k_field = "speculators_config.proposal_methods[0].speculative_tokens"
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"must be an integer, got {brief(k)}", k_field, source)
    if k < 1:
        raise ConfigError(f"must be >= 1, got {k}", k_field, source)
    check_num_speculative_tokens(k, k_field, source)
    default = spec.get("default_proposal_method")
    if default is not None and first.get("proposal_type") not in (None, default):
        warnings.append(
            # Quoted briefly: either may be any value of the file (a 3 MB string was a 3 MB warning).
            f"default_proposal_method is {brief(default)} but vLLM uses the first proposal method "
            f"({brief(first.get('proposal_type'))}, K={k})"
        )
    if num_speculative_tokens is not None:
        # Bounded as the file's K is (10**30 went into vLLM's JSON).
        n = num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or operator.index(n) < 1:  # index: the int's own value
            raise ConfigError(f"must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {brief(n)}",
                              "num_speculative_tokens")
        num_speculative_tokens = check_num_speculative_tokens(operator.index(n), "num_speculative_tokens")
        if num_speculative_tokens != k:
            warnings.append(f"num_speculative_tokens {num_speculative_tokens} overrides the "
                            f"checkpoint's speculative_tokens {k}")
        k = num_speculative_tokens

    ver = spec.get("verifier")
    if not isinstance(ver, dict):
        raise ConfigError(f"must be an object, got {type(ver).__name__ if ver is not None else 'nothing'}",
                          "speculators_config.verifier", source)
    declared = ver.get("name_or_path")
    name_field = "speculators_config.verifier.name_or_path"
    if verifier is not None:
        verifier = reference_text(verifier, "verifier")
        target, local = _resolve_verifier(verifier, Path.cwd(), "verifier", None)
        if declared not in (None, "") and declared != verifier:
            warnings.append(f"verifier {brief(target, _PATH_CHARS)} overrides the checkpoint's {brief(declared)}")
    else:
        if not isinstance(declared, str) or not declared:
            raise ConfigError(f"must be a non-empty string, got {brief(declared)}", name_field, source)
        target, local = _resolve_verifier(declared, base, name_field, source)
        if local and target != declared:
            warnings.append(
                f"local verifier {brief(declared, _PATH_CHARS)} resolved against the checkpoint directory to "
                f"{brief(target, _PATH_CHARS)} "
                "(vLLM would resolve it against its working directory)"
            )

    speculative_config: dict[str, Any] = {"method": method, "model": str(base), "num_speculative_tokens": k}
    speculative_config.update(extra)
    return SpeculatorsCheckpoint(
        path=str(base),
        speculators_model_type=model_type,
        method=method,
        num_speculative_tokens=k,
        verifier=target,
        verifier_is_local=local,
        verifier_declared=declared if isinstance(declared, str) else "",
        speculative_config=speculative_config,
        warnings=warnings,
    )


__all__ = [
    "SPECULATORS_METHODS",
    "SpeculatorsCheckpoint",
    "is_speculators_checkpoint",
    "load_speculators_checkpoint",
]
