"""One phase of the disk-tier engine test (tests/test_disk_engine.py), in its own process.

    python disk_engine_run.py '{"models": DIR, "disk": DIR, "phase": "fill" | "restart" | "corrupt"}'

fill: four long prompts overflow a small host tier (its evictions spill to disk), the device
prefix cache is reset, the first two prompts are repeated (served from disk). restart: a fresh
engine on the same disk directory repeats them (the index is rebuilt from the file). corrupt: one
disk record of the second prompt is damaged before it is loaded. Prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BS = 32


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(spec["models"])
    from vllm import LLM, SamplingParams

    warnings = Count()
    logging.getLogger("kvslots.vllm.connector.disk").addHandler(warnings)
    llm = LLM(model=models["target"], dtype="float32", block_size=BS, max_model_len=2048, max_num_seqs=4,
              enable_prefix_caching=True, seed=0, enforce_eager=True, distributed_executor_backend="uni",
              disable_log_stats=False,
              speculative_config={"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3},
              kv_transfer_config={"kv_connector": "KVSlotsConnector", "kv_role": "kv_both",
                                  "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"host_cache_blocks": 16, "disk_path": spec["disk"],
                                                                "disk_blocks": 256}})
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    disk = conn._disk_sched
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(400)] for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gen = lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                                           use_tqdm=False)]
    result: dict = {"restored": disk.index.num_stored}

    def pump() -> None:  # a few engine steps, so the writer's reports reach the scheduler
        for _ in range(3):
            time.sleep(0.3)
            gen([[7, 8, 9]])

    if spec["phase"] == "fill":
        result["first"] = [gen([p])[0] for p in prompts]  # one at a time: 48 blocks through 16 host blocks
        pump()
        result["stored_after_fill"] = disk.index.num_stored
    done: list[int] = []
    if spec["phase"] == "corrupt":
        from kvslots.vllm.connector.disk import external

        lookup = disk.lookup

        def spy(request, n, host):  # damages the first disk block of the second prompt once
            got = lookup(request, n, host)
            if got and not done and list(request.prompt_token_ids) == prompts[1]:
                k = n // BS + host // BS
                slot = disk.index.lookup(external(request.block_hashes[k]))
                stride = (os.path.getsize(disk.path) - 4096) // disk.index.num_slots
                with open(disk.path, "r+b") as f:
                    header = (64 + 4 * BS + 63) // 64 * 64  # a record's header (disk/file.rs)
                    f.seek(4096 + slot * stride + header + 1000)  # a byte of the block's data
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0x5A]))
                done.append(slot)
            return got

        disk.lookup = spy
    before = disk.stats["hit_tokens"]
    assert llm.reset_prefix_cache()
    result["again"] = [gen([p])[0] for p in prompts[:2]]
    result["disk_hit_tokens"] = disk.stats["hit_tokens"] - before
    result["host_hit_tokens"] = conn._sched.stats["hit_tokens"]
    result["disk_stats"] = disk.metrics()
    result["warnings"] = [m for m in warnings.messages if "not loaded" in m]
    result["corrupted"] = len(done) if spec["phase"] == "corrupt" else None
    result["by_source"] = {str(getattr(m, "labels", {})): getattr(m, "value", None) for m in llm.get_metrics()
                           if "cached_by_source" in m.name}
    result["tier_metrics"] = {f"{m.name}{sorted(getattr(m, 'labels', {}).items())}": getattr(m, "value", None)
                              for m in llm.get_metrics() if "kvslots_tier" in m.name}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
