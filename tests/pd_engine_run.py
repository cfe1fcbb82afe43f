"""One vLLM engine on CPU (in-process engine core) in a P/D role, for test_pd_engine.py.

    python pd_engine_run.py '{"models": DIR, "method": "eagle", "role": "prefill", "pd_port": 17000}'

Roles:
- ``aggregated``: no connector; greedy outputs of the prompts and the spec-decode counters.
- ``prefill``: KVSlotsConnector as kv_producer. Reads one JSON command per stdin line and
  answers one ``RESULT`` line each: ``{"prompts": [[ids]...]}`` prefills them (max_tokens 1,
  ``do_remote_decode``) and returns their ``kv_transfer_params``; ``{"held": true}`` returns
  how many requests' blocks the worker still holds and the blocks vLLM has free. Between
  commands it steps the engine so the decode worker's acks are applied (a served engine's
  busy loop does that by itself). ``{"reset": true}`` resets vLLM's prefix cache (and runs a 3-token request so vLLM
  publishes the event).
- ``decode``: KVSlotsConnector as kv_consumer; generates with the given ``kv_transfer_params``
  and returns outputs, counters, prompt tokens computed locally, the P/D stats and vLLM's free
  blocks before and after. Without ``params`` in the spec it prints ``READY`` and reads
  ``{"prompts", "params"}`` from stdin (so it can start alongside the prefill engine);
  ``pause_pull`` (s) prints ``PULL`` after the hand-shake and waits before the read (fault
  tests stop or kill a peer there), from the read after the first ``pause_after`` ones on;
  ``linger`` keeps it alive until stdin closes.

``method`` null: no speculative decoding. ``kv_events``: ``{"endpoint", "replay_endpoint"}`` for
vLLM's ZMQ KV event publisher.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")


def build(spec: dict):
    from vllm import LLM

    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(spec["models"])
    method = spec.get("method")
    kw = dict(model=models["target"], dtype="float32", block_size=spec.get("block_size", 32), max_model_len=2048, max_num_seqs=4,
              enable_prefix_caching=True, seed=0, enforce_eager=True, distributed_executor_backend="uni",
              disable_log_stats=False)
    if method:
        spec_cfg: dict = {"method": method, "num_speculative_tokens": spec.get("k", 3)}
        if method == "ngram":
            spec_cfg.update(prompt_lookup_max=4, prompt_lookup_min=2)
        else:
            spec_cfg["model"] = models["target"] if method == "draft_model" else models[method]
        kw["speculative_config"] = spec_cfg
    if spec.get("kv_events"):  # vLLM's own ZMQ publisher (PUB + replay ROUTER)
        ev = spec["kv_events"]
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ev["endpoint"],
                                  "replay_endpoint": ev["replay_endpoint"], "topic": ev.get("topic", "kv")}
    role = spec["role"]
    if role != "aggregated":
        extra = {"host_cache_blocks": 8, "pd_timeout_s": spec.get("pd_timeout_s", 60.0)}
        if role == "prefill":
            extra["pd_port"] = spec["pd_port"]
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSlotsConnector", "kv_connector_module_path": "kvslots.vllm",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": spec.get("failure_policy", "recompute"),
            "kv_connector_extra_config": extra,
        }
    return LLM(**kw)


def spec_counters(llm) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def pd_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._pd_worker  # uni executor: the worker is in this process


def free_blocks(llm) -> int:
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def spy_prompt_tokens(llm) -> dict[str, int]:
    """Counts, per request, the prompt tokens this engine computed itself: each step's scheduled
    tokens below the prompt length, from the scheduler output the connector sees."""
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    counts: dict[str, int] = {}
    prompt_len: dict[str, int] = {}
    build = conn.build_connector_meta

    def spy(out):
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for r in out.scheduled_new_reqs:
            prompt_len[r.req_id] = len(r.prompt_token_ids or ())
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            c = computed.get(rid, 0)
            counts[rid] = counts.get(rid, 0) + max(0, min(c + n, prompt_len.get(rid, 0)) - c)
        return build(out)

    conn.build_connector_meta = spy
    return counts


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import SamplingParams

    llm = build(spec)
    role = spec["role"]
    if role == "aggregated":
        sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
        print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                      "spec": spec_counters(llm)}), flush=True)
        return
    if role == "decode":
        local = spy_prompt_tokens(llm)
        w = pd_worker()
        if spec.get("pause_pull"):  # fault tests: stop or kill a peer after the hand-shake, before the bytes
            read = w.transport.read_blocks
            reads = [0]

            def paused(*a, **k):
                reads[0] += 1
                if reads[0] > spec.get("pause_after", 0):
                    print("PULL", flush=True)
                    time.sleep(spec["pause_pull"])
                return read(*a, **k)

            w.transport.read_blocks = paused
        free_start = free_blocks(llm)
        if "params" in spec:
            prompts, all_params = spec["prompts"], spec["params"]
        else:  # started before the prefill engine: the hand-off comes on stdin
            print("READY", flush=True)
            cmd = json.loads(sys.stdin.readline())
            prompts, all_params = cmd["prompts"], cmd["params"]
        outs = []
        for p, params in zip(prompts, all_params):
            sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                extra_args={"kv_transfer_params": params})
            outs += llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        print("RESULT " + json.dumps({
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "local_prompt_tokens": [next((v for k, v in local.items() if k == o.request_id
                                          or k.startswith(o.request_id + "-")), None) for o in outs],
            "spec": spec_counters(llm), "pd": dict(w.stats),
            "segments": [s.name for s in w.layout.segments],
            "target_layers": llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers,
            "free_start": free_start, "free_end": free_blocks(llm),
        }), flush=True)
        if spec.get("linger"):  # keep the event publisher up until the test is done reading
            sys.stdin.read()
        return
    # prefill: a command loop
    print("READY", flush=True)
    baseline = free_blocks(llm)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        if not ready:
            llm.llm_engine.engine_core.engine_core.step()  # applies acks and hold timeouts
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        if "prompts" in cmd:
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
            print("RESULT " + json.dumps({"params": [o.kv_transfer_params for o in outs],
                                          "first": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
        elif "reset" in cmd:  # drops the prefix cache: vLLM queues AllBlocksCleared
            ok = bool(llm.reset_prefix_cache())
            # vLLM publishes queued events at its next scheduled step: one short local request
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)
            print("RESULT " + json.dumps({"reset": ok}), flush=True)
        elif "held" in cmd:
            deadline = time.time() + cmd.get("wait_s", 0)
            while True:
                llm.llm_engine.engine_core.engine_core.step()
                held = pd_worker().num_held()
                if held == 0 or time.time() >= deadline:
                    break
                time.sleep(0.05)
            print("RESULT " + json.dumps({"held": held, "free": free_blocks(llm), "baseline_free": baseline,
                                          "stats": dict(pd_worker().stats)}), flush=True)


if __name__ == "__main__":
    main()
