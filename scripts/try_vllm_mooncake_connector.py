"""Starts vLLM (in-process engine, tiny model) with vLLM's own MooncakeConnector, to see whether
it runs on this vLLM build without patching vLLM (docs/pd.md, "What is not done").

    PYTHONPATH=python python scripts/try_vllm_mooncake_connector.py [kv_producer|kv_consumer]

Prints ``STARTED`` and exits 0 when the engine came up; otherwise vLLM's error ends the output.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM

    from kvslots._dev.tiny import build_tiny_models

    role = sys.argv[1] if len(sys.argv) > 1 else "kv_producer"
    models = build_tiny_models(tempfile.mkdtemp(prefix="kvslots-mooncake-try-"))
    LLM(model=models["target"], dtype="float32", block_size=32, max_model_len=1024, enforce_eager=True,
        distributed_executor_backend="uni",
        kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": role,
                            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
    print("STARTED", flush=True)


if __name__ == "__main__":
    main()
