"""The TRT-LLM keys the converter knows without mapping them, and why (each reason is shown to the
user), and the value spellings it accepts: the tables docs/config.md lists."""

from __future__ import annotations

# TRT-LLM's default max_batch_size (BaseLlmArgs) when the YAML does not set one.
TRTLLM_DEFAULT_MAX_BATCH_SIZE = 2048

REASON_DEFAULT = "TRT-LLM's default, which is also vLLM's behaviour"
_OBJ = "a Python object in TRT-LLM's LLM API; it cannot come from YAML and has no vLLM equivalent"
_STATS = "TRT-LLM statistics/logging knob; vLLM logs its own stats (--disable-log-stats, --enable-log-requests)"
REASON_KERNEL = "TRT-LLM kernel/runtime tuning knob with no vLLM equivalent; vLLM picks its kernels itself"
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
    "nvfp4_gemm_config": REASON_KERNEL,
    "dwdp_config": "TRT-LLM distributed weight data parallelism; no vLLM equivalent",
    "enable_mla_skip_correction": REASON_KERNEL,
    "mla_skip_correction_threshold": REASON_KERNEL,
    "sampler_force_async_worker": REASON_KERNEL,
    "enable_in_graph_sampling": REASON_KERNEL,
    "enable_speculative_beam_history_d2h": REASON_KERNEL,
    "enable_early_first_token_response": "TRT-LLM overlap-scheduler detail; no vLLM equivalent",
    "enable_low_latency_host_dispatch": REASON_KERNEL,
    "batch_wait_timeout_ms": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "batch_wait_timeout_iters": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "batch_wait_max_tokens_ratio": "TRT-LLM batching delay; vLLM schedules every step without waiting",
    "torch_compile_config": _COMPILE,
    "prefill_cuda_graph_backend": _COMPILE,
    "prefill_capture_num_tokens": _COMPILE,
    "enable_autotuner": REASON_KERNEL,
    "use_fine_grained_sync": REASON_KERNEL,
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
    "use_cute_dsl_blockscaling_mm": REASON_KERNEL,
    "use_cute_dsl_blockscaling_bmm": REASON_KERNEL,
    "use_cute_dsl_bf16_bmm": REASON_KERNEL,
    "use_cute_dsl_bf16_gemm": REASON_KERNEL,
    "layer_wise_benchmarks_config": "TRT-LLM benchmarking calibration",
    "sampler_type": "removed from TRT-LLM (TorchSampler is the only sampler)",
    # Legacy (pre-flattening pytorch_backend_config and older LLM API) keys.
    "mixed_sampler": "legacy TRT-LLM sampler switch",
    "enable_trtllm_sampler": "legacy TRT-LLM sampler switch",
    "autotuner_enabled": REASON_KERNEL,
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
    "disk_cache_size": "TRT-LLM disk KV tier; not mapped: set kvslots' disk tier with kvslots serve --disk-path DIR --disk-gb N",
    "disk_cache_path": "TRT-LLM disk KV tier; not mapped: set kvslots' disk tier with kvslots serve --disk-path DIR --disk-gb N",
    "disk_prefetch_num_reqs": "TRT-LLM disk KV tier; not mapped: set kvslots' disk tier with kvslots serve --disk-path DIR --disk-gb N",
    "fp8_context_mla_kv_len_cap": REASON_KERNEL,
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
DECODING_BY_LOWER = {t.lower(): t for t in DECODING_TYPES}
DECODING_BY_LOWER.update({"drafttarget": "Draft_Target", "draft_target": "Draft_Target",
                           "userprovided": "User_Provided", "ngram": "NGram", "eagle3": "Eagle3"})

KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_ds_mla": "fp8_ds_mla", "nvfp4": "nvfp4",
                   "float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                   "bf16": "bfloat16"}
MODEL_DTYPES = {"auto", "float16", "bfloat16", "float32", "half", "float"}

MAX_BATCH_KEYS = ("batch_sizes", "cuda_graph_batch_sizes")
PADDING_KEYS = ("enable_padding", "padding_enabled", "cuda_graph_padding_enabled")
ENCODER_GRAPH_KEYS = ("num_tokens", "max_num_token", "seq_lens", "max_seq_len")


__all__ = [
    "DECODING_BY_LOWER",
    "DECODING_TYPES",
    "ENCODER_GRAPH_KEYS",
    "KV_CACHE_DTYPES",
    "KV_CACHE_IGNORED",
    "MAX_BATCH_KEYS",
    "MODEL_DTYPES",
    "PADDING_KEYS",
    "REASON_DEFAULT",
    "REASON_KERNEL",
    "SPEC_COMMON_IGNORED",
    "SPEC_TYPE_IGNORED",
    "TOP_LEVEL_IGNORED",
    "TRTLLM_DEFAULT_MAX_BATCH_SIZE",
]
