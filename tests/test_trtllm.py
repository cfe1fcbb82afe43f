"""TensorRT-LLM engine YAML -> vLLM engine arguments (kvslots.config.trtllm and `kvslots convert-config`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kvslots import ConfigError, cli
from kvslots.config.trtllm import (
    KV_CACHE_IGNORED,
    TOP_LEVEL_IGNORED,
    convert_trtllm_config,
    parse_trtllm_yaml,
)

# --------------------------------------------------------------------------- realistic samples
# Shaped after the engine configs TRT-LLM users run (Dynamo's examples for Llama-4 EAGLE-3,
# DeepSeek-R1 MTP and wide-EP, gpt-oss disaggregated), including their legacy spellings.

EAGLE3_ONE_MODEL = """\
backend: pytorch
tensor_parallel_size: 8
moe_expert_parallel_size: 8
max_batch_size: 8
# When max_num_tokens is set to higher values, it can OOM.
max_num_tokens: 4096
disable_overlap_scheduler: true

speculative_config:
  decoding_type: Eagle
  max_draft_len: 3
  pytorch_weights_path: nvidia/Llama-4-Maverick-17B-128E-Eagle3
  eagle3_one_model: true

kv_cache_config:
  free_gpu_memory_fraction: 0.5
  enable_block_reuse: false

cuda_graph_config:
  padding_enabled: true
  max_batch_size: 8

print_iter_log: true
"""

MTP_DEEPSEEK = """\
backend: pytorch
tensor_parallel_size: 4
moe_expert_parallel_size: 4
enable_attention_dp: true
max_batch_size: 256
# 8448 = 8192 ISL + 256 OSL
max_num_tokens: 8448
max_seq_len: 8448
trust_remote_code: true
kv_cache_config:
  free_gpu_memory_fraction: 0.85
  dtype: fp8
speculative_config:
  decoding_type: MTP
  num_nextn_predict_layers: 1
cuda_graph_config:
  enable_padding: true
  batch_sizes: [1, 2, 4, 8, 16, 32, 64, 128, 256]
print_iter_log: true
"""

WIDE_EP_DECODE = """\
backend: pytorch
moe_config:
  backend: CUTLASS
  load_balancer: /mnt/engine_configs/deepseek_r1/wide_ep/eplb.yaml
tensor_parallel_size: 16
moe_expert_parallel_size: 16
pipeline_parallel_size: 1
enable_attention_dp: true
max_batch_size: 256
max_num_tokens: 256
max_seq_len: 8448
kv_cache_config:
  free_gpu_memory_fraction: 0.30
  dtype: fp8
disable_overlap_scheduler: false
cuda_graph_config:
  enable_padding: true
  batch_sizes: [1, 2, 4, 8, 16, 32, 64, 128, 256]
print_iter_log: true
"""

GPT_OSS_DECODE = """\
tensor_parallel_size: 4
moe_expert_parallel_size: 4
enable_attention_dp: false
enable_min_latency: false
disable_overlap_scheduler: false
moe_config:
    backend: TRTLLM
trust_remote_code: true
backend: pytorch
cuda_graph_config:
    max_batch_size: 128
    enable_padding: true
kv_cache_config:
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  tokens_per_block: 32
  host_cache_size: 45000000000
  event_buffer_max_size: 1024
cache_transceiver_config:
  backend: UCX
  max_tokens_in_buffer: 65536
print_iter_log: false
stream_interval: 10
max_num_tokens: 16384
"""

LEGACY_PYTORCH_BACKEND = """\
backend: pytorch
tensor_parallel_size: 2
max_batch_size: 32
pytorch_backend_config:
  use_cuda_graph: true
  cuda_graph_batch_sizes: [1, 2, 4, 8, 16, 32]
  cuda_graph_padding_enabled: true
  enable_overlap_scheduler: false
  kv_cache_dtype: fp8
  print_iter_log: true
speculative_config:
  decoding_type: NGram
  max_draft_len: 4
  max_matching_ngram_size: 3
  is_keep_all: true
"""


def convert_text(text: str, **kw):
    return convert_trtllm_config(parse_trtllm_yaml(text), **kw)


def paths(items) -> set[str]:
    return {i.path for i in items}


def test_eagle3_one_model_llama4(tmp_path):
    f = tmp_path / "eagle_agg.yaml"
    f.write_text(EAGLE3_ONE_MODEL)
    r = convert_trtllm_config(f)
    assert r.source == str(f)
    assert r.engine_args == {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
        "async_scheduling": False,
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "tensor_parallel_size": 8,
        "enable_expert_parallel": True,
        "speculative_config": {"method": "eagle3", "model": "nvidia/Llama-4-Maverick-17B-128E-Eagle3",
                               "num_speculative_tokens": 3},
        # 8 requests x (1 + K=3) tokens per decode step.
        "max_cudagraph_capture_size": 32,
    }
    assert paths(r.ignored) == {"backend", "print_iter_log", "cuda_graph_config.padding_enabled"}
    assert r.unknown == []
    assert any("meanings differ" in w for w in r.warnings)
    assert any("token counts" in w for w in r.warnings)
    assert {(m.path, m.target) for m in r.mapped} >= {
        ("speculative_config.pytorch_weights_path", "speculative_config.model"),
        ("speculative_config.max_draft_len", "speculative_config.num_speculative_tokens"),
        ("speculative_config.eagle3_one_model", "speculative_config.method"),
        ("kv_cache_config.free_gpu_memory_fraction", "gpu_memory_utilization"),
        ("disable_overlap_scheduler", "async_scheduling"),
    }
    assert r.cli_args() == [
        "--max-num-seqs", "8", "--max-num-batched-tokens", "4096", "--no-async-scheduling",
        "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--tensor-parallel-size", "8",
        "--enable-expert-parallel", "--speculative-config",
        '{"method":"eagle3","model":"nvidia/Llama-4-Maverick-17B-128E-Eagle3","num_speculative_tokens":3}',
        "--max-cudagraph-capture-size", "32",
    ]


def test_mtp_deepseek_with_attention_dp():
    r = convert_text(MTP_DEEPSEEK)
    assert r.engine_args == {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8448,
        "max_model_len": 8448,
        "trust_remote_code": True,
        "gpu_memory_utilization": 0.85,
        "kv_cache_dtype": "fp8",
        "data_parallel_size": 4,
        "tensor_parallel_size": 1,
        "enable_expert_parallel": True,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        "cudagraph_capture_sizes": [2, 4, 8, 16, 32, 64, 128, 256, 512],
    }
    assert any("data_parallel_size=4" in w for w in r.warnings)
    assert not any("expert-parallel size" in w for w in r.warnings)  # EP 4 == TP 1 x DP 4
    assert ("speculative_config.num_nextn_predict_layers", "speculative_config.num_speculative_tokens") in {
        (m.path, m.target) for m in r.mapped}
    assert paths(r.ignored) == {"backend", "print_iter_log", "cuda_graph_config.enable_padding"}


def test_wide_ep_decode():
    r = convert_text(WIDE_EP_DECODE)
    a = r.engine_args
    assert a["data_parallel_size"] == 16 and a["tensor_parallel_size"] == 1 and a["enable_expert_parallel"] is True
    assert a["pipeline_parallel_size"] == 1
    assert a["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # no speculation: batch == tokens
    assert "async_scheduling" not in a
    ignored = {i.path: i.reason for i in r.ignored}
    assert "--moe-backend cutlass" in ignored["moe_config.backend"]
    assert "--enable-eplb" in ignored["moe_config.load_balancer"]
    assert "disable_overlap_scheduler" in ignored
    assert any("probably needs raising" in w for w in r.warnings)
    assert r.unknown == []


def test_gpt_oss_disaggregated_decode():
    r = convert_text(GPT_OSS_DECODE)
    a = r.engine_args
    assert a == {
        "tensor_parallel_size": 4,
        "enable_expert_parallel": True,
        "trust_remote_code": True,
        "gpu_memory_utilization": 0.8,
        "enable_prefix_caching": True,
        "block_size": 32,
        "stream_interval": 10,
        "max_num_batched_tokens": 16384,
        "max_cudagraph_capture_size": 128,
    }
    assert r.kvslots == {"host_cache_bytes": 45000000000, "kv_events": True}
    ignored = {i.path: i.reason for i in r.ignored}
    for key in ("cache_transceiver_config", "enable_min_latency", "enable_attention_dp",
                "disable_overlap_scheduler", "moe_config.backend", "print_iter_log", "backend",
                "cuda_graph_config.enable_padding"):
        assert key in ignored, key
    assert "kv-transfer-config" in ignored["cache_transceiver_config"]
    assert "flashinfer_trtllm" in ignored["moe_config.backend"]
    assert ("kv_cache_config.host_cache_size", "kvslots.host_cache_bytes") in {(m.path, m.target) for m in r.mapped}


def test_legacy_pytorch_backend_config_is_flattened():
    r = convert_text(LEGACY_PYTORCH_BACKEND)
    a = r.engine_args
    assert a["async_scheduling"] is False
    assert a["kv_cache_dtype"] == "fp8"
    assert a["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # Batch sizes x (1 + 4) tokens.
    assert a["cudagraph_capture_sizes"] == [5, 10, 20, 40, 80, 160]
    ignored = paths(r.ignored)
    assert {"pytorch_backend_config.use_cuda_graph", "pytorch_backend_config.cuda_graph_padding_enabled",
            "pytorch_backend_config.print_iter_log", "speculative_config.is_keep_all"} <= ignored


def test_legacy_key_conflicting_with_top_level():
    r = convert_trtllm_config({"kv_cache_dtype": "auto", "pytorch_backend_config": {"kv_cache_dtype": "fp8"}})
    assert r.engine_args["kv_cache_dtype"] == "auto"
    assert "pytorch_backend_config.kv_cache_dtype" in paths(r.ignored)
    assert any("top-level value wins" in w for w in r.warnings)


# --------------------------------------------------------------------------- one key at a time

MAPPINGS = [
    ({"model": "meta-llama/Llama-3.1-8B-Instruct"}, {"model": "meta-llama/Llama-3.1-8B-Instruct"}),
    ({"tokenizer": "org/tok"}, {"tokenizer": "org/tok"}),
    ({"tokenizer_mode": "auto"}, {"tokenizer_mode": "auto"}),
    ({"skip_tokenizer_init": True}, {"skip_tokenizer_init": True}),
    ({"trust_remote_code": True}, {"trust_remote_code": True}),
    ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 2}),
    ({"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 2}),
    ({"dtype": "bfloat16"}, {"dtype": "bfloat16"}),
    ({"revision": "main", "tokenizer_revision": "v1"}, {"revision": "main", "tokenizer_revision": "v1"}),
    ({"max_batch_size": 64}, {"max_num_seqs": 64}),
    ({"max_num_tokens": 8192}, {"max_num_batched_tokens": 8192}),
    ({"max_seq_len": 4096}, {"max_model_len": 4096}),
    ({"tensor_parallel_size": 4, "moe_expert_parallel_size": 4},
     {"tensor_parallel_size": 4, "enable_expert_parallel": True}),
    ({"tensor_parallel_size": 4, "moe_expert_parallel_size": 1},
     {"tensor_parallel_size": 4, "enable_expert_parallel": False}),
    ({"tensor_parallel_size": 8, "enable_attention_dp": True},
     {"tensor_parallel_size": 1, "data_parallel_size": 8}),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 0.9}}, {"gpu_memory_utilization": 0.9}),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1}}, {"gpu_memory_utilization": 1.0}),
    ({"kv_cache_config": {"dtype": "fp8"}}, {"kv_cache_dtype": "fp8"}),
    ({"kv_cache_config": {"dtype": "FP8"}}, {"kv_cache_dtype": "fp8"}),
    ({"kv_cache_config": {"dtype": "auto"}}, {"kv_cache_dtype": "auto"}),
    ({"kv_cache_config": {"dtype": "bfloat16"}}, {"kv_cache_dtype": "bfloat16"}),
    ({"kv_cache_config": {"dtype": "nvfp4"}}, {"kv_cache_dtype": "nvfp4"}),
    ({"kv_cache_config": {"dtype": "fp8_ds_mla"}}, {"kv_cache_dtype": "fp8_ds_mla"}),
    ({"kv_cache_config": {"enable_block_reuse": True}}, {"enable_prefix_caching": True}),
    ({"kv_cache_config": {"enable_block_reuse": False}}, {"enable_prefix_caching": False}),
    ({"kv_cache_config": {"tokens_per_block": 64}}, {"block_size": 64}),
    ({"kv_cache_config": {"max_gpu_total_bytes": 1 << 30}}, {"kv_cache_memory_bytes": 1 << 30}),
    ({"kv_cache_config": {"mamba_ssm_cache_dtype": "float32", "mamba_ssm_stochastic_rounding": True,
                          "mamba_ssm_philox_rounds": 7}},
     {"mamba_ssm_cache_dtype": "float32", "enable_mamba_cache_stochastic_rounding": True,
      "mamba_cache_philox_rounds": 7}),
    ({"disable_overlap_scheduler": True}, {"async_scheduling": False}),
    ({"enable_overlap_scheduler": False}, {"async_scheduling": False}),
    ({"cuda_graph_config": None}, {"enforce_eager": True}),
    ({"use_cuda_graph": False}, {"enforce_eager": True}),
    ({"cuda_graph_config": {"batch_sizes": [4, 1, 2, 2]}}, {"cudagraph_capture_sizes": [1, 2, 4]}),
    ({"cuda_graph_config": {"max_batch_size": 64}}, {"max_cudagraph_capture_size": 64}),
    ({"cuda_graph_batch_sizes": [1, 8], "cuda_graph_max_batch_size": 8}, {"cudagraph_capture_sizes": [1, 8]}),
    ({"enable_chunked_prefill": True}, {"enable_chunked_prefill": True}),
    ({"load_format": "dummy"}, {"load_format": "dummy"}),
    ({"load_format": "AUTO"}, {"load_format": "auto"}),
    ({"load_format": 1}, {"load_format": "dummy"}),
    ({"enable_lora": True, "lora_config": {"max_lora_rank": 64, "max_loras": 4, "max_cpu_loras": 8}},
     {"enable_lora": True, "max_lora_rank": 64, "max_loras": 4, "max_cpu_loras": 8}),
    ({"lora_config": {"lora_dir": ["/a"]}}, {"enable_lora": True}),
    ({"scheduler_config": {"waiting_queue_policy": "priority"}}, {"scheduling_policy": "priority"}),
    ({"reasoning_parser": "deepseek-r1"}, {"reasoning_parser": "deepseek_r1"}),
    ({"reasoning_parser": "qwen3"}, {"reasoning_parser": "qwen3"}),
    ({"otlp_traces_endpoint": "http://otel:4317"}, {"otlp_traces_endpoint": "http://otel:4317"}),
    ({"orchestrator_type": "ray"}, {"distributed_executor_backend": "ray"}),
    ({"model_kwargs": {"num_hidden_layers": 2}}, {"hf_overrides": {"num_hidden_layers": 2}}),
    ({"generation_config": "auto"}, {"generation_config": "auto"}),
    ({"generation_config": "trtllm"}, {"generation_config": "vllm"}),
    ({"multimodal_config": {"video_pruning_rate": 0.5}}, {"video_pruning_rate": 0.5}),
    ({"attn_backend": "FLASHINFER"}, {"attention_backend": "FLASHINFER"}),
    ({"enable_layerwise_nvtx_marker": True}, {"enable_layerwise_nvtx_tracing": True}),
    ({"stream_interval": 4}, {"stream_interval": 4}),
    ({"allreduce_strategy": "NCCL"}, {"disable_custom_all_reduce": True}),
    ({"mm_encoder_only": True}, {"mm_encoder_only": True}),
    ({"disable_mm_encoder": True}, {"language_model_only": True}),
    ({"sleep_config": {"restore_modes": {"kv_cache": "NONE"}}}, {"enable_sleep_mode": True}),
]


@pytest.mark.parametrize("doc, expected", MAPPINGS, ids=[",".join(d) for d, _ in MAPPINGS])
def test_mapping(doc, expected):
    r = convert_trtllm_config(doc)
    assert r.engine_args == expected
    assert r.unknown == []
    for m in r.mapped:  # every mapping names its source key
        top = m.path.split(".")[0].split("[")[0]
        assert top in doc or top == "enable_attention_dp" or top == "tensor_parallel_size", m


def test_pp_partition_becomes_an_environment_variable():
    r = convert_trtllm_config({"pipeline_parallel_size": 2, "pp_partition": [30, 31]})
    assert r.env == {"VLLM_PP_LAYER_PARTITION": "30,31"}
    assert "env: VLLM_PP_LAYER_PARTITION=30,31" in r.notes()


def test_expert_parallel_size_differs_from_vllm_world():
    r = convert_trtllm_config({"tensor_parallel_size": 8, "moe_expert_parallel_size": 4})
    assert r.engine_args["enable_expert_parallel"] is True
    assert any("tensor x data parallel = 8" in w for w in r.warnings)
    r = convert_trtllm_config({"moe_expert_parallel_size": -1})
    assert r.engine_args == {} and "moe_expert_parallel_size" in paths(r.ignored)


def test_cuda_graph_sizes_follow_the_dynamic_schedule():
    r = convert_trtllm_config({
        "max_batch_size": 64,
        "speculative_config": {"decoding_type": "MTP", "max_draft_len": 3, "draft_len_schedule": {4: 3, 16: 1}},
        "cuda_graph_config": {"batch_sizes": [1, 4, 8, 16, 32, 64]},
    })
    # K = 3 up to 4 requests, 1 up to 16, 0 above: tokens per step = b * (1 + K).
    assert r.engine_args["cudagraph_capture_sizes"] == [4, 16, 32, 64]
    assert r.schedule is not None and r.schedule.to_list() == [[1, 4, 3], [5, 16, 1], [17, 64, 0]]
    assert r.speculative_config["num_speculative_tokens_per_batch_size"] == r.schedule.to_list()
    r = convert_trtllm_config({
        "max_num_tokens": 100,
        "speculative_config": {"decoding_type": "MTP", "max_draft_len": 3},
        "cuda_graph_config": {"batch_sizes": [16, 32]},
    })
    assert any("dropped by vLLM" in w for w in r.warnings)


def test_cuda_graph_max_batch_size_is_converted_without_trying_every_batch_size():
    # The largest tokens per step over batch sizes 1..max_batch_size, with and without a schedule:
    # found from the schedule's rows, so a huge max_batch_size converts at once.
    spec = {"decoding_type": "MTP", "max_draft_len": 3, "draft_len_schedule": {4: 3, 16: 1}}
    for mbs, expected in [(3, 12), (4, 16), (10, 20), (16, 32), (17, 32), (40, 40), (10**12, 10**12)]:
        r = convert_trtllm_config({"max_batch_size": 64, "speculative_config": spec,
                                   "cuda_graph_config": {"max_batch_size": mbs}})
        assert r.engine_args["max_cudagraph_capture_size"] == expected, mbs
    r = convert_trtllm_config({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3},
                               "cuda_graph_config": {"max_batch_size": 10**12}})
    assert r.engine_args["max_cudagraph_capture_size"] == 4 * 10**12


def test_max_concurrency_becomes_a_schedule():
    r = convert_trtllm_config({"max_batch_size": 128, "speculative_config": {
        "decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model_dir": "org/eagle3", "max_concurrency": 32}})
    assert r.speculative_config["num_speculative_tokens_per_batch_size"] == [[1, 32, 4], [33, 128, 0]]


def test_dynamic_schedule_with_data_parallel_warns():
    r = convert_trtllm_config({"tensor_parallel_size": 2, "enable_attention_dp": True, "speculative_config": {
        "decoding_type": "MTP", "max_draft_len": 2, "max_concurrency": 8}})
    assert any("disables num_speculative_tokens_per_batch_size with data parallelism" in w for w in r.warnings)


# --------------------------------------------------------------------------- speculative decoding


def draft_dir(tmp_path: Path, name: str, config: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def eagle(model, **extra):
    return {"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 2, "speculative_model_dir": model, **extra}}


@pytest.mark.parametrize(
    "draft_config, name, extra, method",
    [
        ({"architectures": ["Eagle3LlamaForCausalLM"]}, "draft", {"eagle3_one_model": False}, "eagle3"),
        ({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32000}, "draft", {}, "eagle3"),
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "draft", {}, "eagle3"),
        ({"architectures": ["EagleLlamaForCausalLM"]}, "draft", {"eagle3_one_model": True}, "eagle"),
        ({"model_type": "eagle"}, "draft", {}, "eagle"),
        ({"speculators_model_type": "eagle3", "speculators_config": {}}, "draft", {}, "eagle3"),
        ({"architectures": ["LlamaForCausalLM"]}, "EAGLE3-llama", {"eagle3_one_model": False}, "eagle3"),
        ({"architectures": ["LlamaForCausalLM"]}, "EAGLE-llama", {}, "eagle"),
        ({"architectures": ["LlamaForCausalLM"]}, "draft", {"eagle3_one_model": True}, "eagle3"),
        ({"architectures": ["LlamaForCausalLM"]}, "draft", {"eagle3_one_model": False}, "eagle"),
        ({"architectures": ["LlamaForCausalLM"]}, "draft", {}, "eagle3"),
    ],
)
def test_eagle_or_eagle3_from_checkpoint_name_and_flag(tmp_path, draft_config, name, extra, method):
    model = draft_dir(tmp_path, name, draft_config)
    r = convert_trtllm_config(eagle(model, **extra))
    assert r.speculative_config == {"method": method, "model": model, "num_speculative_tokens": 2}


def test_eagle_names_without_a_local_checkpoint():
    for model, method in [("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
                          ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
                          ("nvidia/gpt-oss-120b-Eagle3", "eagle3"),
                          ("org/some-draft", "eagle3")]:
        assert convert_trtllm_config(eagle(model)).speculative_config["method"] == method
    r = convert_trtllm_config({"speculative_config": {
        "decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "org/draft"}})
    assert r.speculative_config["method"] == "eagle3" and not r.warnings
    r = convert_trtllm_config(eagle("org/some-draft"))
    assert any("nothing says whether" in w for w in r.warnings)


def test_eagle_checkpoint_overrides_a_conflicting_yaml(tmp_path):
    model = draft_dir(tmp_path, "d", {"architectures": ["EagleLlamaForCausalLM"]})
    r = convert_trtllm_config({"speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 2,
                                                      "speculative_model_dir": model}})
    assert r.speculative_config["method"] == "eagle"
    assert any("although the YAML says EAGLE-3" in w for w in r.warnings)


def test_eagle_ignored_tree_and_sampling_keys():
    r = convert_trtllm_config(eagle("org/eagle3", use_dynamic_tree=False, greedy_sampling=True,
                                    eagle3_layers_to_capture=[1, 2], max_total_draft_tokens=2,
                                    acceptance_rate_threshold=0.1, bogus=1))
    ign = {i.path: i for i in r.ignored}
    for k in ("use_dynamic_tree", "greedy_sampling", "eagle3_layers_to_capture", "max_total_draft_tokens",
              "acceptance_rate_threshold"):
        assert ign[f"speculative_config.{k}"].known
    assert not ign["speculative_config.bogus"].known


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"decoding_type": "MTP", "num_nextn_predict_layers": 3}, {"method": "mtp", "num_speculative_tokens": 3}),
        ({"decoding_type": "MTP", "max_draft_len": 2}, {"method": "mtp", "num_speculative_tokens": 2}),
        ({"decoding_type": "MTP", "max_draft_len": 2, "num_nextn_predict_layers": 1},
         {"method": "mtp", "num_speculative_tokens": 2}),
        ({"decoding_type": "MTP"}, {"method": "mtp", "num_speculative_tokens": 1}),
        ({"decoding_type": "MTP", "max_draft_len": 1, "speculative_model_dir": "org/mtp-heads"},
         {"method": "mtp", "model": "org/mtp-heads", "num_speculative_tokens": 1}),
        ({"decoding_type": "NGram", "max_draft_len": 5},
         {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 1}),
        ({"decoding_type": "Draft_Target", "max_draft_len": 4, "speculative_model_dir": "org/small"},
         {"method": "draft_model", "model": "org/small", "num_speculative_tokens": 4}),
        ({"decoding_type": "PARD", "max_draft_len": 4, "speculative_model": "org/pard"},
         {"method": "draft_model", "model": "org/pard", "num_speculative_tokens": 4, "parallel_drafting": True}),
        ({"decoding_type": "DFlash", "max_draft_len": 8, "speculative_model": "org/dflash", "mask_token_id": 5},
         {"method": "dflash", "model": "org/dflash", "num_speculative_tokens": 8}),
        ({"decoding_type": "DSpark", "max_draft_len": 7}, {"method": "dspark", "num_speculative_tokens": 7}),
        ({"decoding_type": "SA", "max_draft_len": 6}, {"method": "suffix", "num_speculative_tokens": 6}),
        ({"decoding_type": "AUTO", "max_draft_len": 3},
         {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}),
        ({"decoding_type": "mtp", "max_draft_len": 1}, {"method": "mtp", "num_speculative_tokens": 1}),
    ],
)
def test_other_decoding_types(spec, expected):
    r = convert_trtllm_config({"speculative_config": spec})
    assert r.speculative_config == expected
    assert r.unknown == []


def test_mtp_precedence_and_warnings():
    r = convert_trtllm_config({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2,
                                                      "num_nextn_predict_layers": 1}})
    assert any("max_draft_len=2 wins" in w for w in r.warnings)
    r = convert_trtllm_config({"speculative_config": {"decoding_type": "MTP"}})
    assert any("using 1" in w for w in r.warnings)
    r = convert_trtllm_config({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 1,
                                                      "use_relaxed_acceptance_for_thinking": True,
                                                      "relaxed_topk": 10, "relaxed_delta": 0.6}})
    assert {"speculative_config.use_relaxed_acceptance_for_thinking", "speculative_config.relaxed_topk",
            "speculative_config.relaxed_delta"} <= paths(r.ignored)


def test_speculative_config_null():
    r = convert_trtllm_config({"speculative_config": None})
    assert r.engine_args == {} and "speculative_config" in paths(r.ignored)


# --------------------------------------------------------------------------- ignored and unknown


def test_every_known_ignored_key_is_reported_with_its_reason():
    doc = {k: 1 for k in TOP_LEVEL_IGNORED}
    r = convert_trtllm_config(doc)
    assert r.engine_args == {}
    got = {i.path: i for i in r.ignored}
    for k, reason in TOP_LEVEL_IGNORED.items():
        assert got[k].known and got[k].reason == reason and reason
    doc = {"kv_cache_config": {k: 1 for k in KV_CACHE_IGNORED}}
    got = {i.path: i for i in convert_trtllm_config(doc).ignored}
    for k, reason in KV_CACHE_IGNORED.items():
        assert got[f"kv_cache_config.{k}"].reason == reason


def test_unknown_keys_are_reported_not_dropped():
    r = convert_trtllm_config({
        "max_batch_size": 4, "made_up": True,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.9, "typo_fraction": 0.1},
        "scheduler_config": {"nope": 1}, "lora_config": {"x": 1}, "moe_config": {"y": 2},
        "cuda_graph_config": {"z": 3}, "multimodal_config": {"w": 4},
    })
    assert {i.path for i in r.unknown} == {
        "made_up", "kv_cache_config.typo_fraction", "scheduler_config.nope", "lora_config.x",
        "moe_config.y", "cuda_graph_config.z", "multimodal_config.w"}
    assert all("not converted" in i.reason for i in r.unknown)
    assert "unknown: made_up = true (not a known TRT-LLM option; not converted)" in r.notes()


def test_null_and_empty_values_are_reported():
    r = convert_trtllm_config({"max_seq_len": None, "kv_cache_config": {"free_gpu_memory_fraction": None},
                               "cuda_graph_config": {}, "lora_config": None, "tokenizer": None})
    assert {"max_seq_len", "kv_cache_config.free_gpu_memory_fraction", "cuda_graph_config", "lora_config",
            "tokenizer"} <= paths(r.ignored)
    assert r.engine_args == {}


def test_value_dependent_ignores():
    r = convert_trtllm_config({"tokenizer_mode": "slow", "context_parallel_size": 2, "max_beam_width": 4,
                               "load_format": "vision_only", "attn_backend": "TRTLLM",
                               "allreduce_strategy": "ONESHOT", "orchestrator_type": "rpc",
                               "kv_cache_config": {"dtype": "float32", "max_gpu_total_bytes": 0,
                                                   "event_buffer_max_size": 0},
                               "cuda_graph_config": {"mode": "encode", "max_num_token": 1024},
                               "enable_attention_dp": True})
    assert r.engine_args == {}
    assert {"tokenizer_mode", "context_parallel_size", "max_beam_width", "load_format", "attn_backend",
            "allreduce_strategy", "orchestrator_type", "kv_cache_config.dtype",
            "kv_cache_config.max_gpu_total_bytes", "kv_cache_config.event_buffer_max_size",
            "cuda_graph_config", "enable_attention_dp"} == paths(r.ignored)
    assert r.unknown == []


# --------------------------------------------------------------------------- bad input

BAD = [
    ({"max_batch_size": "8"}, "max_batch_size", "must be an integer"),
    ({"max_batch_size": 0}, "max_batch_size", "must be >= 1"),
    ({"max_batch_size": True}, "max_batch_size", "must be an integer"),
    ({"max_num_tokens": 1.5}, "max_num_tokens", "must be an integer"),
    ({"max_seq_len": -1}, "max_seq_len", "must be >= 1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", "must be >= 1"),
    ({"pipeline_parallel_size": "2"}, "pipeline_parallel_size", "must be an integer"),
    ({"moe_expert_parallel_size": 0}, "moe_expert_parallel_size", "must be >= 1"),
    ({"trust_remote_code": "yes"}, "trust_remote_code", "must be true or false"),
    ({"enable_attention_dp": 1}, "enable_attention_dp", "must be true or false"),
    ({"dtype": "int8"}, "dtype", "must be one of"),
    ({"tokenizer_mode": "fast"}, "tokenizer_mode", "must be 'auto' or 'slow'"),
    ({"generation_config": "x"}, "generation_config", "must be 'auto' or 'trtllm'"),
    ({"kv_cache_config": []}, "kv_cache_config", "must be a mapping"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 0}}, "kv_cache_config.free_gpu_memory_fraction", "in (0, 1]"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.2}}, "kv_cache_config.free_gpu_memory_fraction", "in (0, 1]"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": -0.1}}, "kv_cache_config.free_gpu_memory_fraction", "in (0, 1]"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": "0.9"}}, "kv_cache_config.free_gpu_memory_fraction", "must be a number"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": True}}, "kv_cache_config.free_gpu_memory_fraction", "must be a number"),
    ({"kv_cache_config": {"dtype": "fp6"}}, "kv_cache_config.dtype", "must be one of"),
    ({"kv_cache_config": {"dtype": 8}}, "kv_cache_config.dtype", "non-empty string"),
    ({"kv_cache_config": {"enable_block_reuse": "true"}}, "kv_cache_config.enable_block_reuse", "true or false"),
    ({"kv_cache_config": {"tokens_per_block": 0}}, "kv_cache_config.tokens_per_block", ">= 1"),
    ({"kv_cache_config": {"max_gpu_total_bytes": -1}}, "kv_cache_config.max_gpu_total_bytes", ">= 0"),
    ({"kv_cache_config": {"host_cache_size": "1GB"}}, "kv_cache_config.host_cache_size", "must be an integer"),
    ({"kv_cache_config": {"mamba_ssm_cache_dtype": "fp8"}}, "kv_cache_config.mamba_ssm_cache_dtype", "must be auto"),
    ({"kv_cache_config": {1: 2}}, "kv_cache_config.1", "keys must be strings"),
    ({"cuda_graph_config": [1, 2]}, "cuda_graph_config", "must be a mapping"),
    ({"cuda_graph_config": {"batch_sizes": []}}, "cuda_graph_config.batch_sizes", "non-empty list"),
    ({"cuda_graph_config": {"batch_sizes": [1, 0]}}, "cuda_graph_config.batch_sizes[1]", ">= 1"),
    ({"cuda_graph_config": {"batch_sizes": "1,2"}}, "cuda_graph_config.batch_sizes", "non-empty list"),
    ({"cuda_graph_config": {"enable_padding": "yes"}}, "cuda_graph_config.enable_padding", "true or false"),
    ({"disable_overlap_scheduler": "false"}, "disable_overlap_scheduler", "true or false"),
    ({"scheduler_config": {"waiting_queue_policy": "lifo"}}, "scheduler_config.waiting_queue_policy", "fcfs"),
    ({"lora_config": {"max_lora_rank": 0}}, "lora_config.max_lora_rank", ">= 1"),
    ({"pp_partition": [10, "x"]}, "pp_partition[1]", "must be an integer"),
    ({"load_format": True}, "load_format", "must be 'auto' or 'dummy'"),
    ({"orchestrator_type": "slurm"}, "orchestrator_type", "must be 'rpc' or 'ray'"),
    ({"multimodal_config": {"video_pruning_rate": 1.0}}, "multimodal_config.video_pruning_rate", "[0, 1)"),
    ({"model_kwargs": [1]}, "model_kwargs", "must be a mapping"),
    ({"pytorch_backend_config": 3}, "pytorch_backend_config", "must be a mapping"),
    # speculative_config
    ({"speculative_config": "Eagle"}, "speculative_config", "must be a mapping"),
    ({"speculative_config": {"max_draft_len": 3}}, "speculative_config.decoding_type", "is required"),
    ({"speculative_config": {"decoding_type": "Medusa", "max_draft_len": 3}}, "speculative_config.decoding_type",
     "unknown decoding type 'Medusa'"),
    ({"speculative_config": {"decoding_type": 3}}, "speculative_config.decoding_type", "must be a string"),
    ({"speculative_config": {"decoding_type": "User_Provided", "max_draft_len": 3}},
     "speculative_config.decoding_type", "no vLLM equivalent"),
    ({"speculative_config": {"decoding_type": "SaveState", "max_draft_len": 1}},
     "speculative_config.decoding_type", "no vLLM equivalent"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3}},
     "speculative_config.speculative_model_dir", "draft model is required for Eagle"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": ""}},
     "speculative_config.speculative_model_dir", "non-empty string"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": 5}},
     "speculative_config.speculative_model_dir", "non-empty string"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": -1, "speculative_model_dir": "d"}},
     "speculative_config.max_draft_len", "must be >= 0, got -1"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 0, "speculative_model_dir": "d"}},
     "speculative_config.max_draft_len", "must be > 0 for Eagle"),
    ({"speculative_config": {"decoding_type": "Eagle", "speculative_model_dir": "d"}},
     "speculative_config.max_draft_len", "is required for Eagle"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": "3", "speculative_model_dir": "d"}},
     "speculative_config.max_draft_len", "must be an integer"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "d",
                             "eagle3_one_model": "yes"}}, "speculative_config.eagle3_one_model", "true or false"),
    ({"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model": "a",
                             "speculative_model_dir": "b"}}, "speculative_config.speculative_model_dir", "conflicts"),
    ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 0}},
     "speculative_config.num_nextn_predict_layers", ">= 1"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": -2}}, "speculative_config.max_draft_len", ">= 0"),
    ({"speculative_config": {"decoding_type": "NGram"}}, "speculative_config.max_draft_len", "is required for NGram"),
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 2, "max_matching_ngram_size": 0}},
     "speculative_config.max_matching_ngram_size", ">= 1"),
    ({"speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 2}},
     "speculative_config.speculative_model_dir", "draft model is required for Draft_Target"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "max_concurrency": 4,
                             "draft_len_schedule": {4: 2}}}, "speculative_config.draft_len_schedule", "mutually exclusive"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "max_concurrency": 0}},
     "speculative_config.max_concurrency", ">= 1"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "draft_len_schedule": {4: 3}}},
     "speculative_config.draft_len_schedule.4", "exceeds max_draft_len"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3, "draft_len_schedule": {4: 2, 8: 1}}},
     "speculative_config.draft_len_schedule.4", "must map to max_draft_len"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "draft_len_schedule": {0: 2}}},
     "speculative_config.draft_len_schedule.0", ">= 1"),
    ({"speculative_config": {"decoding_type": "MTP", "max_draft_len": 2, "draft_len_schedule": [2]}},
     "speculative_config.draft_len_schedule", "non-empty mapping"),
]


@pytest.mark.parametrize("doc, field, fragment", BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
def test_bad_values_name_the_field(doc, field, fragment):
    with pytest.raises(ConfigError) as ei:
        convert_trtllm_config(doc)
    assert ei.value.field == field, str(ei.value)
    assert fragment in str(ei.value), str(ei.value)
    assert str(ei.value).startswith(f"{field}: ")
    assert isinstance(ei.value, ValueError)


def test_bad_documents(tmp_path):
    for text, fragment in [
        ("- max_batch_size: 8\n", "must be a mapping of TRT-LLM options, got list"),
        ("just a string\n", "got str"),
        ("42\n", "got int"),
        ("max_batch_size: [1, 2\n", "invalid YAML"),
        ("a: 1\n  b: 2\n", "invalid YAML"),
        ("max_batch_size: 8\nmax_batch_size: 16\n", "duplicate key 'max_batch_size' at line 2"),
        ("1: 2\n", "option names must be strings"),
    ]:
        f = tmp_path / "bad.yaml"
        f.write_text(text)
        with pytest.raises(ConfigError) as ei:
            convert_trtllm_config(f)
        assert fragment in str(ei.value), (text, str(ei.value))
        assert str(ei.value).startswith(str(f))
    with pytest.raises(ConfigError, match="line 2"):
        parse_trtllm_yaml("a: 1\nb: c: d\n")
    with pytest.raises(ConfigError, match="no such file"):
        convert_trtllm_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        convert_trtllm_config([1, 2])  # type: ignore[arg-type]


def test_empty_document():
    r = convert_trtllm_config(parse_trtllm_yaml("# nothing here\n"))
    assert r.engine_args == {} and any("empty" in w for w in r.warnings)


# --------------------------------------------------------------------------- output forms


def test_output_forms():
    r = convert_text(EAGLE3_ONE_MODEL, model="org/target")
    assert r.model == "org/target" and list(r.engine_args)[0] == "model"
    assert r.cli_args()[0] == "--max-num-seqs"
    assert r.cli_args(include_model=True)[:2] == ["org/target", "--max-num-seqs"]
    assert r.command()[:3] == ["vllm", "serve", "org/target"]
    assert json.loads(r.to_json()) == r.engine_args
    y = parse_trtllm_yaml(r.to_yaml())
    assert y["model"] == "org/target" and y["max-num-seqs"] == 8 and y["async-scheduling"] is False
    assert y["speculative-config"] == r.speculative_config
    rep = r.report()
    assert rep["engine_args"] == r.engine_args and rep["cli_args"] == r.cli_args()
    assert {i["path"] for i in rep["ignored"]} == paths(r.ignored)
    with pytest.raises(ValueError):
        convert_text(MTP_DEEPSEEK).command()


def write_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_convert_with_speculators_dir(tmp_path):
    v = write_dir(tmp_path / "verifier", TINY_LLAMA)
    d = write_dir(tmp_path / "spec", {"speculators_model_type": "eagle3", "transformer_layer_config": {},
                                      "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}],
                                                             "verifier": {"name_or_path": "../verifier"}}})
    doc = {
        "max_batch_size": 16,
        "speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "org/old-eagle",
                               "draft_len_schedule": {4: 3, 8: 1}},
    }
    r = convert_trtllm_config(doc, speculators_dir=d)
    assert r.model == str(v.resolve())
    assert r.speculative_config == {
        "method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1], [9, 16, 0]],
    }
    assert any("replaces speculative_config" in w for w in r.warnings)
    # An explicit model wins over the verifier.
    r = convert_trtllm_config({}, speculators_dir=d, model="org/target")
    assert r.model == "org/target"
    # A YAML schedule that needs a larger K than the checkpoint's is an error.
    doc["speculative_config"]["max_draft_len"] = 5
    doc["speculative_config"]["draft_len_schedule"] = {4: 5, 8: 1}
    with pytest.raises(ConfigError, match="does not fit the checkpoint's K=3"):
        convert_trtllm_config(doc, speculators_dir=d)


# --------------------------------------------------------------------------- the CLI


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_flags_json_yaml(tmp_path, capsys):
    f = tmp_path / "mtp.yaml"
    f.write_text(MTP_DEEPSEEK)
    code, out, err = run_cli(["convert-config", str(f)], capsys)
    assert code == 0
    assert out.startswith("--max-num-seqs 256 ")
    assert "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1}'" in out
    assert "ignored: backend = pytorch (" in err and "warning: kv_cache_config.free_gpu_memory_fraction" in err
    code, out, err = run_cli(["convert-config", str(f), "--format", "json", "--model", "deepseek-ai/DeepSeek-R1"], capsys)
    assert code == 0 and json.loads(out)["model"] == "deepseek-ai/DeepSeek-R1"
    code, out, _ = run_cli(["convert-config", str(f), "--format", "flags", "--model", "m"], capsys)
    assert out.startswith("m --max-num-seqs")
    code, out, err = run_cli(["convert-config", str(f), "--format", "yaml", "-q"], capsys)
    assert code == 0 and err == ""
    assert parse_trtllm_yaml(out)["data-parallel-size"] == 4
    dest = tmp_path / "out.yaml"
    code, out, _ = run_cli(["convert-config", str(f), "--format", "yaml", "-o", str(dest), "-q"], capsys)
    assert code == 0 and out == "" and parse_trtllm_yaml(dest.read_text())["max-num-seqs"] == 256


def test_cli_speculators_dir(tmp_path, capsys):
    v = tmp_path / "verifier"
    v.mkdir()
    (v / "config.json").write_text("{}")
    d = tmp_path / "spec"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}],
                               "verifier": {"name_or_path": "../verifier"}}}))
    f = tmp_path / "cfg.yaml"
    f.write_text("max_batch_size: 4\n")
    code, out, _ = run_cli(["convert-config", str(f), "--format", "json", "--speculators-dir", str(d)], capsys)
    assert code == 0
    a = json.loads(out)
    assert a["model"] == str(v.resolve())
    assert a["speculative_config"] == {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 4}
    code, _, err = run_cli(["convert-config", str(f), "--speculators-dir", str(tmp_path / "nope")], capsys)
    assert code == 2 and "error:" in err


@pytest.mark.parametrize(
    "text, field",
    [
        ("speculative_config:\n  decoding_type: Eagle\n  max_draft_len: -3\n  speculative_model_dir: /d\n",
         "speculative_config.max_draft_len"),
        ("kv_cache_config:\n  free_gpu_memory_fraction: 1.5\n", "kv_cache_config.free_gpu_memory_fraction"),
        ("speculative_config:\n  decoding_type: Lookahead\n  max_draft_len: 2\n", "speculative_config.decoding_type"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    code, out, err = run_cli(["convert-config", str(f)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvslots convert-config: error: ")
    assert f"{field}: " in err


def test_cli_unwritable_output_exits_2_with_one_line(tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_text("max_batch_size: 4\n")
    code, out, err = run_cli(["convert-config", str(f), "-q", "-o", str(tmp_path / "no" / "such" / "out")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvslots convert-config: error: ") and "cannot write" in err


def one_error_line(argv: list[str], capsys) -> str:
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "" and "Traceback" not in err, (code, out, err)
    assert err.count("\n") == 1 and err.startswith("kvslots convert-config: error: "), err
    return err


@pytest.mark.parametrize("ckpt, problem", [("~kvslots-no-such-user-x9/ck", "is not a directory"),
                                           ("d" * 300, "is not a directory"),
                                           ("/tmp/" + "d" * 300 + "/ck", "is not a directory")])
def test_cli_speculators_dir_the_system_cannot_look_up(tmp_path, capsys, ckpt, problem):
    f = tmp_path / "cfg.yaml"
    f.write_text("max_batch_size: 4\n")
    assert problem in one_error_line(["convert-config", str(f), "--speculators-dir", ckpt], capsys)


def test_cli_verifier_needs_a_speculators_dir(tmp_path, capsys):
    # The rule lives in convert_trtllm_config (kvslots serve --verifier comes here too).
    f = tmp_path / "cfg.yaml"
    f.write_text("max_batch_size: 4\n")
    err = one_error_line(["convert-config", str(f), "--verifier", "/does/not/exist"], capsys)
    assert "verifier: applies to a speculators checkpoint" in err
    with pytest.raises(ConfigError, match="applies to a speculators checkpoint") as ei:
        convert_trtllm_config({"max_batch_size": 4}, verifier="org/model")
    assert ei.value.field == "verifier"


@pytest.mark.parametrize("config", [{"architectures": 5}, {"speculators_config": {}, "speculators_model_type": ["eagle3"]},
                                    {"model_type": {"a": 1}, "architectures": [None, 3]}])
def test_draft_checkpoint_with_odd_types_is_no_evidence(tmp_path, capsys, config):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(config))
    doc = {"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": str(draft)}}
    r = convert_trtllm_config(doc)
    assert r.speculative_config["method"] == "eagle3"  # TRT-LLM's default, warned
    assert any("nothing says whether the draft is EAGLE or EAGLE-3" in w for w in r.warnings)
    f = tmp_path / "cfg.yaml"
    f.write_text(json.dumps(doc))
    code, out, err = run_cli(["convert-config", str(f), "-q"], capsys)
    assert code == 0 and "eagle3" in out and err == ""


@pytest.mark.parametrize("doc, field", [
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 3},
      "cuda_graph_config": {"batch_sizes": [2**63 - 1]}}, "cuda_graph_config.batch_sizes"),
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 3},
      "cuda_graph_config": {"max_batch_size": 2**62}}, "cuda_graph_config.max_batch_size"),
    ({"max_batch_size": 2**63 - 1, "speculative_config": {"decoding_type": "NGram", "max_draft_len": 3,
                                                          "max_concurrency": 2**63 - 1}},
     "speculative_config.max_concurrency"),
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 3,
                             "draft_len_schedule": {2**63 - 1: 3}}}, "speculative_config.draft_len_schedule"),
])
def test_no_argument_beyond_64_bits(tmp_path, capsys, doc, field):
    with pytest.raises(ConfigError) as ei:
        convert_trtllm_config(doc)
    assert ei.value.field.startswith(field), ei.value
    f = tmp_path / "big.yaml"
    f.write_text(yaml.safe_dump(doc))  # YAML keeps the integer keys
    assert f"{ei.value.field}: {ei.value.reason}" in one_error_line(["convert-config", str(f)], capsys)
    # At the edge it still converts: 2**63-2 requests speculate, the K = 0 row is the last one.
    r = convert_trtllm_config({"max_batch_size": 2**63 - 1, "speculative_config": {
        "decoding_type": "NGram", "max_draft_len": 3, "max_concurrency": 2**63 - 2}})
    assert r.schedule.to_list() == [[1, 2**63 - 2, 3], [2**63 - 1, 2**63 - 1, 0]]


def test_api_misuse_raises_config_errors():
    from kvslots.config.trtllm import check_with_vllm
    from kvslots.errors import KVSlotsError

    r = convert_trtllm_config({"max_batch_size": 4})
    with pytest.raises(ConfigError, match="no model") as ei:
        r.command()
    assert ei.value.field == "model" and isinstance(ei.value, (KVSlotsError, ValueError))
    with pytest.raises(ConfigError, match="needs a model"):  # before vLLM is imported
        check_with_vllm(r, build=True)


def test_cli_subprocess_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(bad)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == f"kvslots convert-config: error: {bad}: the document must be a mapping of TRT-LLM options, got list"
    good = tmp_path / "good.yaml"
    good.write_text("max_batch_size: 4\nprint_iter_log: true\n")
    p = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(good)],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0 and p.stdout == "--max-num-seqs 4\n"
    assert "ignored: print_iter_log" in p.stderr


# --------------------------------------------------------------------------- against vLLM

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
TINY_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 1000,
    "draft_vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 1000,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000,
}


@pytest.fixture(scope="module")
def vllm():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not importable in this environment; the checks against vLLM's EngineArgs and SpeculativeConfig need it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm as v
        from vllm.engine.arg_utils import EngineArgs  # noqa: F401 - the slow import, once
    except ImportError as e:
        pytest.skip(f"vLLM is not importable ({e}); the checks against vLLM's EngineArgs and SpeculativeConfig need it")
    return v


@pytest.mark.parametrize("text", [EAGLE3_ONE_MODEL, MTP_DEEPSEEK, WIDE_EP_DECODE, GPT_OSS_DECODE, LEGACY_PYTORCH_BACKEND],
                         ids=["eagle3", "mtp", "wide_ep", "gpt_oss", "legacy"])
def test_vllm_parses_the_samples(vllm, text):
    from kvslots.config.trtllm import check_with_vllm

    check_with_vllm(convert_text(text))


def test_vllm_parses_every_mapping(vllm):
    from kvslots.config.trtllm import check_with_vllm

    for doc, _ in MAPPINGS:
        check_with_vllm(convert_trtllm_config(doc))


def test_vllm_reads_our_yaml_config(vllm, tmp_path):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    target = draft_dir(tmp_path, "target", TINY_LLAMA)
    r = convert_text(EAGLE3_ONE_MODEL, model=target)
    f = tmp_path / "vllm.yaml"
    f.write_text(r.to_yaml())  # carries the model too
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ea = EngineArgs.from_cli_args(parser.parse_args(["--config", str(f)]))
    for key, value in r.engine_args.items():
        assert getattr(ea, key) == value, key


def test_vllm_builds_eagle3_with_dynamic_schedule(vllm, tmp_path):
    from kvslots.config.trtllm import check_with_vllm

    target = draft_dir(tmp_path, "target", TINY_LLAMA)
    draft = draft_dir(tmp_path, "draft", TINY_EAGLE3)
    r = convert_trtllm_config({
        "max_batch_size": 8, "max_num_tokens": 512, "max_seq_len": 256,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": True, "tokens_per_block": 16},
        "speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": draft,
                               "draft_len_schedule": {2: 3, 4: 1}},
    }, model=target)
    assert r.speculative_config["method"] == "eagle3"
    cfg = check_with_vllm(r, build=True)
    sc = cfg.speculative_config
    assert sc.method == "eagle3" and sc.num_speculative_tokens == 3 and sc.model == draft
    assert [list(x) for x in sc.num_speculative_tokens_per_batch_size] == [[1, 2, 3], [3, 4, 1], [5, 8, 0]]
    assert cfg.scheduler_config.max_num_seqs == 8
    assert cfg.cache_config.enable_prefix_caching is True and cfg.cache_config.block_size == 16
    assert cfg.model_config.max_model_len == 256


def test_vllm_builds_mtp_for_deepseek(vllm, tmp_path):
    from kvslots.config.trtllm import check_with_vllm

    target = draft_dir(tmp_path, "dsv3", TINY_DEEPSEEK_V3)
    r = convert_trtllm_config({"max_batch_size": 8, "max_num_tokens": 512, "max_seq_len": 256,
                               "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1}},
                              model=target)
    cfg = check_with_vllm(r, build=True)
    sc = cfg.speculative_config
    assert sc.method == "mtp" and sc.num_speculative_tokens == 1
    assert sc.draft_model_config.hf_config.model_type == "deepseek_mtp"


def test_vllm_rejects_what_we_reject_and_lookup_agrees(vllm):
    """Our schedule lookup equals vLLM's dense lookup on every schedule kvslots accepts."""
    import random

    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from kvslots.config.schedule import DynamicSDSchedule

    rng = random.Random(0)
    for _ in range(200):
        nst = rng.randint(1, 6)
        rows, start = [], 1
        for _ in range(rng.randint(1, 5)):
            end = start + rng.randint(0, 12)
            rows.append([start, end, rng.randint(0, nst)])
            start = end + 1
        max_bs = rng.randint(1, 80)
        ours = DynamicSDSchedule.parse(rows, nst).dense(max_bs)
        theirs = build_dynamic_sd_schedule_lookup(rows, vllm_max_batch_size=max_bs, vllm_num_speculative_tokens=nst)
        assert ours == theirs, (rows, nst, max_bs)


def test_cli_check_flag(vllm, tmp_path, capsys):
    f = tmp_path / "mtp.yaml"
    f.write_text(textwrap.dedent(MTP_DEEPSEEK))
    code, _, err = run_cli(["convert-config", str(f), "--check", "--model", "org/target"], capsys)
    assert code == 0 and "checked: vLLM accepts the arguments" in err


def test_a_home_relative_model_is_given_to_vllm_expanded(tmp_path, monkeypatch, capsys):
    # kvslots found ~/target and ~/draft as local directories (~ expanded) but passed them on as
    # written: vLLM and Hugging Face do not expand ~ ("~/target" is refused as a Hub id).
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    draft = "speculative_config:\n  decoding_type: Eagle3\n  speculative_model_dir: ~/draft\n  max_draft_len: 3\n"
    f = tmp_path / "e.yaml"
    f.write_text("model: ~/target\n" + draft)
    code, out, err = run_cli(["convert-config", str(f), "--format", "json"], capsys)
    assert code == 0, err
    args = json.loads(out)
    assert args["model"] == str(tmp_path / "target")
    assert args["speculative_config"]["model"] == str(tmp_path / "draft")
    code, out, err = run_cli(["convert-config", str(f), "--format", "json", "--model", "~/target"], capsys)
    assert code == 0 and json.loads(out)["model"] == str(tmp_path / "target"), err
    assert convert_text(draft).engine_args["speculative_config"]["model"] == str(tmp_path / "draft")
    # Not local: as written (a Hub id, and a ~ path that is not there is an error as before).
    assert convert_text("model: org/target\n").engine_args["model"] == "org/target"
    with pytest.raises(ConfigError, match="does not exist"):
        convert_text("model: ~/nothing-here\n")
