"""TensorRT-LLM engine YAML (``--extra_llm_api_options`` / Dynamo's ``--extra-engine-args``) ->
vLLM engine arguments.

:func:`convert_trtllm_config` takes the YAML (a path, YAML text via :func:`parse_trtllm_yaml`, or
an already-loaded mapping) and returns a :class:`ConversionResult`: the vLLM engine arguments as
a dict of ``EngineArgs`` field names (``engine_args``), as ``vllm serve`` flags
(:meth:`ConversionResult.cli_args`), as JSON or as a ``vllm serve --config`` YAML, together with
every key that was mapped, every key that was ignored and why, and warnings where a mapping is
approximate. Nothing is dropped silently: a key that is neither mapped nor known to be
meaningless for vLLM is reported as unknown.

Bad values raise :class:`~kvslots.ConfigError` whose ``field`` is the dotted key path
(``speculative_config.max_draft_len``). docs/config.md has the full mapping table.

:func:`check_with_vllm` (needs vLLM) parses the flags with vLLM's own argument parser, builds
``EngineArgs`` from them and from the dict, compares the two, and can build the full engine
config (``SpeculativeConfig`` included) when the model's config.json is reachable.

The package, one concept per module: :mod:`.loader` (reading the YAML), :mod:`.keys` (the tables
of ignored keys and accepted values), :mod:`.result` (:class:`ConversionResult`),
:mod:`.converter` (:func:`convert_trtllm_config`, dispatching to the key handlers in
:mod:`.engine_keys`, :mod:`.parallel`, :mod:`.kv_cache`, :mod:`.cuda_graphs` and
:mod:`.speculative` over the shared :mod:`.base`) and :mod:`.check` (:func:`check_with_vllm`).
"""

from .check import check_with_vllm
from .converter import convert_trtllm_config
from .keys import DECODING_TYPES, KV_CACHE_IGNORED, TOP_LEVEL_IGNORED
from .loader import load_trtllm_yaml, parse_trtllm_yaml
from .result import ConversionResult, IgnoredKey, MappedKey

__all__ = [
    "ConversionResult",
    "IgnoredKey",
    "MappedKey",
    "DECODING_TYPES",
    "TOP_LEVEL_IGNORED",
    "KV_CACHE_IGNORED",
    "check_with_vllm",
    "convert_trtllm_config",
    "load_trtllm_yaml",
    "parse_trtllm_yaml",
]
