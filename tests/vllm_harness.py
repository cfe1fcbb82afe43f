"""Drives vLLM's real v1 Scheduler step by step with the KVSlotsConnector on both sides,
fake model outputs and simulated EAGLE drafting/acceptance, over KV caches that are CPU tensors.

The fake forward pass writes, for every scheduled position, the token it computed KV for into
every layer's slot (``[token, layer, position, 1]``), so a block's bytes say exactly which
tokens it holds: a stored host block that held a rejected draft would not match the verified
tokens its BlockStored event names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvslots.vllm.connector import KVSlotsConnector

BLOCK_SIZE = 32
HEADS = 1
HEAD = 2  # 2 * HEAD = 4 floats per slot: [token, layer, position, 1]
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "draft_model.layers.0.self_attn.attn"]
DRAFT_BASE = 5000  # draft tokens come from [DRAFT_BASE, 2 * DRAFT_BASE); prompts and bonus tokens below

_hash_ready = False


def engine_config(model_dir: str, draft_dir: str | None, *, k: int = 3, num_blocks: int = 64,
                  extra: dict[str, Any] | None = None, method: str = "eagle", max_num_seqs: int = 8,
                  max_num_batched_tokens: int = 256, async_scheduling: bool = False) -> Any:
    spec = None
    if draft_dir is not None:
        spec = {"method": method, "model": draft_dir, "num_speculative_tokens": k}
    args = EngineArgs(
        model=model_dir,
        speculative_config=spec,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=num_blocks,
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
        kv_transfer_config={
            "kv_connector": "KVSlotsConnector",
            "kv_connector_module_path": "kvslots.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra or {},
        },
    )
    return args.create_engine_config()


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    page = BLOCK_SIZE * HEADS * 2 * HEAD * 4
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=page * num_blocks,
                                        block_stride=page) for name in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                                                    head_size=HEAD, dtype=torch.float32))],
    )


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


@dataclass
class Harness:
    cfg: Any
    num_blocks: int
    num_workers: int = 1
    acceptance: float = 0.7
    seed: int = 0
    log_stats: bool = True
    scheduler_cls: Any = None  # vLLM's Scheduler unless given (kvslots.vllm.KVSlotsScheduler)
    scheduler: Scheduler = field(init=False)
    connector: KVSlotsConnector = field(init=False)
    workers: list[KVSlotsConnector] = field(init=False)
    kv: list[dict[str, torch.Tensor]] = field(init=False)
    events: list[Any] = field(default_factory=list)
    accepted: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        kcc = kv_cache_config(self.num_blocks)
        self.cfg.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = (self.scheduler_cls or Scheduler)(vllm_config=self.cfg, kv_cache_config=kcc,
                                   structured_output_manager=StructuredOutputManager(self.cfg),
                                   block_size=BLOCK_SIZE, log_stats=self.log_stats)
        self.connector = self.scheduler.connector  # type: ignore[assignment]
        # The scheduler drains the connector's events into its publisher each step: capture them
        # (the connector builds vLLM event objects only for a publisher that is on).
        self.scheduler.kv_event_publisher = _Capture(self.events)
        self.connector._vllm_events = True
        self.connector._sched.planner.events_wanted = True
        assert isinstance(self.connector, KVSlotsConnector)
        # One worker-side connector per (simulated) tensor-parallel rank, each with its own shard.
        self.workers, self.kv = [], []
        for _ in range(self.num_workers):
            w = KVSlotsConnector(self.cfg, KVConnectorRole.WORKER, kcc)
            caches = {name: torch.zeros(self.num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD) for name in LAYERS}
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.kv.append(caches)
        self.k = self.cfg.speculative_config.num_speculative_tokens if self.cfg.speculative_config else 0

    @property
    def sched_side(self):
        return self.connector._sched

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = make_request(rid, prompt, max_tokens)
        self.scheduler.add_request(req)
        return req

    def write_kv(self, rid: str, start: int, tokens: list[int]) -> None:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        for rank, caches in enumerate(self.kv):
            for li, name in enumerate(LAYERS):
                t = caches[name]
                for off, tok in enumerate(tokens):
                    pos = start + off
                    b, s = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                    t[b, :, s, :] = torch.tensor([tok, li + 10 * rank, pos, 1.0])[: 2 * HEAD]

    def step(self, *, draft_len: int | None = None, abort: set[str] | None = None) -> Any:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        # Worker side, every rank: copies before the forward (they are sync loads or stores of
        # blocks nobody writes this step).
        worker_meta = None
        finished_sending: set[str] | None = None
        finished_recving: set[str] | None = None
        invalid: set[int] = set()
        for w in self.workers:
            # As vLLM's model runner: handle_preemptions first thing in the step, then
            # start_load_kv before the forward when the step has sync loads, after it otherwise.
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            for w in self.workers:
                w.start_load_kv(None)
        # Fake forward: write the KV of every scheduled position.
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n
            known = req.all_token_ids
            spec = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens = [known[p] if p < len(known) else spec[p - len(known)] for p in range(start, start + n)]
            self.write_kv(rid, start, tokens)
            if req.num_computed_tokens < req.num_prompt_tokens:
                sampled[rid] = []  # a prefill chunk samples nothing
                continue
            accepted = 0
            # vLLM pads drafts it could not use with -1; a sampler never accepts those.
            while accepted < len(spec) and spec[accepted] >= 0 and self.rng.random() < self.acceptance:
                accepted += 1
            self.accepted[rid] = self.accepted.get(rid, 0) + accepted
            bonus = self.rng.randrange(1, DRAFT_BASE)
            sampled[rid] = list(spec[:accepted]) + [bonus]
        if not so.has_sync_kv_loads:
            for w in self.workers:
                w.start_load_kv(None)
        for w in self.workers:
            w.wait_for_save()
            # As vLLM 0.32's model runner asks: get_transfer_results (which has fast paths of
            # its own), not get_finished.
            res = w.get_transfer_results(so.finished_req_ids)
            fs, fr = res.finished_sending, res.finished_recving
            if fs:
                finished_sending = (finished_sending or set()) | fs  # vLLM counts every rank
            if fr:  # async loads (the disk tier: one rank only)
                finished_recving = (finished_recving or set()) | fr
            invalid |= w.get_block_ids_with_load_errors()
            m = w.build_connector_worker_meta()
            if m is not None:
                worker_meta = m if worker_meta is None else worker_meta.aggregate(m)
            w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled[r] for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                                                  invalid_block_ids=invalid,
                                                  kv_connector_worker_meta=worker_meta),
        )
        self.scheduler.update_from_output(so, out)
        if abort:
            self.scheduler.finish_requests(abort, _aborted_status())
        # Drafts for the next step (K may vary per step: dynamic speculative decoding).
        k = self.k if draft_len is None else draft_len
        running = [r.request_id for r in self.scheduler.running if not r.is_prefill_chunk]
        if self.k:
            drafts = [[self.rng.randrange(DRAFT_BASE, 2 * DRAFT_BASE) for _ in range(k)] for _ in running]
            self.scheduler.update_draft_token_ids(DraftTokenIds(running, drafts))
        return so

    def run_until_done(self, max_steps: int = 500, **kw: Any) -> int:
        steps = 0
        while self.scheduler.has_requests() and steps < max_steps:
            self.step(**kw)
            steps += 1
        assert not self.scheduler.has_requests(), "did not finish"
        return steps

    # ---- checks ----
    def check_host_tier(self) -> int:
        """Every registered host block holds, in every layer and on every rank, exactly the
        verified tokens its BlockStored event named. Returns the number of blocks checked."""
        stored: dict[int, list[int]] = {}
        for ev in self.events:
            if type(ev).__name__ == "BlockStored":
                assert ev.medium == "CPU"
                for i, h in enumerate(ev.block_hashes):
                    stored[h] = list(ev.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            elif type(ev).__name__ == "BlockRemoved":
                for h in ev.block_hashes:
                    stored.pop(h)
            else:
                stored.clear()
        host = self.sched_side.host
        assert sorted(stored) == host.registered_hashes(), "event stream != host registry"
        for h, tokens in stored.items():
            hb = host.lookup_block(h)
            for rank, w in enumerate(self.workers):
                region = w._worker.copier.host_block_view(hb)
                for li, name in enumerate(LAYERS):
                    layer = region[name]  # [heads, block_size, 2 * HEAD]
                    got = layer[0, :, 0].tolist()
                    assert got == [float(t) for t in tokens], f"host block {hb} layer {name}: {got} != {tokens}"
                    assert layer[0, :, 1].tolist() == [float(li + 10 * rank)] * BLOCK_SIZE
                    assert all(t < DRAFT_BASE or t in tokens for t in got)
        return len(stored)


class _Capture:
    def __init__(self, sink: list[Any]) -> None:
        self.sink = sink

    def publish(self, batch: Any) -> None:
        self.sink.extend(batch.events)

    def shutdown(self) -> None:
        pass


def _aborted_status():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
