"""``kv_cache_config`` (and the legacy ``kv_cache_dtype``): KV cache sizing, dtype, prefix reuse,
block size, and the host tier and KV events kvslots provides."""

from __future__ import annotations

from typing import Any

from .base import ConverterBase
from .keys import KV_CACHE_DTYPES, KV_CACHE_IGNORED


class KvCacheKeys(ConverterBase):
    """KV cache keys."""

    def k_kv_cache_dtype(self, v: Any, p: str) -> None:  # legacy pytorch_backend_config key
        self._kv_dtype(v, p)

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


__all__ = ["KvCacheKeys"]
