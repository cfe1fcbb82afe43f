"""Top-level TRT-LLM keys with a direct vLLM engine argument (model, tokenizer, limits, LoRA,
scheduler, MoE and attention backends, ...)."""

from __future__ import annotations

from typing import Any

from .base import ConverterBase, describe
from .keys import MODEL_DTYPES, REASON_DEFAULT, REASON_KERNEL


class EngineKeys(ConverterBase):
    """Handlers ``k_<key>`` of the top-level keys that map one-to-one (or are ignored by value)."""

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

    def k_load_format(self, v: Any, p: str) -> None:
        if isinstance(v, bool):
            raise self.fail(p, f"must be 'auto' or 'dummy', got {describe(v)}")
        if isinstance(v, int):
            v = {0: "auto", 1: "dummy"}.get(v, v)
        if isinstance(v, str) and v.lower() in ("auto", "dummy"):
            self.map(p, "load_format", v.lower())
        elif isinstance(v, (str, int)):
            self.ignore(p, v, "TRT-LLM load format with no vLLM equivalent (vLLM: --load-format)")
        else:
            raise self.fail(p, f"must be a string, got {describe(v)}")

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

    def k_max_batch_size(self, v: Any, p: str) -> None:
        self.map(p, "max_num_seqs", self.int_(v, p, 1))

    def k_max_seq_len(self, v: Any, p: str) -> None:
        if v is not None:
            self.map(p, "max_model_len", self.int_(v, p, 1))

    def k_max_num_tokens(self, v: Any, p: str) -> None:
        self.map(p, "max_num_batched_tokens", self.int_(v, p, 1))

    def k_max_beam_width(self, v: Any, p: str) -> None:
        n = self.int_(v, p, 1)
        self.ignore(p, v, REASON_DEFAULT if n == 1 else "vLLM runs beam search per request (use_beam_search), with no engine-wide width")

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
            raise self.fail(p, f"must be 'rpc' or 'ray', got {describe(v)}")

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
                    raise self.fail(sub, f"must be a number in [0, 1), got {describe(value)}")
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
                    self.ignore(sub, value, REASON_DEFAULT)
                else:
                    hint = f" (closest vLLM choice: --moe-backend {names[b]})" if b in names else ""
                    self.ignore(sub, value, "vLLM picks its MoE kernels for the quantization in use" + hint)
            elif key == "load_balancer":
                self.ignore(sub, value, "TRT-LLM MoE load balancer; vLLM's equivalent is --enable-eplb with --eplb-config (redundant experts)")
            elif key in ("max_num_tokens", "disable_finalize_fusion", "use_low_precision_moe_combine"):
                self.ignore(sub, value, REASON_KERNEL)
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
            self.ignore(p, v, REASON_DEFAULT)
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


__all__ = ["EngineKeys"]
