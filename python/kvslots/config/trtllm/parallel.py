"""Parallelism: tensor, pipeline, context and expert parallel sizes, attention data parallelism
(TRT-LLM's attention DP becomes vLLM's data parallelism) and the pipeline layer partition."""

from __future__ import annotations

from typing import Any

from ..vllm_args import MAX_PARALLEL_SIZE
from .base import ConverterBase
from .keys import REASON_DEFAULT


class ParallelKeys(ConverterBase):
    """Parallelism keys; sizes are combined once every key is read (:meth:`post_parallel`)."""

    def k_tensor_parallel_size(self, v: Any, p: str) -> None:
        # Bounded as the same sizes after -- in kvslots serve are (it may become data_parallel_size).
        self.tp = self.int_(v, p, 1, MAX_PARALLEL_SIZE)

    def k_pipeline_parallel_size(self, v: Any, p: str) -> None:
        self.map(p, "pipeline_parallel_size", self.int_(v, p, 1, MAX_PARALLEL_SIZE))

    def k_context_parallel_size(self, v: Any, p: str) -> None:
        n = self.int_(v, p, 1)
        if n == 1:
            self.ignore(p, v, REASON_DEFAULT)
        else:
            self.ignore(p, v, "TRT-LLM context parallelism (Helix/Ulysses) has no direct vLLM equivalent "
                              "(vLLM has --prefill-context-parallel-size / --decode-context-parallel-size)")
            self.warnings.append(f"{p}={n} is not converted; the vLLM deployment needs its own parallel layout")

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
            self.ignore("enable_attention_dp", False, REASON_DEFAULT)
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


__all__ = ["ParallelKeys"]
