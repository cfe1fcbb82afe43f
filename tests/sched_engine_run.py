"""Real vLLM engines on CPU (in-process engine core) with the tiny local models, one after the
other in this process, for test_scheduler_mode_engine.py.

    python sched_engine_run.py '{"models": "/tmp/tiny", "runs": [{"method": "eagle", "kvslots": true}, ...]}'

Each run serves the same greedy workload: a batch with shared prefixes, then the long prompt
again (device prefix-cache hits), then, after the device prefix cache is reset, once more (from
the host tier when the connector is on). It prints one JSON line: per run the outputs, vLLM's
speculative-decoding and prefix-cache counters, the connector's stats and which KV cache manager
served it.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def one(models: dict, run: dict, prompt_len: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    method = run.get("method")
    kw = dict(model=models["target"], dtype="float32", block_size=32, max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=512,
              enable_prefix_caching=True, seed=0, enforce_eager=True, distributed_executor_backend="uni",
              disable_log_stats=False)
    if method:
        spec = {"method": method, "num_speculative_tokens": run.get("k", 3)}
        if method == "ngram":
            spec.update(prompt_lookup_max=4, prompt_lookup_min=1)
        else:
            spec["model"] = models["target"] if method == "draft_model" else models[method]
        if run.get("dynamic_sd"):
            spec["num_speculative_tokens_per_batch_size"] = run["dynamic_sd"]
        kw["speculative_config"] = spec
    if run.get("connector"):
        kw["kv_transfer_config"] = {"kv_connector": "KVSlotsConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvslots.vllm",
                                    "kv_connector_extra_config": {"host_cache_gb": 0.05}}
    if run.get("kvslots"):
        kw["scheduler_cls"] = "kvslots.vllm.KVSlotsScheduler"
    llm = LLM(**kw)
    rng = random.Random(0)
    # Repetitive text so that n-gram drafting has something to find.
    motif = [rng.randrange(3, 2000) for _ in range(7)]
    long = [rng.randrange(3, 2000) if rng.random() < 0.6 else motif[i % 7] for i in range(prompt_len)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [long, long[: prompt_len // 2] + [5, 6, 7], [rng.randrange(3, 2000) for _ in range(70)],
             long[: prompt_len // 3] + motif * 3]
    first = llm.generate([{"prompt_token_ids": p} for p in batch], sp)
    again = llm.generate([{"prompt_token_ids": long}], sp)  # device prefix-cache hit
    assert llm.reset_prefix_cache(), "device prefix cache reset"
    third = llm.generate([{"prompt_token_ids": long}], sp)
    outputs = [list(o.outputs[0].token_ids) for o in first + again + third]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache", "vllm:num_preemptions"))}
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    result = {"outputs": outputs, "metrics": metrics, "manager": type(sched.kv_cache_manager).__name__,
              "scheduler": type(sched).__name__,
              "cached_tokens": [o.num_cached_tokens for o in first + again + third]}
    if sched.connector is not None:
        result["connector"] = dict(sched.connector._sched.stats)
    if run.get("kvslots"):
        m = sched.kv_cache_manager
        assert m.check_invariants() is None, m.check_invariants()
        result["pool_whole"] = m.num_held_blocks() == 1
    del llm, core, sched
    gc.collect()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(spec["models"])
    results = [one(models, r, spec.get("prompt_len", 400), spec.get("max_tokens", 16)) for r in spec["runs"]]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
