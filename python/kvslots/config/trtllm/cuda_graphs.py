"""CUDA graphs: TRT-LLM captures by batch size, vLLM by tokens per step, so the sizes become
``batch size x (1 + K)`` once the speculative config is known; disabled graphs become
``enforce_eager``."""

from __future__ import annotations

from typing import Any

from ..loader import INT_MAX
from .base import ConverterBase
from .keys import ENCODER_GRAPH_KEYS, MAX_BATCH_KEYS, PADDING_KEYS, REASON_DEFAULT


class CudaGraphKeys(ConverterBase):
    """``cuda_graph_config`` and the legacy flat keys; :meth:`post_graphs` runs after the
    speculative config is converted (it needs K)."""

    def k_cuda_graph_config(self, v: Any, p: str) -> None:
        self.graphs_path = p
        if v is None:
            self.graphs = {"disabled": True}
            return
        cfg = self.mapping(v, p, allow_none=False)
        g: dict[str, Any] = {}
        if not cfg:
            self.ignore(p, v, "TRT-LLM's default CUDA graphs; vLLM captures CUDA graphs by default")
        if str(cfg.get("mode", "decode")) == "encode" or any(cfg.get(k) not in (None, 0) for k in ENCODER_GRAPH_KEYS):
            self.ignore(p, v, "encoder CUDA graphs; vLLM's CUDA graph settings are not per encoder")
            return
        for key, value in cfg.items():
            sub = f"{p}.{key}"
            if key in MAX_BATCH_KEYS:
                if value is not None:
                    g["batch_sizes"] = sorted(set(self.int_list(value, sub, 1)))
                    g["batch_sizes_path"] = sub
            elif key in ("max_batch_size", "cuda_graph_max_batch_size"):
                n = self.int_(value, sub, 0)
                if n > 0:
                    g["max_batch_size"] = n
                    g["max_batch_size_path"] = sub
            elif key in PADDING_KEYS:
                self.bool_(value, sub)
                self.ignore(sub, value, "vLLM always pads a batch up to the next captured size")
            elif key == "mode":
                self.ignore(sub, value, "decode graphs, which is what vLLM captures")
            elif key in ENCODER_GRAPH_KEYS:
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
            self.ignore(p, v, REASON_DEFAULT)
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

    def post_graphs(self) -> None:
        g = self.graphs
        if g is None:
            return
        if g.get("disabled"):
            self.map(self.graphs_path, "enforce_eager", True)
            return
        spec = self.args.get("speculative_config")
        k = spec["num_speculative_tokens"] if spec else 0

        def tokens(b: int, path: str) -> int:
            kb = self.schedule.k_for_batch_size(b) if self.schedule else k
            n = b * (1 + kb)
            if n > INT_MAX:  # vLLM's integers are 64-bit
                raise self.fail(path, f"batch size {b} x (1 + K={kb}) = {n} tokens per step is beyond 64 bits")
            return n

        if "batch_sizes" in g:
            sizes = sorted({tokens(b, g["batch_sizes_path"]) for b in g["batch_sizes"]})
            self.map(g["batch_sizes_path"], "cudagraph_capture_sizes", sizes)
            limit = self.args.get("max_num_batched_tokens")
            if limit is not None and sizes[-1] > limit:
                self.warnings.append(f"cudagraph_capture_sizes above max_num_batched_tokens={limit} are dropped by vLLM")
            if "max_batch_size" in g:
                self.ignore(g["max_batch_size_path"], g["max_batch_size"], "implied by the batch sizes")
        elif "max_batch_size" in g:
            mbs = g["max_batch_size"]
            # K is constant within a schedule row, so b * (1 + K) peaks at a row's last batch
            # size or at mbs: no need to try every batch size up to mbs.
            peaks = {min(end, mbs) for start, end, _ in self.schedule.rows if start <= mbs} if self.schedule else set()
            size = max(tokens(b, g["max_batch_size_path"]) for b in peaks | {mbs})
            self.map(g["max_batch_size_path"], "max_cudagraph_capture_size", size)
        else:
            return
        if k:
            self.warnings.append(
                "CUDA graph batch sizes became token counts: vLLM captures graphs by tokens per step, and a "
                f"decode request runs 1 + K tokens (K={'the scheduled K' if self.schedule else k})"
            )


__all__ = ["CudaGraphKeys"]
