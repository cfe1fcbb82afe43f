"""The converter: every key of a TRT-LLM engine YAML handed to its handler (or reported as ignored
or unknown), then the post phases that need several keys, and :func:`convert_trtllm_config`."""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from ..loader import MAX_ENGINE_NODES, check_values
from ..speculative import check_draft_model
from .base import describe
from .cuda_graphs import CudaGraphKeys
from .engine_keys import EngineKeys
from .keys import TOP_LEVEL_IGNORED
from .kv_cache import KvCacheKeys
from .loader import load_trtllm_yaml
from .parallel import ParallelKeys
from .result import ConversionResult
from .speculative import SpeculativeKeys


class _Converter(EngineKeys, ParallelKeys, KvCacheKeys, CudaGraphKeys, SpeculativeKeys):
    """One conversion: ``k_<key>`` handlers from the mixins, dispatched by key name."""

    def run(self) -> None:
        doc = dict(self.doc)
        legacy = doc.pop("pytorch_backend_config", None)
        items: list[tuple[str, str, Any]] = [(k, k, v) for k, v in doc.items()]
        if legacy is not None:
            legacy = self.mapping(legacy, "pytorch_backend_config")
            for k, v in legacy.items():
                if k in doc:
                    self.warnings.append(
                        f"pytorch_backend_config.{k} is also set at the top level; the top-level value wins"
                    )
                    self.ignore(f"pytorch_backend_config.{k}", v, f"overridden by the top-level {k}")
                    continue
                items.append((k, f"pytorch_backend_config.{k}", v))
        for key, path, value in items:
            handler = getattr(self, f"k_{key}", None)
            if handler is not None:
                handler(value, path)
            elif key in TOP_LEVEL_IGNORED:
                self.ignore(path, value, TOP_LEVEL_IGNORED[key])
            else:
                self.unknown(path, value)
        self.post_parallel()
        self.post_speculative()
        self.post_graphs()
        self.sweep(items)

    def sweep(self, items: list[tuple[str, str, Any]]) -> None:
        """Reports every key no handler recorded (a null or empty value), so none vanishes."""
        seen = {m.path for m in self.mapped} | {i.path for i in self.ignored}
        # Whether a recorded path starts with path + ".": the recorded paths that do are next
        # to each other in sorted order, after path + "." (every such prefix of every path, as
        # a set, was keys x dots strings: 3,900 keys of 1,000 dots took 10 s and 2.4 GB).
        ordered = sorted(seen)

        def covered(path: str) -> bool:
            if path in seen:
                return True
            below = path + "."
            i = bisect_left(ordered, below)
            return i < len(ordered) and ordered[i].startswith(below)

        def walk(path: str, value: Any) -> None:
            if path in seen:
                return
            if isinstance(value, Mapping) and value:
                for k, v in value.items():
                    walk(f"{path}.{k}", v)
            elif not covered(path):
                self.ignore(path, value, "null or empty: TRT-LLM's default, nothing to convert")

        for _key, path, value in items:
            walk(path, value)


def convert_trtllm_config(
    source: Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    model: str | None = None,
    speculators_dir: str | os.PathLike[str] | None = None,
    verifier: str | None = None,
) -> ConversionResult:
    """Converts a TRT-LLM engine YAML to vLLM engine arguments.

    ``source`` is a path to the YAML file or the already-loaded mapping (``None`` / an empty
    document converts to nothing). ``model`` sets the target model (it wins over a ``model``
    key in the YAML). ``speculators_dir`` is a speculators-format draft checkpoint: its
    speculative config replaces the YAML's ``speculative_config`` (method and K from the
    checkpoint; a dynamic schedule from the YAML is kept) and its verifier becomes the model
    unless ``model`` is given; ``verifier`` overrides the checkpoint's verifier (and is an error
    without ``speculators_dir``).

    Raises :class:`~kvslots.ConfigError` naming the field on bad input.
    """
    if verifier is not None and speculators_dir is None:
        # The one home of this rule (kvslots serve and convert-config both come here).
        raise ConfigError("applies to a speculators checkpoint (a draft directory whose config.json has "
                          "speculators_config), and none is given", "verifier")
    src: str | None = None
    if isinstance(source, (str, os.PathLike)):
        doc = load_trtllm_yaml(source)  # a PathLike that names no path is the reader's error
        src = os.fsdecode(os.fspath(source))
    else:
        doc = source
    warnings: list[str] = []
    if doc is None:
        doc = {}
        warnings.append("the document is empty: nothing to convert")
    if not isinstance(doc, Mapping):
        raise ConfigError(
            f"the document must be a mapping of TRT-LLM options, got {type(doc).__name__}", None, src
        )
    if src is None:  # a mapping given in code gets the file's value rules (NaN, sets, cycles, depth),
        doc = check_values(doc, max_nodes=MAX_ENGINE_NODES)  # and is read once: plain data from here on
    for key in doc:
        if not isinstance(key, str):
            raise ConfigError(f"option names must be strings, got {describe(key)}", str(key), src)

    conv = _Converter(doc, src)
    conv.warnings.extend(warnings)
    conv.run()
    args = conv.args

    if speculators_dir is not None:
        conv.apply_speculators_checkpoint(speculators_dir, verifier, model)
    else:  # a draft the checkpoint replaces is not read, so not checked
        conv.check_draft_model()
    # The target model: the same rule as a draft's (a checkpoint's verifier is checked by its loader).
    if model is not None:
        # As text: a Path was kept as given (to_json refused it, to_yaml raised yaml's error).
        args["model"] = check_draft_model(model, "model", what="model").argument
    elif speculators_dir is None and "model" in args:
        args["model"] = check_draft_model(args["model"], "model", src, what="model").argument

    # Keep ``model`` first for readability.
    if "model" in args:
        args = {"model": args["model"], **{k: v for k, v in args.items() if k != "model"}}
    return ConversionResult(
        engine_args=args,
        mapped=conv.mapped,
        ignored=conv.ignored,
        warnings=conv.warnings,
        schedule=conv.schedule,
        env=conv.env,
        kvslots=conv.kvslots,
        source=src,
    )


# A minimal model config for parse-only checks: vLLM's EngineArgs resolves the model path on


__all__ = ["convert_trtllm_config"]
