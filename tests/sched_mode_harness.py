"""Drives vLLM's real scheduler step by step, once over vLLM's KV cache manager and once in
kvslots scheduler mode, with fake model outputs that do not depend on the schedule.

Every request has a ground-truth continuation G(request, i) (the i-th output token, as a greedy
target would produce it). The fake drafter proposes G for draft j with a probability drawn per
(request, output index) from a hash, otherwise a wrong token; the fake verifier accepts the
leading drafts that equal G and adds the bonus token. So the tokens a request outputs, and how
many drafts it has accepted at a given output position, are the same whatever was scheduled
when: any difference between the two runs is a difference in scheduling.

Both sync and async (vLLM's batch queue of 2) engine loops are emulated; ``Run.trace`` records
per step what was scheduled (tokens per request, spec tokens, new/resumed/preempted ids), and the
KV events, prefix-cache stats and finishes are collected for comparison.
"""

from __future__ import annotations

import copy
import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
VOCAB = 30000
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "draft_model.layers.0.self_attn.attn"]

_hash_ready = False


def engine_config(model_dir: str, draft_dir: str | None, *, method: str = "eagle", k: int = 3,
                  num_blocks: int = 256, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                  max_model_len: int = 2048, async_scheduling: bool = False, connector: bool = False,
                  kv_events: bool = True, dynamic_sd: dict[int, int] | None = None,
                  block_size: int = BLOCK_SIZE, enable_prefix_caching: bool = True) -> Any:
    """A VllmConfig for the tiny local models (nothing downloaded)."""
    spec = None
    if draft_dir is not None or method == "ngram":
        spec = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
        else:
            spec["model"] = draft_dir
        if dynamic_sd:
            spec["num_speculative_tokens_per_batch_size"] = [
                [lo, hi, kk] for (lo, hi), kk in sorted(dynamic_sd.items())]
    kw: dict[str, Any] = {}
    if connector:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSlotsConnector", "kv_connector_module_path": "kvslots.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"host_cache_blocks": 1024},
        }
    if kv_events:
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
    args = EngineArgs(model=model_dir, speculative_config=spec, block_size=block_size,
                      num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      enable_prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling, **kw)
    cfg = args.create_engine_config()
    if async_scheduling:
        # vLLM's CPU platform turns async scheduling off in the engine; the scheduler-level
        # variant is what is tested here.
        cfg.scheduler_config.async_scheduling = True
    return cfg


def kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    page = block_size * 2 * 2 * 4
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page * num_blocks,
                                        block_stride=page) for n in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                                                    head_size=2, dtype=torch.float32))],
    )


def _u(*parts: Any) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return struct.unpack("<Q", h)[0]


_RUN_CONFIGS: "OrderedDict[tuple[int, int], tuple[Any, Any]]" = OrderedDict()


def run_config(cfg: Any, num_blocks: int) -> Any:
    """``cfg`` for a pool of ``num_blocks``: a deep copy, shared by the runs over that pool size
    (a deep copy of a VllmConfig costs more than a small case's run; schedulers and connectors
    only read it, which tests/test_scheduler_mode_differential.py checks)."""
    key = (id(cfg), num_blocks)
    hit = _RUN_CONFIGS.get(key)
    if hit is not None and hit[0] is cfg:
        _RUN_CONFIGS.move_to_end(key)
        return hit[1]
    out = copy.deepcopy(cfg)
    out.cache_config.num_gpu_blocks = num_blocks
    _RUN_CONFIGS[key] = (cfg, out)
    if len(_RUN_CONFIGS) > 64:
        _RUN_CONFIGS.popitem(last=False)
    return out


@dataclass
class Arrival:
    rid: str
    step: int
    prompt: list[int]
    max_tokens: int
    abort_at: int | None = None  # engine step at which it is aborted (if still live)


@dataclass
class Workload:
    arrivals: list[Arrival]
    acceptance: float = 0.7
    seed: int = 0


def make_request(a: Arrival, block_size: int) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    return Request(request_id=a.rid, prompt_token_ids=list(a.prompt), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


class _Capture:
    def __init__(self, sink: list[Any]) -> None:
        self.sink = sink

    def publish(self, batch: Any) -> None:
        self.sink.extend(batch.events)

    def shutdown(self) -> None:
        pass


@dataclass
class Run:
    """One run of a workload over one KV cache manager."""

    cfg: Any
    num_blocks: int
    kvslots: bool
    workload: Workload
    check_every_step: bool = True
    scheduler: Any = field(init=False)
    trace: list[dict[str, Any]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    hits: list[tuple[int, int]] = field(default_factory=list)  # (queries, hits) per stats drain
    preemptions: int = 0
    peak_blocks: int = 0
    held_trace: list[int] = field(default_factory=list)  # blocks held after each schedule()
    steps: int = 0

    def __post_init__(self) -> None:
        cfg = run_config(self.cfg, self.num_blocks)
        self.block_size = cfg.cache_config.block_size
        kcc = kv_cache_config(self.num_blocks, self.block_size)
        if self.kvslots:
            from kvslots.vllm import KVSlotsScheduler

            cls: Any = KVSlotsScheduler
        else:
            cls = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=cfg, kv_cache_config=kcc,
                             structured_output_manager=StructuredOutputManager(cfg),
                             block_size=self.block_size, log_stats=True)
        self.scheduler.kv_event_publisher = _Capture(self.events)
        self.worker = None
        if cfg.kv_transfer_config is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            from kvslots.vllm.connector import KVSlotsConnector

            self.worker = KVSlotsConnector(cfg, KVConnectorRole.WORKER, kcc)
            self.worker.register_kv_caches(
                {n: torch.zeros(self.num_blocks, 1, self.block_size, 4) for n in LAYERS})
        self.async_mode = bool(cfg.scheduler_config.async_scheduling)
        spec = cfg.speculative_config
        self.k = spec.num_speculative_tokens if spec is not None else 0
        self.method = spec.method if spec is not None else None
        # The fake worker's own state per request: verified outputs and pending drafts.
        self.w_out: dict[str, int] = {}
        self.w_drafts: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}

    # ---- the fake model ----
    def truth(self, rid: str, i: int) -> int:
        return 1 + _u(self.workload.seed, "G", rid, i) % (VOCAB - 2)

    def draft(self, rid: str, start: int, k: int) -> list[int]:
        out = []
        for j in range(k):
            i = start + j
            good = (_u(self.workload.seed, "A", rid, i) % 10_000) / 10_000 < self.workload.acceptance
            out.append(self.truth(rid, i) if good else VOCAB - 1)
        return out

    def _execute(self, so: Any) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            nspec = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            # A prefill chunk that does not reach the end of the known tokens samples nothing
            # (the scheduler has just set the flag for this step).
            if req.is_prefill_chunk:
                sampled[rid] = []
                continue
            o = self.w_out.get(rid, 0) if self.async_mode else req.num_output_tokens
            drafts = self.w_drafts.pop(rid, [])[:nspec]
            a = 0
            while a < len(drafts) and drafts[a] == self.truth(rid, o + a):
                a += 1
            toks = [self.truth(rid, o + j) for j in range(a + 1)]
            sampled[rid] = toks
            self.w_out[rid] = o + len(toks)
            self.accepted[rid] = self.accepted.get(rid, 0) + a
            self.drafted[rid] = self.drafted.get(rid, 0) + nspec
        req_ids = list(so.num_scheduled_tokens)
        kv_out = KVConnectorOutput()
        if self.worker is not None:
            w, meta = self.worker, so.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            fs, _ = w.get_finished(so.finished_req_ids)
            kv_out = KVConnectorOutput(finished_sending=fs, invalid_block_ids=w.get_block_ids_with_load_errors(),
                                       kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[sampled[r] for r in req_ids],
                                kv_connector_output=kv_out)
        if self.async_mode and self.k:
            # The worker drafts for the next step right away (K of this step).
            kk = so.num_spec_tokens_to_schedule or self.k
            for rid in req_ids:
                if sampled[rid]:
                    self.w_drafts[rid] = self.draft(rid, self.w_out[rid], kk)
        return out

    def _drafts_sync(self, so: Any) -> None:
        if not self.k:
            return
        kk = so.num_spec_tokens_to_schedule or self.k
        ids, drafts = [], []
        for r in self.scheduler.running:
            if r.is_prefill_chunk or r.is_finished():
                continue
            o = r.num_output_tokens
            self.w_out[r.request_id] = o
            d = self.draft(r.request_id, o, kk)
            if self.method == "ngram":
                d = d[: _u(self.workload.seed, "n", r.request_id, o) % (kk + 1)]
            self.w_drafts[r.request_id] = list(d)
            ids.append(r.request_id)
            drafts.append(d)
        if ids:
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))

    # ---- the engine loop ----
    def _record(self, so: Any) -> None:
        cached = so.scheduled_cached_reqs
        self.preemptions += len(so.preempted_req_ids or ())
        self.trace.append({
            "tokens": dict(so.num_scheduled_tokens),
            "spec": {r: len(v) for r, v in so.scheduled_spec_decode_tokens.items()},
            "new": sorted(r.req_id for r in so.scheduled_new_reqs),
            "resumed": sorted(cached.resumed_req_ids or ()),
            "preempted": sorted(so.preempted_req_ids or ()),
            "k": so.num_spec_tokens_to_schedule,
        })
        m = self.scheduler.kv_cache_manager
        conn = self.scheduler.connector
        if conn is not None:
            # The connector mirrors the block tables from the scheduler's output: it must see
            # exactly the blocks the manager holds.
            planner = conn._sched.planner
            for rid in so.num_scheduled_tokens:
                mirror = planner.device_blocks(rid)
                if mirror is not None:
                    assert list(mirror) == list(m.get_block_ids(rid)[0]), f"{rid}: connector mirror differs"
        held = m.num_held_blocks() - 1 if self.kvslots else (
            m.block_pool.num_gpu_blocks - m.block_pool.get_num_free_blocks() - 1)
        self.peak_blocks = max(self.peak_blocks, held)
        self.held_trace.append(held)

    def _after_update(self, outs: Any) -> None:
        for eco in outs.values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)
            st = eco.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                p = st.prefix_cache_stats
                self.hits.append((p.queries + p.preempted_queries, p.hits + p.preempted_hits))
        if self.check_every_step:
            self.check()

    def check(self) -> None:
        m = self.scheduler.kv_cache_manager
        if self.kvslots:
            live = [r for r in self.scheduler.requests.values() if not r.is_finished()]
            m.check(live)

    def run(self, max_steps: int = 3000) -> "Run":
        arrivals = sorted(self.workload.arrivals, key=lambda a: a.step)
        todo = deque(arrivals)
        aborts: dict[int, list[str]] = {}
        for a in arrivals:
            if a.abort_at is not None:
                aborts.setdefault(a.abort_at, []).append(a.rid)
        queue: deque[tuple[Any, ModelRunnerOutput]] = deque()
        step = 0
        while step < max_steps:
            while todo and todo[0].step <= step:
                a = todo.popleft()
                req = make_request(a, self.block_size)
                self.requests[a.rid] = req
                self.scheduler.add_request(req)
            for rid in aborts.pop(step, ()):
                if rid in self.scheduler.requests:
                    self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                    self.finish.setdefault(rid, "abort")
            if not todo and not self.scheduler.has_requests() and not queue:
                break
            step += 1
            if not self.async_mode:
                if not self.scheduler.has_requests():
                    continue
                so = self.scheduler.schedule()
                self._record(so)
                out = self._execute(so)
                self._after_update(self.scheduler.update_from_output(so, out))
                self._drafts_sync(so)
                continue
            # Async: vLLM's batch queue of two.
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                self._record(so)
                queue.append((so, self._execute(so)))
                if len(queue) < 2 and so.total_num_scheduled_tokens > 0:
                    continue
            if queue:
                so, out = queue.popleft()
                self._after_update(self.scheduler.update_from_output(so, out))
        self.steps = step
        assert not self.scheduler.has_requests() and not queue, f"did not finish in {max_steps} steps"
        self.check()
        return self

    # ---- summaries ----
    def stored_hashes(self) -> list[Any]:
        """Every BlockStored hash (in order) and BlockRemoved hash, as an event log."""
        log = []
        for ev in self.events:
            name = type(ev).__name__
            if name == "BlockStored" and ev.medium == "GPU":
                log.append(("S", tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids)))
            elif name == "BlockRemoved" and ev.medium == "GPU":
                log.append(("R", tuple(ev.block_hashes)))
            elif name == "AllBlocksCleared":
                log.append(("C",))
        return log

    def pool_is_whole(self) -> bool:
        m = self.scheduler.kv_cache_manager
        if self.kvslots:
            return m.num_held_blocks() == 1 and m.num_free_blocks() == self.num_blocks - 1
        return m.block_pool.get_num_free_blocks() == self.num_blocks - 1


def compare(a: Run, b: Run, *, same_schedule: bool = True) -> None:
    """The kvslots run ``b`` against vLLM's ``a``. With different schedules an abort lands at a
    different point of its request, so aborted requests are compared on how they finished only."""
    if same_schedule:
        assert b.outputs == a.outputs, "output tokens differ"
    else:
        aborted = {r for r, f in a.finish.items() if "abort" in f.lower()}
        aborted |= {r for r, f in b.finish.items() if "abort" in f.lower()}
        assert {r: v for r, v in b.outputs.items() if r not in aborted} == {
            r: v for r, v in a.outputs.items() if r not in aborted}, "output tokens differ"
        for r in aborted:
            n = min(len(a.outputs.get(r, [])), len(b.outputs.get(r, [])))
            assert a.outputs.get(r, [])[:n] == b.outputs.get(r, [])[:n], f"{r}: output tokens differ"
        # A request aborted in one run may have finished before the abort in the other.
        assert {r: f for r, f in b.finish.items() if r not in aborted} == {
            r: f for r, f in a.finish.items() if r not in aborted}, "finishes differ"
        assert set(b.finish) == set(a.finish), "not every request finished"
        return
    assert b.finish == a.finish, "finishes differ"
    if same_schedule:
        assert len(b.trace) == len(a.trace), f"{len(b.trace)} steps vs {len(a.trace)}"
        for i, (x, y) in enumerate(zip(a.trace, b.trace)):
            assert y == x, f"step {i}: scheduled\n  vllm    {x}\n  kvslots {y}"
        assert b.hits == a.hits, "prefix-cache stats differ"
        assert b.stored_hashes() == a.stored_hashes(), "KV events differ"
        assert b.accepted == a.accepted
