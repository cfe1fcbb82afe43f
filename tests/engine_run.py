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
import tempfile
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
        # An ipc endpoint, not a free TCP port: the subscriber connects before the publisher
        # binds, and a TCP connect retried to an unbound loopback port in the ephemeral range can
        # connect to itself and hold the port (the publisher's bind then failed in CI).
        endpoint = "ipc://" + os.path.join(tempfile.mkdtemp(prefix="kvslots-engine-run-"), "events")
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSlotsConnector",
            "kv_role": "kv_both",
            # No module path: the vllm.general_plugins entry point registers the name.
            "kv_connector_extra_config": {"host_cache_gb": 0.05,
                                          "events_endpoint": endpoint},
        }
    if spec.get("connector") and spec.get("disk"):  # the disk tier on as well (kvslots serve --disk-path)
        kw["kv_transfer_config"]["kv_connector_extra_config"].update(
            disk_path=tempfile.mkdtemp(prefix="kvslots-engine-run-disk-"), disk_gb=0.25)
        kw["kv_transfer_config"]["kv_load_failure_policy"] = "recompute"
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(**kw)
    if spec.get("draft_kv"):
        print("RESULT " + json.dumps(draft_kv(llm, spec)), flush=True)
        return
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


def draft_kv(llm, spec: dict) -> dict:
    """EAGLE last-block recovery, checked on the KV bytes. A long prompt P is computed (its full
    blocks stored in the host tier), then repeated after a device cache reset (served from the
    host tier); a prompt Q shares P's full blocks but not the token after them; then both are
    recomputed from scratch (device and host reset) so that the host tier holds what a
    recompute writes. Returns the host hits, the outputs, and per block whether the draft
    layers' bytes of the served blocks equal the recompute's."""
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvslots.events import external_block_hash

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector._sched
    planner = sched.planner
    copier = get_kv_transfer_group()._worker.copier  # uni executor: the worker is in-process
    target_layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    names = sorted({seg.layer for seg in copier._segments})
    draft = [n for n in names if not any(f"layers.{i}." in n for i in range(target_layers))]
    target = [n for n in names if n not in draft]
    hashes: dict[tuple, list[int]] = {}
    lookup = sched.num_new_matched_tokens

    def spy(request, n):  # records each prompt's block hashes (vLLM's, external form)
        hashes[tuple(request.prompt_token_ids)] = [external_block_hash(h) for h in request.block_hashes]
        return lookup(request, n)

    sched.num_new_matched_tokens = spy
    bs = 32
    rng = random.Random(7)
    n = spec.get("prompt_len", 400)
    full = (n - 1) // bs
    p = [rng.randrange(3, 2000) for _ in range(n)]
    q = list(p)
    q[full * bs] = 3 + (p[full * bs] - 2) % 1990  # another token right after the shared blocks
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)

    def run(prompt):
        before = planner.stats()["hit_tokens"]
        out = llm.generate([{"prompt_token_ids": prompt}], sp)
        return list(out[0].outputs[0].token_ids), planner.stats()["hit_tokens"] - before

    def host_blocks(prompt, layers):
        """Per full block of the prompt: the named layers' bytes in its host block (or None)."""
        out = []
        for h in hashes[tuple(prompt)][:full]:
            hb = planner.lookup_block(h)
            view = copier.host_block_view(hb) if hb is not None else None
            out.append(None if view is None else [view[name].clone() for name in layers])
        return out

    def same(a, b):
        return a is not None and b is not None and all(torch.equal(x, y) for x, y in zip(a, b))

    result: dict = {"draft_layers": draft, "target_layers": target, "full_blocks": full}
    out_p, _ = run(p)
    result["successors"] = [planner.successor(h) for h in hashes[tuple(p)][:full]]
    result["expected_successors"] = [p[(i + 1) * bs] for i in range(full)]
    stored_p = host_blocks(p, draft + target)
    assert llm.reset_prefix_cache()
    out_p2, hit_p = run(p)
    assert llm.reset_prefix_cache()
    out_q, hit_q = run(q)
    # What a recompute writes: device and host emptied, each prompt computed alone.
    assert llm.reset_prefix_cache(reset_connector=True)
    out_p3, _ = run(p)
    recomputed_p = host_blocks(p, draft + target)
    assert llm.reset_prefix_cache(reset_connector=True)
    out_q3, _ = run(q)
    recomputed_q = host_blocks(q, draft + target)
    nd = len(draft)
    result.update(
        hit_p=hit_p, hit_q=hit_q,
        outputs={"p": out_p, "p_repeat": out_p2, "q": out_q, "p_recomputed": out_p3, "q_recomputed": out_q3},
        # The blocks P's repeat loaded are the ones stored from P: equal to P's recompute?
        p_draft_equal=[same(a and a[:nd], b and b[:nd]) for a, b in zip(stored_p, recomputed_p)],
        p_target_equal=[same(a and a[nd:], b and b[nd:]) for a, b in zip(stored_p, recomputed_p)],
        # P's stored blocks against Q's recompute: the last shared block's draft KV differs
        # (its last position saw another next token), so serving it to Q would have been wrong.
        pq_draft_equal=[same(a and a[:nd], b and b[:nd]) for a, b in zip(stored_p, recomputed_q)],
        pq_target_equal=[same(a and a[nd:], b and b[nd:]) for a, b in zip(stored_p, recomputed_q)],
        connector=dict(planner.stats()),
    )
    return result


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
        if conn._disk_sched is not None:
            out["disk"] = conn._disk_sched.metrics()
    return out


if __name__ == "__main__":
    main()
