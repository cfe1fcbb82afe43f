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
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .schedule import SCHEDULE_KEY, DynamicSDSchedule
from .speculative import classify_model
from .speculators import load_speculators_checkpoint
from .vllm_args import engine_flag

# TRT-LLM's default max_batch_size (BaseLlmArgs) when the YAML does not set one.
TRTLLM_DEFAULT_MAX_BATCH_SIZE = 2048


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
            raise ValueError("no model: pass model= (the TRT-LLM YAML names none)")
        return [*prefix, str(m), *self.cli_args()]

    def to_json(self) -> str:
        """The engine arguments as JSON (``EngineArgs`` field names)."""
        return json.dumps(self.engine_args, indent=2)

    def to_yaml(self) -> str:
        """The engine arguments as a ``vllm serve --config`` YAML (dashed option names)."""
        yaml = _yaml()
        doc = {k.replace("_", "-") if k != "model" else k: v for k, v in self.engine_args.items()}
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)

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
            lines.append(f"{kind}: {i.path} = {_short(i.value)} ({i.reason})")
        for k, v in self.env.items():
            lines.append(f"env: {k}={v}")
        return lines


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency
        raise ConfigError("PyYAML is needed to read or write YAML (pip install pyyaml)") from e
    return yaml


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"


# ------------------------------------------------------------------------------- YAML input


def parse_trtllm_yaml(text: str, source: str | None = None) -> Any:
    """Parses YAML text; a syntax error becomes a :class:`ConfigError` with the line number.
    Duplicate keys are an error too (PyYAML would keep the last one silently)."""
    yaml = _yaml()

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


# ------------------------------------------------------------------------- ignore tables

_DEFAULT = "TRT-LLM's default, which is also vLLM's behaviour"
_OBJ = "a Python object in TRT-LLM's LLM API; it cannot come from YAML and has no vLLM equivalent"
_STATS = "TRT-LLM statistics/logging knob; vLLM logs its own stats (--disable-log-stats, --enable-log-requests)"
_KERNEL = "TRT-LLM kernel/runtime tuning knob with no vLLM equivalent; vLLM picks its kernels itself"
_COMPILE = "TRT-LLM torch.compile/CUDA-graph internals; vLLM compiles and captures piecewise graphs by default (--compilation-config)"

TOP_LEVEL_IGNORED: dict[str, str] = {
    "backend": "TRT-LLM backend selector (pytorch/_autodeploy/tensorrt); vLLM has a single engine",
    "build_config": "TensorRT engine build settings; vLLM builds nothing ahead of time",
    "print_iter_log": "TRT-LLM per-iteration log switch; vLLM logs throughput periodically (--disable-log-stats turns it off)",
    "cache_transceiver_config": "disaggregated-serving KV transfer (UCX/NIXL/MPI); vLLM configures that with --kv-transfer-config, which kvslots serve sets for its own connector",
    "kv_connector_config": "TRT-LLM KV connector; kvslots serve sets vLLM's --kv-transfer-config to the KVSlotsConnector",
    "gpus_per_node": "vLLM discovers the GPUs (CUDA_VISIBLE_DEVICES)",
    "moe_tensor_parallel_size": "vLLM derives MoE sharding from tensor/data parallelism and --enable-expert-parallel",
    "moe_cluster_parallel_size": "deprecated in TRT-LLM; no vLLM equivalent",
    "enable_lm_head_tp_in_adp": "TRT-LLM attention-DP detail; no vLLM equivalent",
    "cp_config": "TRT-LLM context-parallel (Helix/Ulysses) settings; vLLM's context parallelism is configured differently",
    "max_input_len": "vLLM limits only the total length (max_model_len); prompts may use all of it",
    "gather_generation_logits": "TRT-LLM logits gathering; vLLM returns logprobs per request",
    "num_postprocess_workers": "TRT-LLM detokenization workers; vLLM detokenizes in its front end",
    "postprocess_tokenizer_dir": "TRT-LLM detokenization workers; vLLM detokenizes in its front end",
    "num_serve_frontends": "a server option, not an engine argument (vLLM: vllm serve --api-server-count)",
    "guided_decoding_backend": "vLLM picks the structured-output backend itself; to force one: --structured-outputs-config '{\"backend\": \"xgrammar\"}'",
    "batched_logits_processor": _OBJ,
    "decoding_config": "deprecated in TRT-LLM (replaced by speculative_config)",
    "mpi_session": _OBJ,
    "checkpoint_loader": _OBJ,
    "iter_stats_max_iterations": _STATS,
    "request_stats_max_iterations": _STATS,
    "enable_iter_perf_stats": _STATS,
    "enable_iter_req_stats": _STATS,
    "max_stats_len": _STATS,
    "return_perf_metrics": _STATS,
    "perf_metrics_output_dir": _STATS,
    "perf_metrics_max_requests": _STATS,
    "prometheus_metrics_config": "vLLM serves Prometheus metrics at /metrics with its own buckets",
    "enable_energy_metrics": _STATS,
    "telemetry_config": "TRT-LLM usage telemetry",
    "peft_cache_config": "TRT-LLM LoRA weight cache sizing; vLLM sizes its LoRA cache from --max-loras/--max-cpu-loras",
    "sparse_attention_config": "TRT-LLM sparse attention; vLLM takes sparse attention from the model itself",
    "kv_cache_compression_config": "TRT-LLM KV cache compression; no vLLM equivalent",
    "env_overrides": "environment for TRT-LLM's processes; set what vLLM needs in the launcher's environment",
    "custom_tokenizer": "TRT-LLM custom tokenizer class; vLLM selects tokenizers by --tokenizer-mode",
    "post_processor_hook": "TRT-LLM output post-processing hook; no vLLM equivalent",
    "garbage_collection_gen0_threshold": "TRT-LLM Python GC tuning",
    "encoder_cuda_graph_config": "encoder-decoder CUDA graphs; vLLM's CUDA graph settings are not per encoder",
    "enable_encoder_decoder_mixed_cuda_graph": "encoder-decoder CUDA graphs; no vLLM equivalent",
    "encoder_max_batch_size": "TRT-LLM encoder budget; vLLM budgets encoder work itself",
    "encoder_max_num_tokens": "TRT-LLM encoder budget; vLLM budgets encoder work itself",
    "attention_dp_config": "TRT-LLM attention-DP load balancing; vLLM balances data-parallel ranks itself",
    "nvfp4_gemm_config": _KERNEL,
    "dwdp_config": "TRT-LLM distributed weight data parallelism; no vLLM equivalent",
    "enable_mla_skip_correction": _KERNEL,
    "mla_skip_correction_threshold": _KERNEL,
    "sampler_force_async_worker": _KERNEL,
    "enable_in_graph_sampling": _KERNEL,
    "enable_speculative_beam_history_d2h": _KERNEL,
    "enable_early_first_token_response": "TRT-LLM overlap-scheduler detail; no vLLM equivalent",
    "enable_low_latency_host_dispatch": _KERNEL,
    "batch_wait_timeout_ms": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "batch_wait_timeout_iters": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "batch_wait_max_tokens_ratio": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "torch_compile_config": _COMPILE,
    "prefill_cuda_graph_backend": _COMPILE,
    "prefill_capture_num_tokens": _COMPILE,
    "enable_autotuner": _KERNEL,
    "use_fine_grained_sync": _KERNEL,
    "enable_min_latency": "TRT-LLM Llama-4 min-latency mode; no vLLM equivalent",
    "force_dynamic_quantization": "TRT-LLM quantization switch; vLLM takes quantization from the checkpoint (--quantization)",
    "checkpoint_format": "TRT-LLM checkpoint loader selection; vLLM uses --load-format",
    "checkpoint_io_policy": "TRT-LLM checkpoint I/O tuning",
    "mx_config": "TRT-LLM ModelExpress weight transfer; no vLLM equivalent",
    "gms_config": "TRT-LLM GPU Memory Service; no vLLM equivalent",
    "encode_only": "TRT-LLM encode() path; vLLM serves embeddings with --runner pooling",
    "ray_worker_extension_cls": "TRT-LLM Ray worker extension; vLLM has --worker-extension-cls with a different interface",
    "ray_placement_config": _OBJ,
    "ray_worker_nsight_options": "TRT-LLM Ray profiling options",
    "reorder_policy_config": "TRT-LLM request reordering; vLLM has --scheduling-policy fcfs|priority only",
    "enable_resource_governor": "TRT-LLM runtime cache governor; no vLLM equivalent",
    "use_cute_dsl_blockscaling_mm": _KERNEL,
    "use_cute_dsl_blockscaling_bmm": _KERNEL,
    "use_cute_dsl_bf16_bmm": _KERNEL,
    "use_cute_dsl_bf16_gemm": _KERNEL,
    "layer_wise_benchmarks_config": "TRT-LLM benchmarking calibration",
    "sampler_type": "removed from TRT-LLM (TorchSampler is the only sampler)",
    # Legacy (pre-flattening pytorch_backend_config and older LLM API) keys.
    "mixed_sampler": "legacy TRT-LLM sampler switch",
    "enable_trtllm_sampler": "legacy TRT-LLM sampler switch",
    "autotuner_enabled": _KERNEL,
    "moe_backend": "legacy TRT-LLM MoE kernel choice; vLLM picks its MoE kernels (--moe-backend uses vLLM's names)",
    "torch_compile_enabled": _COMPILE,
    "torch_compile_fullgraph": _COMPILE,
    "torch_compile_inductor_enabled": _COMPILE,
    "torch_compile_piecewise_cuda_graph": _COMPILE,
    "torch_compile_enable_userbuffers": _COMPILE,
}

_KV_MGR = "TRT-LLM KV cache manager internals; vLLM's block manager has no such setting"
KV_CACHE_IGNORED: dict[str, str] = {
    "enable_partial_reuse": "vLLM's prefix cache reuses whole blocks only",
    "copy_on_partial_reuse": "vLLM's prefix cache reuses whole blocks only",
    "max_tokens": "vLLM sizes the KV cache from gpu_memory_utilization or kv_cache_memory_bytes; it has no token cap (num_gpu_blocks_override forces a count instead of capping it)",
    "max_attention_window": "vLLM takes sliding windows from the model config (--disable-sliding-window turns them off)",
    "sink_token_length": "deprecated in TRT-LLM (StreamingLLM); no vLLM equivalent",
    "cross_kv_cache_fraction": "encoder-decoder cross-attention cache split; vLLM sizes it itself",
    "secondary_offload_min_priority": "TRT-LLM host offload priority; kvslots' host tier offloads every committed block",
    "attention_dp_events_gather_period_ms": "TRT-LLM KV event gathering; vLLM publishes events per rank",
    "kv_events_config": "TRT-LLM KV event publisher; kvslots serve turns on vLLM's --kv-events-config",
    "use_uvm": _KV_MGR,
    "iteration_stats_interval": _STATS,
    "use_kv_cache_manager_v2": _KV_MGR,
    "enable_swa_scratch_reuse": _KV_MGR,
    "kv_cache_event_hash_algo": "TRT-LLM event hash choice; vLLM uses --prefix-caching-hash-algo and kvslots' indexer bridges any hash",
    "max_util_for_resume": _KV_MGR,
    "enable_kv_pool_rebalance": _KV_MGR,
    "kv_pool_rebalance_min_sampled_kv_caches": _KV_MGR,
    "kv_pool_rebalance_cooldown_secs": _KV_MGR,
    "kv_pool_rebalance_target_ratio_update_interval": _KV_MGR,
    "kv_pool_rebalance_ratio_threshold": _KV_MGR,
    "kv_pool_rebalance_moving_average_decay": _KV_MGR,
    "kv_pool_rebalance_check_interval": _KV_MGR,
    "disk_cache_size": "TRT-LLM disk KV tier; kvslots provides a host-memory tier only",
    "disk_cache_path": "TRT-LLM disk KV tier; kvslots provides a host-memory tier only",
    "disk_prefetch_num_reqs": "TRT-LLM disk KV tier; kvslots provides a host-memory tier only",
    "fp8_context_mla_kv_len_cap": _KERNEL,
    "pool_ratio": _KV_MGR,
    "avg_seq_len": _KV_MGR,
    "block_reuse_config": _KV_MGR,
    "mamba_state_cache_interval": "TRT-LLM Mamba prefix snapshots; vLLM's are set with --mamba-cache-mode",
    "mamba_state_config": "TRT-LLM Mamba prefix snapshots; vLLM's are set with --mamba-cache-mode",
}

_NO_VERIFY = "vLLM verifies drafts by exact match or standard rejection sampling; this TRT-LLM acceptance/sampling knob has no equivalent"
_TREE = "vLLM drafts a single chain of num_speculative_tokens; TRT-LLM draft trees have no equivalent"
SPEC_COMMON_IGNORED: dict[str, str] = {
    "load_format": "draft weight format; vLLM loads the draft like the target",
    "acceptance_rate_window_size": "vLLM never switches speculation off by acceptance rate",
    "acceptance_rate_threshold": "vLLM never switches speculation off by acceptance rate",
    "use_rejection_sampling": _NO_VERIFY,
    "allow_advanced_sampling": "deprecated no-op in TRT-LLM",
    "advanced_sampling_mode": _NO_VERIFY,
    "enable_penalty": "vLLM applies penalties with speculation without a switch",
    "max_total_draft_tokens": _TREE,
    "sa_config": "TRT-LLM suffix-automaton enhancer; no vLLM equivalent for combining it with a neural drafter",
}
SPEC_TYPE_IGNORED: dict[str, dict[str, str]] = {
    "Eagle": {
        "eagle_choices": _TREE,
        "use_dynamic_tree": _TREE,
        "dynamic_tree_max_topK": _TREE,
        "max_non_leaves_per_layer": _TREE,
        "greedy_sampling": _NO_VERIFY,
        "posterior_threshold": _NO_VERIFY,
        "num_eagle_layers": "deprecated TensorRT-backend field",
        "eagle3_layers_to_capture": "vLLM reads the captured layers from the draft checkpoint (eagle_aux_hidden_state_layer_ids)",
        "eagle3_model_arch": "vLLM reads the draft architecture from its checkpoint",
    },
    "MTP": {
        "use_relaxed_acceptance_for_thinking": _NO_VERIFY,
        "relaxed_topk": _NO_VERIFY,
        "relaxed_delta": _NO_VERIFY,
        "begin_thinking_phase_token": _NO_VERIFY,
        "end_thinking_phase_token": _NO_VERIFY,
        "use_mtp_vanilla": "vLLM runs the checkpoint's MTP layers as they are (repeating the last one for K > layers)",
        "mtp_eagle_one_model": "TRT-LLM implementation choice; vLLM has one MTP implementation",
        "use_dynamic_tree": _TREE,
        "dynamic_tree_max_topK": _TREE,
    },
    "NGram": {
        "is_keep_all": "TRT-LLM n-gram pool detail; vLLM matches against the request's own tokens",
        "is_use_oldest": "TRT-LLM n-gram pool detail; vLLM matches against the request's own tokens",
        "is_public_pool": "TRT-LLM n-gram pool detail; vLLM matches against the request's own tokens",
    },
    "SA": {
        "max_matching_ngram_size": "TRT-LLM suffix-automaton detail; vLLM's suffix decoding is tuned with suffix_decoding_* options",
        "enable_global_pool": "vLLM's suffix decoding always keeps a global tree (suffix_decoding_max_cached_requests)",
        "global_pool_size": "vLLM's suffix decoding always keeps a global tree (suffix_decoding_max_cached_requests)",
    },
    "PARD": {"mask_token_id": "vLLM reads the mask token from the draft checkpoint"},
    "DFlash": {
        "mask_token_id": "vLLM reads it from the draft checkpoint (dflash_config)",
        "target_layer_ids": "vLLM reads it from the draft checkpoint (dflash_config)",
        "attention_backend": "DFlash cross-attention kernel choice; vLLM picks it",
    },
    "DSpark": {
        "mask_token_id": "vLLM reads it from the draft checkpoint",
        "target_layer_ids": "vLLM reads it from the draft checkpoint",
        "block_size": "vLLM requires num_speculative_tokens == the checkpoint's block size",
        "markov_rank": "vLLM reads it from the draft checkpoint",
        "markov_head_type": "vLLM reads it from the draft checkpoint",
        "attention_backend": "DSpark cross-attention kernel choice; vLLM picks it",
    },
}
SPEC_TYPE_IGNORED["Eagle3"] = SPEC_TYPE_IGNORED["Eagle"]

DECODING_TYPES = ("Eagle", "Eagle3", "MTP", "NGram", "Draft_Target", "PARD", "DFlash", "DSpark", "SA",
                  "AUTO", "User_Provided", "SaveState")
_DECODING_BY_LOWER = {t.lower(): t for t in DECODING_TYPES}
_DECODING_BY_LOWER.update({"drafttarget": "Draft_Target", "draft_target": "Draft_Target",
                           "userprovided": "User_Provided", "ngram": "NGram", "eagle3": "Eagle3"})

KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_ds_mla": "fp8_ds_mla", "nvfp4": "nvfp4",
                   "float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                   "bf16": "bfloat16"}
MODEL_DTYPES = {"auto", "float16", "bfloat16", "float32", "half", "float"}

_MAX_BATCH_KEYS = ("batch_sizes", "cuda_graph_batch_sizes")
_PADDING_KEYS = ("enable_padding", "padding_enabled", "cuda_graph_padding_enabled")
_ENCODER_GRAPH_KEYS = ("num_tokens", "max_num_token", "seq_lens", "max_seq_len")


# --------------------------------------------------------------------------------- converter


class _Converter:
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
        self.schedule: DynamicSDSchedule | None = None

    # -- helpers -------------------------------------------------------------------

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

    def int_(self, value: Any, path: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an integer, got {_describe(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"must be >= {minimum}, got {value}")
        return value

    def bool_(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {_describe(value)}")
        return value

    def str_(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {_describe(value)}")
        return value

    def fraction(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"must be a number in (0, 1], got {_describe(value)}")
        if not 0 < value <= 1:
            raise self.fail(path, f"must be in (0, 1], got {value}")
        return float(value)

    def mapping(self, value: Any, path: str, *, allow_none: bool = True) -> dict[str, Any]:
        if value is None and allow_none:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping, got {_describe(value)}")
        for k in value:
            if not isinstance(k, str):
                raise self.fail(f"{path}.{k}", f"keys must be strings, got {_describe(k)}")
        return dict(value)

    def int_list(self, value: Any, path: str, minimum: int = 1) -> list[int]:
        if not isinstance(value, list) or not value:
            raise self.fail(path, f"must be a non-empty list of integers, got {_describe(value)}")
        return [self.int_(v, f"{path}[{i}]", minimum) for i, v in enumerate(value)]

    # -- top level -----------------------------------------------------------------

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
        seen = [m.path for m in self.mapped] + [i.path for i in self.ignored]

        def covered(path: str) -> bool:
            return any(q == path or q.startswith(path + ".") for q in seen)

        def walk(path: str, value: Any) -> None:
            if any(q == path for q in seen):
                return
            if isinstance(value, Mapping) and value:
                for k, v in value.items():
                    walk(f"{path}.{k}", v)
            elif not covered(path):
                self.ignore(path, value, "null or empty: TRT-LLM's default, nothing to convert")

        for _key, path, value in items:
            walk(path, value)

    # Simple one-to-one mappings ----------------------------------------------------

    def k_model(self, v: Any, p: str) -> None:
        self.map(p, "model", self.str_(v, p))

    def k_tokenizer(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "tokenizer", self.str_(v, p))

    def k_tokenizer_mode(self, v: Any, p: str) -> None:
        mode = self.str_(v, p)
        if mode == "auto":
            self.map(p, "tokenizer_mode", "auto")
        elif mode == "slow":
            self.ignore(p, v, "vLLM has no slow-tokenizer mode; it uses the fast (Rust) tokenizer")
        else:
            raise self.fail(p, f"must be 'auto' or 'slow', got {mode!r}")

    def k_skip_tokenizer_init(self, v: Any, p: str) -> None:
        self.map(p, "skip_tokenizer_init", self.bool_(v, p))

    def k_trust_remote_code(self, v: Any, p: str) -> None:
        self.map(p, "trust_remote_code", self.bool_(v, p))

    def k_tensor_parallel_size(self, v: Any, p: str) -> None:
        self.tp = self.int_(v, p, 1)

    def k_pipeline_parallel_size(self, v: Any, p: str) -> None:
        self.map(p, "pipeline_parallel_size", self.int_(v, p, 1))

    def k_context_parallel_size(self, v: Any, p: str) -> None:
        n = self.int_(v, p, 1)
        if n == 1:
            self.ignore(p, v, _DEFAULT)
        else:
            self.ignore(p, v, "TRT-LLM context parallelism (Helix/Ulysses) has no direct vLLM equivalent "
                              "(vLLM has --prefill-context-parallel-size / --decode-context-parallel-size)")
            self.warnings.append(f"{p}={n} is not converted; the vLLM deployment needs its own parallel layout")

    def k_dtype(self, v: Any, p: str) -> None:
        d = self.str_(v, p)
        if d not in MODEL_DTYPES:
            raise self.fail(p, f"must be one of {', '.join(sorted(MODEL_DTYPES))}, got {d!r}")
        self.map(p, "dtype", d)

    def k_revision(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "revision", self.str_(v, p))

    def k_tokenizer_revision(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "tokenizer_revision", self.str_(v, p))

    def k_moe_expert_parallel_size(self, v: Any, p: str) -> None:
        if v is None or v == -1:
            self.ignore(p, v, "auto (TRT-LLM derives it); vLLM's default is no expert parallelism")
            return
        self.ep = self.int_(v, p, 1)
        self.ep_path = p

    def k_enable_attention_dp(self, v: Any, p: str) -> None:
        self.attention_dp = self.bool_(v, p)

    def k_pp_partition(self, v: Any, p: str) -> None:
        if v is None:
            return
        layers = self.int_list(v, p, 1)
        value = ",".join(str(n) for n in layers)
        self.env["VLLM_PP_LAYER_PARTITION"] = value
        self.note(p, "env:VLLM_PP_LAYER_PARTITION", value)

    def k_load_format(self, v: Any, p: str) -> None:
        if isinstance(v, bool):
            raise self.fail(p, f"must be 'auto' or 'dummy', got {_describe(v)}")
        if isinstance(v, int):
            v = {0: "auto", 1: "dummy"}.get(v, v)
        if isinstance(v, str) and v.lower() in ("auto", "dummy"):
            self.map(p, "load_format", v.lower())
        elif isinstance(v, (str, int)):
            self.ignore(p, v, "TRT-LLM load format with no vLLM equivalent (vLLM: --load-format)")
        else:
            raise self.fail(p, f"must be a string, got {_describe(v)}")

    def k_enable_lora(self, v: Any, p: str) -> None:
        self.map(p, "enable_lora", self.bool_(v, p))

    def k_lora_config(self, v: Any, p: str) -> None:
        cfg = self.mapping(v, p)
        if v is not None and "enable_lora" not in self.doc:
            self.map(p, "enable_lora", True)
        simple = {"max_lora_rank": "max_lora_rank", "max_loras": "max_loras", "max_cpu_loras": "max_cpu_loras"}
        reasons = {
            "lora_dir": "vLLM loads adapters by name: vllm serve --lora-modules NAME=PATH, or per request",
            "lora_target_modules": "TRT-LLM module names; vLLM targets the modules the adapters were trained on",
            "trtllm_modules_to_hf_modules": "TRT-LLM module-name mapping; vLLM uses Hugging Face names",
            "lora_ckpt_source": "vLLM loads Hugging Face (PEFT) adapters",
            "swap_gate_up_proj_lora_b_weight": "TRT-LLM adapter layout detail",
            "cuda_graph_specialize_lora": "vLLM specializes CUDA graphs for LoRA by default (--compilation-config)",
        }
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key in simple:
                if value is not None:
                    self.map(sub, simple[key], self.int_(value, sub, 1))
            elif key in reasons:
                self.ignore(sub, value, reasons[key])
            else:
                self.unknown(sub, value, "lora_config option")

    def k_enable_chunked_prefill(self, v: Any, p: str) -> None:
        self.map(p, "enable_chunked_prefill", self.bool_(v, p))

    def k_scheduler_config(self, v: Any, p: str) -> None:
        cfg = self.mapping(v, p)
        reasons = {
            "capacity_scheduler_policy": "vLLM always admits greedily and preempts by recomputation when KV runs out",
            "context_chunking_policy": "vLLM chunks prefills first-come-first-served (--long-prefill-token-threshold)",
            "dynamic_batch_config": "TensorRT-backend batch tuning; no vLLM equivalent",
            "use_python_scheduler": "TRT-LLM scheduler implementation choice",
            "enable_prefix_aware_scheduling": "vLLM's scheduler accounts for prefix hits by default",
        }
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key == "waiting_queue_policy":
                policy = self.str_(value, sub).lower()
                if policy not in ("fcfs", "priority"):
                    raise self.fail(sub, f"must be 'fcfs' or 'priority', got {value!r}")
                self.map(sub, "scheduling_policy", policy)
            elif key in reasons:
                self.ignore(sub, value, reasons[key])
            else:
                self.unknown(sub, value, "scheduler_config option")

    def k_speculative_config(self, v: Any, p: str) -> None:
        self.spec_given = True
        self.spec_doc = v

    def k_max_batch_size(self, v: Any, p: str) -> None:
        self.map(p, "max_num_seqs", self.int_(v, p, 1))

    def k_max_seq_len(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "max_model_len", self.int_(v, p, 1))

    def k_max_num_tokens(self, v: Any, p: str) -> None:
        self.map(p, "max_num_batched_tokens", self.int_(v, p, 1))

    def k_max_beam_width(self, v: Any, p: str) -> None:
        n = self.int_(v, p, 1)
        self.ignore(p, v, _DEFAULT if n == 1 else "vLLM runs beam search per request (use_beam_search), with no engine-wide width")

    def k_reasoning_parser(self, v: Any, p: str) -> None:
        if v is None:
            return
        name = self.str_(v, p)
        vname = name.replace("-", "_")
        self.map(p, "reasoning_parser", vname)
        if vname != name:
            self.warnings.append(f"{p}: TRT-LLM parser {name!r} became vLLM parser {vname!r}; check that vLLM has it")

    def k_otlp_traces_endpoint(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "otlp_traces_endpoint", self.str_(v, p))

    def k_orchestrator_type(self, v: Any, p: str) -> None:
        if v == "ray":
            self.map(p, "distributed_executor_backend", "ray")
        elif v in (None, "rpc", "mpi"):
            self.ignore(p, v, "TRT-LLM worker orchestration; vLLM uses its own multiprocessing executor by default")
        else:
            raise self.fail(p, f"must be 'rpc' or 'ray', got {_describe(v)}")

    def k_model_kwargs(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "hf_overrides", self.mapping(v, p))

    def k_generation_config(self, v: Any, p: str) -> None:
        g = self.str_(v, p)
        if g == "auto":
            self.map(p, "generation_config", "auto")
        elif g == "trtllm":
            self.map(p, "generation_config", "vllm")
        else:
            raise self.fail(p, f"must be 'auto' or 'trtllm', got {g!r}")

    def k_multimodal_config(self, v: Any, p: str) -> None:
        cfg = self.mapping(v, p)
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key == "video_pruning_rate":
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise self.fail(sub, f"must be a number in [0, 1), got {_describe(value)}")
                self.map(sub, "video_pruning_rate", float(value))
            elif key in ("encoder_cuda_graph", "encoder_side_stream_max_ahead", "encoder_cache_max_bytes",
                         "encoder_scheduling_policy"):
                self.ignore(sub, value, "TRT-LLM multimodal encoder scheduling/caching; vLLM's is configured with --mm-processor-cache-gb and friends")
            else:
                self.unknown(sub, value, "multimodal_config option")

    def k_disable_overlap_scheduler(self, v: Any, p: str) -> None:
        if self.bool_(v, p):
            self.map(p, "async_scheduling", False)
        else:
            self.ignore(p, v, "overlap scheduling on is TRT-LLM's default; vLLM turns async scheduling on by default where it supports it")

    def k_enable_overlap_scheduler(self, v: Any, p: str) -> None:  # legacy name, inverted
        if self.bool_(v, p):
            self.ignore(p, v, "legacy TRT-LLM key; vLLM turns async scheduling on by default where it supports it")
        else:
            self.map(p, "async_scheduling", False)

    def k_moe_config(self, v: Any, p: str) -> None:
        cfg = self.mapping(v, p)
        names = {"CUTLASS": "cutlass", "TRITON": "triton", "DEEPGEMM": "deep_gemm", "MARLIN": "marlin",
                 "TRTLLM": "flashinfer_trtllm", "CUTEDSL": "flashinfer_cutedsl",
                 "MEGAMOE_DEEPGEMM": "deep_gemm_mega_moe"}
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key == "backend":
                b = str(value).upper()
                if b == "AUTO":
                    self.ignore(sub, value, _DEFAULT)
                else:
                    hint = f" (closest vLLM choice: --moe-backend {names[b]})" if b in names else ""
                    self.ignore(sub, value, "vLLM picks its MoE kernels for the quantization in use" + hint)
            elif key == "load_balancer":
                self.ignore(sub, value, "TRT-LLM MoE load balancer; vLLM's equivalent is --enable-eplb with --eplb-config (redundant experts)")
            elif key in ("max_num_tokens", "disable_finalize_fusion", "use_low_precision_moe_combine"):
                self.ignore(sub, value, _KERNEL)
            else:
                self.unknown(sub, value, "moe_config option")

    def k_attn_backend(self, v: Any, p: str) -> None:
        b = self.str_(v, p).upper()
        if b == "FLASHINFER":
            self.map(p, "attention_backend", "FLASHINFER")
        else:
            self.ignore(p, v, "TRT-LLM attention kernels; vLLM picks its attention backend (--attention-backend)")

    def k_enable_layerwise_nvtx_marker(self, v: Any, p: str) -> None:
        self.map(p, "enable_layerwise_nvtx_tracing", self.bool_(v, p))

    def k_stream_interval(self, v: Any, p: str) -> None:
        self.map(p, "stream_interval", self.int_(v, p, 1))

    def k_allreduce_strategy(self, v: Any, p: str) -> None:
        if v is None:
            return
        s = self.str_(v, p).upper()
        if s == "NCCL":
            self.map(p, "disable_custom_all_reduce", True)
        elif s == "AUTO":
            self.ignore(p, v, _DEFAULT)
        else:
            self.ignore(p, v, "TRT-LLM all-reduce kernel choice; vLLM picks custom all-reduce or NCCL itself")

    def k_mm_encoder_only(self, v: Any, p: str) -> None:
        self.map(p, "mm_encoder_only", self.bool_(v, p))

    def k_disable_mm_encoder(self, v: Any, p: str) -> None:
        self.map(p, "language_model_only", self.bool_(v, p))

    def k_sleep_config(self, v: Any, p: str) -> None:
        if v is None:
            return
        self.mapping(v, p)
        self.map(p, "enable_sleep_mode", True)
        self.warnings.append(f"{p}: vLLM's sleep mode has levels per call (/sleep?level=), not per-component restore modes")

    def k_kv_cache_dtype(self, v: Any, p: str) -> None:  # legacy pytorch_backend_config key
        self._kv_dtype(v, p)

    # KV cache ---------------------------------------------------------------------

    def _kv_dtype(self, v: Any, p: str) -> None:
        d = self.str_(v, p).lower()
        if d in KV_CACHE_DTYPES:
            self.map(p, "kv_cache_dtype", KV_CACHE_DTYPES[d])
        elif d in ("float32", "fp32", "float", "int8", "int4", "int32", "int64", "bool", "uint8"):
            self.ignore(p, v, f"vLLM has no {d} KV cache; it stores KV in the model dtype ('auto') or fp8/nvfp4")
        else:
            raise self.fail(p, f"must be one of auto, fp8, fp8_ds_mla, nvfp4, float16, bfloat16, got {v!r}")

    def k_kv_cache_config(self, v: Any, p: str) -> None:
        cfg = self.mapping(v, p)
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key == "free_gpu_memory_fraction":
                if value is None:
                    continue
                f = self.fraction(value, sub)
                self.map(sub, "gpu_memory_utilization", f)
                msg = (f"{sub}={value} became gpu_memory_utilization={f}, but the meanings differ: TRT-LLM "
                       "gives the KV cache that fraction of the GPU memory still free after the weights and "
                       "activations are loaded; vLLM lets the whole engine (weights, activations and KV cache) "
                       "use that fraction of the GPU's total memory (vLLM's default is 0.92)")
                if f < 0.5:
                    msg += f"; at {f} the weights must also fit in {f:.0%} of the GPU, so it probably needs raising"
                self.warnings.append(msg)
            elif key == "dtype":
                self._kv_dtype(value, sub)
            elif key == "enable_block_reuse":
                self.map(sub, "enable_prefix_caching", self.bool_(value, sub))
            elif key == "tokens_per_block":
                n = self.int_(value, sub, 1)
                self.map(sub, "block_size", n)
                if n not in (1, 8, 16, 32, 64, 128, 256):
                    self.warnings.append(f"{sub}={n}: vLLM's attention backends support block sizes such as 16, 32 or 64")
            elif key == "max_gpu_total_bytes":
                n = self.int_(value, sub, 0)
                if n == 0:
                    self.ignore(sub, value, "0 means unset in TRT-LLM")
                else:
                    self.map(sub, "kv_cache_memory_bytes", n)
                    self.warnings.append(f"{sub}: TRT-LLM caps the KV cache at {n} bytes; vLLM's "
                                         "kv_cache_memory_bytes sets it to exactly that and then ignores gpu_memory_utilization")
            elif key == "host_cache_size":
                if value is None:
                    continue
                n = self.int_(value, sub, 0)
                self.kvslots["host_cache_bytes"] = n
                self.note(sub, "kvslots.host_cache_bytes", n)
            elif key == "event_buffer_max_size":
                n = self.int_(value, sub, 0)
                if n > 0:
                    self.kvslots["kv_events"] = True
                    self.note(sub, "kvslots.kv_events", True)
                else:
                    self.ignore(sub, value, "0 means KV cache events off in TRT-LLM")
            elif key == "mamba_ssm_cache_dtype":
                d = self.str_(value, sub)
                if d not in ("auto", "float16", "bfloat16", "float32"):
                    raise self.fail(sub, f"must be auto, float16, bfloat16 or float32, got {d!r}")
                self.map(sub, "mamba_ssm_cache_dtype", d)
            elif key == "mamba_ssm_stochastic_rounding":
                self.map(sub, "enable_mamba_cache_stochastic_rounding", self.bool_(value, sub))
            elif key == "mamba_ssm_philox_rounds":
                self.map(sub, "mamba_cache_philox_rounds", self.int_(value, sub, 1))
            elif key in KV_CACHE_IGNORED:
                self.ignore(sub, value, KV_CACHE_IGNORED[key])
            else:
                self.unknown(sub, value, "kv_cache_config option")

    # CUDA graphs --------------------------------------------------------------------

    def k_cuda_graph_config(self, v: Any, p: str) -> None:
        self.graphs_path = p
        if v is None:
            self.graphs = {"disabled": True}
            return
        cfg = self.mapping(v, p, allow_none=False)
        g: dict[str, Any] = {}
        if not cfg:
            self.ignore(p, v, "TRT-LLM's default CUDA graphs; vLLM captures CUDA graphs by default")
        if str(cfg.get("mode", "decode")) == "encode" or any(cfg.get(k) not in (None, 0) for k in _ENCODER_GRAPH_KEYS):
            self.ignore(p, v, "encoder CUDA graphs; vLLM's CUDA graph settings are not per encoder")
            return
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key in _MAX_BATCH_KEYS:
                if value is not None:
                    g["batch_sizes"] = sorted(set(self.int_list(value, sub, 1)))
                    g["batch_sizes_path"] = sub
            elif key in ("max_batch_size", "cuda_graph_max_batch_size"):
                n = self.int_(value, sub, 0)
                if n > 0:
                    g["max_batch_size"] = n
                    g["max_batch_size_path"] = sub
            elif key in _PADDING_KEYS:
                self.bool_(value, sub)
                self.ignore(sub, value, "vLLM always pads a batch up to the next captured size")
            elif key == "mode":
                self.ignore(sub, value, "decode graphs, which is what vLLM captures")
            elif key in _ENCODER_GRAPH_KEYS:
                self.ignore(sub, value, "encoder CUDA graph setting")
            else:
                self.unknown(sub, value, "cuda_graph_config option")
        if "batch_sizes" in g and "max_batch_size" in g and g["max_batch_size"] != max(g["batch_sizes"]):
            self.warnings.append(
                f"{g['max_batch_size_path']}={g['max_batch_size']} differs from max(batch_sizes)="
                f"{max(g['batch_sizes'])} (current TRT-LLM rejects this); the batch sizes win"
            )
        self.graphs = g

    # Legacy flat CUDA graph keys (older TRT-LLM / flattened pytorch_backend_config).
    def k_use_cuda_graph(self, v: Any, p: str) -> None:
        if self.bool_(v, p):
            self.graphs = self.graphs or {}
            self.ignore(p, v, _DEFAULT)
        else:
            self.graphs = {"disabled": True}
            self.graphs_path = p

    def k_cuda_graph_batch_sizes(self, v: Any, p: str) -> None:
        self.graphs = self.graphs if self.graphs is not None else {}
        self.graphs["batch_sizes"] = sorted(set(self.int_list(v, p, 1)))
        self.graphs["batch_sizes_path"] = p

    def k_cuda_graph_max_batch_size(self, v: Any, p: str) -> None:
        self.graphs = self.graphs if self.graphs is not None else {}
        n = self.int_(v, p, 0)
        if n > 0:
            self.graphs["max_batch_size"] = n
            self.graphs["max_batch_size_path"] = p

    def k_cuda_graph_padding_enabled(self, v: Any, p: str) -> None:
        self.bool_(v, p)
        self.ignore(p, v, "vLLM always pads a batch up to the next captured size")

    # -- post phase: parallelism ---------------------------------------------------------

    def post_parallel(self) -> None:
        tp = self.tp or 1
        dp = 1
        if self.attention_dp:
            if tp > 1:
                dp, tp = tp, 1
                self.map("enable_attention_dp", "data_parallel_size", dp)
                self.warnings.append(
                    f"enable_attention_dp with tensor_parallel_size={dp} became data_parallel_size={dp} and "
                    "tensor_parallel_size=1: vLLM runs attention data-parallel across the ranks and shards "
                    "the MoE layers over all of them (expert parallel with --enable-expert-parallel)"
                )
            else:
                self.ignore("enable_attention_dp", True, "no effect with tensor_parallel_size=1")
        elif "enable_attention_dp" in self.doc:
            self.ignore("enable_attention_dp", False, _DEFAULT)
        if self.tp is not None or dp > 1:
            self.map("tensor_parallel_size", "tensor_parallel_size", tp)
        if self.ep is not None:
            ep = self.ep
            self.map(self.ep_path, "enable_expert_parallel", ep > 1)
            world = tp * dp
            if ep > 1 and ep != world:
                self.warnings.append(
                    f"{self.ep_path}={ep}: vLLM's expert-parallel size is tensor x data parallel = {world}, "
                    "not set on its own"
                )

    # -- post phase: speculative decoding -------------------------------------------------

    def post_speculative(self) -> None:
        if not self.spec_given or self.spec_doc is None:
            if self.spec_given:
                self.ignore("speculative_config", None, "null: no speculative decoding")
            return
        p = "speculative_config"
        spec = self.mapping(self.spec_doc, p, allow_none=False)
        if "decoding_type" not in spec:
            raise self.fail(f"{p}.decoding_type", "is required (Eagle, Eagle3, MTP, NGram, Draft_Target, ...)")
        raw_type = spec["decoding_type"]
        if not isinstance(raw_type, str):
            raise self.fail(f"{p}.decoding_type", f"must be a string, got {_describe(raw_type)}")
        dtype = _DECODING_BY_LOWER.get(raw_type.lower())
        if dtype is None:
            raise self.fail(f"{p}.decoding_type",
                            f"unknown decoding type {raw_type!r}; expected one of {', '.join(DECODING_TYPES)}")
        if dtype in ("User_Provided", "SaveState"):
            raise self.fail(f"{p}.decoding_type",
                            f"{dtype} has no vLLM equivalent (it needs a Python drafter object / only saves hidden states)")
        handled = {"decoding_type", "max_draft_len", "speculative_model", "speculative_model_dir",
                   "pytorch_weights_path", "max_concurrency", "draft_len_schedule"}
        out: dict[str, Any] = {}

        # Draft model (three spellings across TRT-LLM versions).
        model_keys = [k for k in ("speculative_model", "speculative_model_dir", "pytorch_weights_path") if spec.get(k) is not None]
        if len(model_keys) > 1 and len({str(spec[k]) for k in model_keys}) > 1:
            raise self.fail(f"{p}.{model_keys[1]}", f"conflicts with {p}.{model_keys[0]}")
        model_path = f"{p}.{model_keys[0]}" if model_keys else f"{p}.speculative_model_dir"
        model = self.str_(spec[model_keys[0]], model_path) if model_keys else None
        for extra in model_keys[1:]:
            self.ignore(f"{p}.{extra}", spec[extra], f"same draft model as {model_path}")

        # Draft length.
        k: int | None = None
        if spec.get("max_draft_len") is not None:
            k = self.int_(spec["max_draft_len"], f"{p}.max_draft_len", 0)

        if dtype in ("Eagle", "Eagle3"):
            handled.add("eagle3_one_model")
            if model is None:
                raise self.fail(f"{p}.speculative_model_dir", f"a draft model is required for {dtype}")
            one_model = spec.get("eagle3_one_model")
            if one_model is not None:
                self.bool_(one_model, f"{p}.eagle3_one_model")
            method, why = _eagle_method(dtype, model, one_model)
            k = self._need_k(k, dtype)
            out.update(method=method, model=model, num_speculative_tokens=k)
            self.note(f"{p}.decoding_type", "speculative_config.method", method)
            if one_model is not None:
                self.note(f"{p}.eagle3_one_model", "speculative_config.method", method)
            self.warnings.extend(f"{p}: {w}" for w in why)
        elif dtype == "MTP":
            handled.add("num_nextn_predict_layers")
            layers = spec.get("num_nextn_predict_layers")
            if layers is not None:
                layers = self.int_(layers, f"{p}.num_nextn_predict_layers", 1)
            if k is not None:
                k = self._need_k(k, dtype)
                if layers is not None and layers != k:
                    self.warnings.append(f"{p}: max_draft_len={k} wins over the deprecated num_nextn_predict_layers={layers}")
                    self.ignore(f"{p}.num_nextn_predict_layers", layers, "max_draft_len takes precedence (as in TRT-LLM)")
                    layers = None
            elif layers is not None:
                k = layers
            else:
                k = 1
                self.warnings.append(f"{p}: no max_draft_len or num_nextn_predict_layers; TRT-LLM reads the "
                                     "checkpoint's MTP layer count, vLLM needs num_speculative_tokens: using 1")
            out["method"] = "mtp"
            if model is not None:
                out["model"] = model
            out["num_speculative_tokens"] = k
            if layers is not None:
                self.note(f"{p}.num_nextn_predict_layers", "speculative_config.num_speculative_tokens", k)
            self.note(f"{p}.decoding_type", "speculative_config.method", "mtp")
        elif dtype in ("NGram", "AUTO"):
            handled.add("max_matching_ngram_size")
            k = self._need_k(k, dtype)
            n = spec.get("max_matching_ngram_size", 2)
            n = self.int_(n, f"{p}.max_matching_ngram_size", 1)
            out.update(method="ngram", num_speculative_tokens=k, prompt_lookup_max=n, prompt_lookup_min=1)
            if "max_matching_ngram_size" in spec:
                self.note(f"{p}.max_matching_ngram_size", "speculative_config.prompt_lookup_max", n)
            self.note(f"{p}.decoding_type", "speculative_config.method", "ngram")
            if dtype == "AUTO":
                self.warnings.append(f"{p}: decoding_type AUTO (TRT-LLM's heuristic draft-free method) became n-gram lookup")
            if model is not None:
                self.ignore(model_path, model, "n-gram lookup needs no draft model")
        elif dtype == "SA":
            k = self._need_k(k, dtype)
            out.update(method="suffix", num_speculative_tokens=k)
            self.note(f"{p}.decoding_type", "speculative_config.method", "suffix")
            self.warnings.append(f"{p}: suffix-automaton drafting became vLLM's suffix decoding (a suffix tree, "
                                 "which needs the arctic-inference package)")
        elif dtype in ("Draft_Target", "PARD", "DFlash"):
            if model is None:
                raise self.fail(f"{p}.speculative_model_dir", f"a draft model is required for {dtype}")
            k = self._need_k(k, dtype)
            method = {"Draft_Target": "draft_model", "PARD": "draft_model", "DFlash": "dflash"}[dtype]
            out.update(method=method, model=model, num_speculative_tokens=k)
            if dtype == "PARD":
                out["parallel_drafting"] = True
            self.note(f"{p}.decoding_type", "speculative_config.method", method)
        elif dtype == "DSpark":
            k = self._need_k(k, dtype)
            out["method"] = "dspark"
            if model is not None:
                out["model"] = model
            out["num_speculative_tokens"] = k
            self.note(f"{p}.decoding_type", "speculative_config.method", "dspark")
        if "max_draft_len" in spec:
            self.note(f"{p}.max_draft_len", "speculative_config.num_speculative_tokens", out["num_speculative_tokens"])
        if "model" in out:
            self.note(model_path, "speculative_config.model", out["model"])

        # Dynamic draft length.
        k = out["num_speculative_tokens"]
        mc, dls = spec.get("max_concurrency"), spec.get("draft_len_schedule")
        max_bs = self.args.get("max_num_seqs", TRTLLM_DEFAULT_MAX_BATCH_SIZE)
        if mc is not None and dls is not None:
            raise self.fail(f"{p}.draft_len_schedule", "max_concurrency and draft_len_schedule are mutually exclusive")
        if mc is not None:
            mc = self.int_(mc, f"{p}.max_concurrency", 1)
            self.schedule = DynamicSDSchedule.from_max_concurrency(mc, k, max_batch_size=max_bs)
            self.note(f"{p}.max_concurrency", f"speculative_config.{SCHEDULE_KEY}", self.schedule.to_list())
        elif dls is not None:
            try:
                self.schedule = DynamicSDSchedule.from_draft_len_schedule(
                    dls, k, max_batch_size=max_bs, field=f"{p}.draft_len_schedule")
            except ConfigError as e:
                raise ConfigError(e.reason, e.field, self.source) from None
            self.note(f"{p}.draft_len_schedule", f"speculative_config.{SCHEDULE_KEY}", self.schedule.to_list())
        if self.schedule is not None:
            out[SCHEDULE_KEY] = self.schedule.to_list()
            if self.args.get("data_parallel_size", 1) > 1:
                self.warnings.append(f"{p}: vLLM 0.32 disables num_speculative_tokens_per_batch_size with data "
                                     "parallelism and speculates with the fixed maximum K")

        ignored_here = dict(SPEC_COMMON_IGNORED)
        ignored_here.update(SPEC_TYPE_IGNORED.get(dtype, {}))
        for key, value in spec.items():
            if key in handled:
                continue
            sub = f"{p}.{key}"
            if key in ignored_here:
                self.ignore(sub, value, ignored_here[key])
            else:
                self.unknown(sub, value, f"speculative_config option for {dtype}")
        self.args["speculative_config"] = out

    def _need_k(self, k: int | None, dtype: str) -> int:
        if k is None:
            raise self.fail("speculative_config.max_draft_len", f"is required for {dtype}")
        if k == 0:
            raise self.fail("speculative_config.max_draft_len", f"must be > 0 for {dtype}, got 0")
        return k

    # -- post phase: CUDA graphs (needs K) -------------------------------------------------

    def post_graphs(self) -> None:
        g = self.graphs
        if g is None:
            return
        if g.get("disabled"):
            self.map(self.graphs_path, "enforce_eager", True)
            return
        spec = self.args.get("speculative_config")
        k = spec["num_speculative_tokens"] if spec else 0

        def tokens(b: int) -> int:
            kb = self.schedule.k_for_batch_size(b) if self.schedule else k
            return b * (1 + kb)

        if "batch_sizes" in g:
            sizes = sorted({tokens(b) for b in g["batch_sizes"]})
            self.map(g["batch_sizes_path"], "cudagraph_capture_sizes", sizes)
            limit = self.args.get("max_num_batched_tokens")
            if limit is not None and sizes[-1] > limit:
                self.warnings.append(f"cudagraph_capture_sizes above max_num_batched_tokens={limit} are dropped by vLLM")
            if "max_batch_size" in g:
                self.ignore(g["max_batch_size_path"], g["max_batch_size"], "implied by the batch sizes")
        elif "max_batch_size" in g:
            mbs = g["max_batch_size"]
            size = max(tokens(b) for b in range(1, mbs + 1))
            self.map(g["max_batch_size_path"], "max_cudagraph_capture_size", size)
        else:
            return
        if k:
            self.warnings.append(
                "CUDA graph batch sizes became token counts: vLLM captures graphs by tokens per step, and a "
                f"decode request runs 1 + K tokens (K={'the scheduled K' if self.schedule else k})"
            )


def _eagle_method(dtype: str, model: str, one_model: bool | None) -> tuple[str, list[str]]:
    """eagle or eagle3 for a TRT-LLM Eagle config, and notes on how it was decided.

    Evidence, strongest first: the draft checkpoint's config.json (when the path is local),
    "eagle3" in the draft's name, ``decoding_type: Eagle3`` or ``eagle3_one_model: true`` (the
    one-model path exists only for EAGLE-3), "eagle" in the draft's name or
    ``eagle3_one_model: false``, and last TRT-LLM's default (EAGLE-3 on the PyTorch backend).
    """
    ckpt = classify_model(model).draft_method
    if ckpt is not None:
        method, why = ckpt
        if method != "eagle3" and (dtype == "Eagle3" or one_model is True):
            return method, [f"the draft checkpoint is {method} ({why}) although the YAML says EAGLE-3; using {method}"]
        return method, []
    lower = Path(model.rstrip("/")).name.lower()  # the name, not the directories above it
    if re.search(r"eagle-?3", lower):
        return "eagle3", []
    if dtype == "Eagle3" or one_model is True:
        return "eagle3", []
    if "eagle" in lower:
        return "eagle", [f"method eagle chosen from the draft model's name {model!r}"]
    if one_model is False:
        return "eagle", [
            "eagle3_one_model=false and nothing says the draft is EAGLE-3: using method eagle "
            "(TRT-LLM's two-model path also ran EAGLE-3; use decoding_type: Eagle3 for an EAGLE-3 draft)"
        ]
    return "eagle3", [
        "nothing says whether the draft is EAGLE or EAGLE-3: using eagle3 (TRT-LLM's PyTorch backend runs "
        "EAGLE-3 by default)"
    ]


# ------------------------------------------------------------------------------ public API


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
    unless ``model`` is given; ``verifier`` overrides the checkpoint's verifier.

    Raises :class:`~kvslots.ConfigError` naming the field on bad input.
    """
    src: str | None = None
    if isinstance(source, (str, os.PathLike)):
        src = os.fspath(source)
        doc = load_trtllm_yaml(src)
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
    for key in doc:
        if not isinstance(key, str):
            raise ConfigError(f"option names must be strings, got {_describe(key)}", str(key), src)

    conv = _Converter(doc, src)
    conv.warnings.extend(warnings)
    conv.run()
    args = conv.args

    if speculators_dir is not None:
        ckpt = load_speculators_checkpoint(speculators_dir, verifier=verifier)
        spec = dict(ckpt.speculative_config)
        old = args.get("speculative_config")
        if old is not None:
            conv.warnings.append(
                f"--speculators-dir replaces speculative_config (method {old.get('method')}, K="
                f"{old.get('num_speculative_tokens')}) with the checkpoint's (method {spec['method']}, "
                f"K={spec['num_speculative_tokens']})"
            )
        if conv.schedule is not None:
            try:
                sched = DynamicSDSchedule.parse(conv.schedule.to_list(), spec["num_speculative_tokens"])
            except ConfigError as e:
                raise ConfigError(
                    f"the YAML's dynamic draft-length schedule does not fit the checkpoint's K="
                    f"{spec['num_speculative_tokens']}: {e.reason}", e.field, src
                ) from None
            spec[SCHEDULE_KEY] = sched.to_list()
            conv.schedule = sched
        args["speculative_config"] = spec
        conv.mapped.append(MappedKey(f"{ckpt.path}/config.json", "speculative_config", spec))
        conv.warnings.extend(f"speculators checkpoint: {w}" for w in ckpt.warnings)
        if model is None:
            if args.get("model") not in (None, ckpt.verifier):
                conv.warnings.append(f"the YAML's model {args['model']!r} replaced by the checkpoint's verifier {ckpt.verifier!r}")
            args["model"] = ckpt.verifier
            conv.mapped.append(MappedKey(f"{ckpt.path}/config.json:speculators_config.verifier.name_or_path",
                                         "model", ckpt.verifier))
    if model is not None:
        args["model"] = model

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

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    m = model or result.model
    if build and not m:
        raise ValueError("building the engine config needs a model (pass model=)")
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
