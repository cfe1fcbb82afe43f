"""One real vLLM engine run on CPU (in-process engine core), for test_vllm_engine.py.

    python engine_run.py '{"models": "/tmp/tiny", "method": "eagle", "connector": true}'

Runs a greedy workload with shared prefixes, resets the device prefix cache, repeats the long
prompt (served from the host tier when the connector is on), and prints one JSON line with the
outputs, vLLM's speculative-decoding counters, the connector's stats and the host-tier events
received on its ZMQ publisher.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(spec["models"])
    import zmq
    from vllm import LLM, SamplingParams

    method = spec.get("method")
    kw = dict(model=models["target"], dtype="float32", block_size=32, max_model_len=4096, max_num_seqs=4,
              enable_prefix_caching=True, seed=0, enforce_eager=True, distributed_executor_backend="uni",
              disable_log_stats=False)
    if method:
        draft = models["target"] if method == "draft_model" else models[method]
        kw["speculative_config"] = {"method": method, "model": draft, "num_speculative_tokens": spec.get("k", 3)}
    sub = None
    if spec.get("connector"):
        import socket

        with socket.socket() as s:  # a free port for the connector's publisher to bind
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSlotsConnector",
            "kv_role": "kv_both",
            # No module path: the vllm.general_plugins entry point registers the name.
            "kv_connector_extra_config": {"host_cache_gb": 0.05,
                                          "events_endpoint": f"tcp://*:{port}"},
        }
    llm = LLM(**kw)
    if spec.get("timing"):
        print("RESULT " + json.dumps(timing(llm, spec)), flush=True)
        return
    rng = random.Random(0)
    n = spec.get("prompt_len", 400)
    long = [rng.randrange(3, 2000) for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": long[: n // 2] + [5, 6, 7]}], sp)
    assert llm.reset_prefix_cache(), "device prefix cache reset"
    t0 = time.perf_counter()
    again = llm.generate([{"prompt_token_ids": long}], sp)
    repeat_s = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in first + again]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    result = {"outputs": outputs, "spec": metrics, "repeat_s": repeat_s}
    core = llm.llm_engine.engine_core.engine_core
    conn = core.scheduler.connector
    if conn is not None:
        result["connector"] = dict(conn._sched.stats)
        result["host"] = conn._sched.host.host_stats()
        result["host_blocks"] = len(conn._sched.host.registered_hashes())
        from kvslots.events import decode_batch

        events = []
        deadline = time.time() + 5
        while time.time() < deadline:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                events.extend(type(e).__name__ for e in decode_batch(payload).events)
            elif events:
                break
        result["events"] = events
        result["publisher"] = conn._publisher.stats() if conn._publisher else None
    print("RESULT " + json.dumps(result), flush=True)


def timing(llm, spec: dict) -> dict:
    """Decode tokens/s on a small batch, and the time to first token of a repeated long prompt
    after the device prefix cache is reset (served from the host tier with the connector)."""
    from vllm import SamplingParams

    rng = random.Random(1)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4))  # warm-up
    n_dec = spec.get("decode_tokens", 256)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(64)]} for _ in range(4)]
    decode_tps = 0.0
    for _ in range(spec.get("decode_repeats", 3)):  # best of N: this machine is noisy
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n_dec, ignore_eos=True))
        dt = time.perf_counter() - t0
        decode_tps = max(decode_tps, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    long = [rng.randrange(3, 2000) for _ in range(spec["prompt_len"])]
    one = SamplingParams(temperature=0, max_tokens=1)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": long}], one)
    first_s = time.perf_counter() - t0
    repeat_s = float("inf")
    for i in range(spec.get("ttft_repeats", 3)):
        llm.generate([{"prompt_token_ids": [9, 9, 9 + i]}], one)  # a step to flush the last stores
        assert llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": long}], one)
        repeat_s = min(repeat_s, time.perf_counter() - t0)
    out = {"decode_tps": decode_tps, "ttft_first_s": first_s, "ttft_repeat_s": repeat_s}
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if conn is not None:
        out["connector"] = dict(conn._sched.stats)
    return out


if __name__ == "__main__":
    main()
