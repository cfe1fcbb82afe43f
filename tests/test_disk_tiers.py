"""The scheduler side of the disk tier on its own (:class:`DiskScheduler` over a real
``ConnectorPlanner``, no vLLM, no worker): spills, async hits moving up to the host tier, failed
reads, resets; and a hypothesis state machine checking the two tiers' bookkeeping against a
small reference model rebuilt from the events both tiers publish."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from vllm.distributed.kv_events import KVEventBatch

from kvslots._core import ConnectorPlanner
from kvslots.vllm.connector.disk import DiskLayout, DiskScheduler

BS = 4
_DEC = msgspec.msgpack.Decoder(KVEventBatch)


def tokens_of(h: int) -> list[int]:
    return [h % 1000 + i for i in range(BS)]


@dataclass
class Report:
    """What the worker sends back (``KVSlotsWorkerMetadata``'s disk fields)."""

    disk_done: list = field(default_factory=list)
    disk_loaded: list = field(default_factory=list)
    disk_corrupt: set = field(default_factory=set)
    acks: dict = field(default_factory=dict)
    disk_stats: dict = field(default_factory=dict)


def request(rid: str, hashes: list[int]) -> SimpleNamespace:
    toks = [t for h in hashes for t in tokens_of(h)] + [1]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=len(toks), all_token_ids=toks)


def make(tmp_path, host: int = 2, disk: int = 4) -> DiskScheduler:
    planner = ConnectorPlanner(BS, host, False, expected_workers=1, max_decode_tokens=1)
    layout = DiskLayout(num_layers=1, bytes_per_block=64, dtype="float32", fingerprint=1)
    return DiskScheduler(planner, directory=str(tmp_path), num_slots=disk, block_size=BS, layout=layout,
                         eagle=False)


def store(ds: DiskScheduler, h: int) -> None:
    """A block entering the host tier (as a device store does, through the same host cache)."""
    got = ds.planner.begin_promote([h])
    if got:
        ds.planner.complete_promote([h], [got[0][1]], tokens_of(h), [None])


def events(ds: DiskScheduler) -> list:
    out = []
    p = ds.planner
    if p.num_pending_events():
        out += [("CPU", e) for e in _DEC.decode(p.events_msgpack(0.0, "CPU", None)).events]
        p.discard_events()
    if ds.index.num_pending_events():
        out += [("STORAGE", e) for e in _DEC.decode(ds.index.events_msgpack(0.0, "STORAGE", None, drain=True)).events]
    return out


def test_spill_hit_promotion_failed_read_and_reset(tmp_path):
    ds = make(tmp_path)
    store(ds, 1)
    store(ds, 2)
    store(ds, 3)  # evicts 1
    meta = ds.build()
    assert [s[2] for s in meta.spills] == [1] and meta.loads == []
    slot1 = meta.spills[0][1]
    assert not ds.index.contains(1), "found only once written"
    ds.complete(Report(disk_done=[(slot1, True)]))
    assert ds.index.contains(1) and ds.planner.lookup_block(1) is None

    # A hit on disk: the read is planned into a host block of its own (evicting 2, spilled in
    # the same step, ahead of the read that reuses its host block).
    r = request("r", [1, 50])
    assert ds.lookup(r, 0, 0) == BS
    ds.after_alloc(r, [10, 11], BS)
    meta = ds.build()
    (ld,) = meta.loads
    assert (ld.req_id, ld.hashes, ld.device_blocks) == ("r", [1], [10])
    assert [s[2] for s in meta.spills] == [2] and meta.spills[0][0] == ld.host_blocks[0]
    assert ds.metrics()["disk_reads_in_flight"] == 1
    ds.complete(Report(disk_done=[(meta.spills[0][1], True)], disk_loaded=[("r", 1)]))
    assert ds.planner.lookup_block(1) == ld.host_blocks[0], "moved up"
    assert not ds.index.contains(1) and ds.index.contains(2), "one tier at a time"
    ev = events(ds)
    assert ("CPU", "BlockStored", [1]) in [(m, type(e).__name__, e.block_hashes) for m, e in ev]
    assert ("STORAGE", "BlockRemoved", [1]) in [(m, type(e).__name__, e.block_hashes) for m, e in ev]

    # A failed read: nothing moves up, the block stays on disk (until reported corrupt).
    r2 = request("r2", [2])
    r2.num_tokens += BS  # a served block needs a token after it
    r2.all_token_ids += [0] * BS
    assert ds.lookup(r2, 0, 0) == BS
    ds.after_alloc(r2, [12], BS)
    m3 = ds.build()
    ds.complete(Report(disk_done=[(s[1], True) for s in m3.spills], disk_loaded=[("r2", 0)], disk_corrupt={2}))
    assert ds.planner.lookup_block(2) is None and not ds.index.contains(2)
    assert ds.planner.num_held == 0 and ds.planner.num_storing == 0
    assert ds.stats["corrupt_blocks"] == 1 and ds.stats["promoted_blocks"] == 1

    # A reset while a write is under way: it registers nothing, the file is wiped.
    store(ds, 4)
    store(ds, 5)  # evicts what the host held
    meta = ds.build()
    assert meta.spills and ds.index.num_writing == len(meta.spills)
    assert ds.reset() == ds.stats["resets"] == 1  # the one block stored (3) is dropped
    meta2 = ds.build()
    assert meta2 is not None and meta2.wipe
    ds.complete(Report(disk_done=[(s[1], True) for s in meta.spills]))
    assert ds.index.num_stored == 0 and ds.index.num_writing == 0
    assert ds.build() is None, "the wipe is shipped once"


def test_a_lookup_that_misses_forgets_an_earlier_hit(tmp_path):
    ds = make(tmp_path)
    for h in (1, 2, 3):
        store(ds, h)
    meta = ds.build()
    ds.complete(Report(disk_done=[(s[1], True) for s in meta.spills]))
    r = request("r", [1, 50])
    assert ds.lookup(r, 0, 0) == BS
    assert ds.lookup(r, BS, 0) == 0  # vLLM asked again with a longer local hit
    ds.after_alloc(r, [10, 11], 0)
    assert ds.build() is None, "no stale load planned"


class TwoTiers(RuleBasedStateMachine):
    """Random stores, spills, hits (read intact in part or not at all), write results and
    resets; the reference model is the two tiers' event streams replayed."""

    @initialize()
    def setup(self) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="kvslots-tiers-")
        self.ds = make(self.dir, host=3, disk=4)
        self.host: set[int] = set()  # replayed from events, medium CPU
        self.disk: set[int] = set()  # replayed from events, medium STORAGE
        self.next_hash = 1
        self.step = 0
        self.writes: list[int] = []  # slots written, not reported yet
        self.reads: list[tuple[str, int]] = []  # (request, blocks) read, not reported yet
        self.nreq = 0

    def _replay(self) -> None:
        for medium, e in events(self.ds):
            tier = self.host if medium == "CPU" else self.disk
            name = type(e).__name__
            if name == "BlockStored":
                assert not (set(e.block_hashes) & tier), "stored twice in one tier"
                tier.update(e.block_hashes)
            elif name == "BlockRemoved":
                assert set(e.block_hashes) <= tier, "removed what was not there"
                tier.difference_update(e.block_hashes)
            else:
                tier.clear()

    def _build(self) -> None:
        self.step += 1
        meta = self.ds.build()
        if meta is not None:
            self.writes += [s[1] for s in meta.spills]
            self.reads += [(ld.req_id, len(ld.hashes)) for ld in meta.loads]
        self._replay()

    @rule()
    def store_new(self) -> None:
        store(self.ds, self.next_hash)
        self.next_hash += 1
        self._build()

    @rule(ok=st.booleans(), n=st.integers(1, 3))
    def finish_writes(self, ok: bool, n: int) -> None:
        done, self.writes = self.writes[:n], self.writes[n:]
        self.ds.complete(Report(disk_done=[(s, ok) for s in done]))
        self._replay()

    @rule(data=st.data())
    def hit(self, data) -> None:
        on_disk = sorted(self.disk)
        if not on_disk:
            return
        chain = data.draw(st.lists(st.sampled_from(on_disk), min_size=1, max_size=3, unique=True))
        self.nreq += 1
        r = request(f"r{self.nreq}", chain + [10**6 + self.nreq])
        got = self.ds.lookup(r, 0, 0)
        if got:
            self.ds.after_alloc(r, list(range(len(chain) + 1)), got)
        self._build()

    @rule(data=st.data())
    def finish_read(self, data) -> None:
        if not self.reads:
            return
        rid, n = self.reads.pop(0)
        good = data.draw(st.integers(0, n))
        self.ds.complete(Report(disk_loaded=[(rid, good)]))
        self._replay()

    @rule()
    def reset(self) -> None:
        self.ds.planner.clear()
        self.ds.reset()
        self._build()

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "ds"):
            return
        ds = self.ds
        assert set(ds.planner.registered_hashes()) == self.host
        stored = {h for h in range(1, self.next_hash) if ds.index.contains(h)}
        assert stored == self.disk
        assert ds.index.check_invariants() is None and ds.planner.check_invariants() is None
        assert ds.index.num_stored <= ds.index.num_slots and len(self.host) <= ds.planner.num_host_blocks
        if not self.reads:
            # One tier at a time (both only while a read copies a block up).
            assert not (self.host & self.disk), self.host & self.disk
            assert ds.planner.num_storing == 0 and ds.metrics()["disk_reads_in_flight"] == 0
            assert ds.planner.num_held == 0
        if not self.writes:
            assert ds.index.num_writing == 0


TestTwoTiers = TwoTiers.TestCase
TestTwoTiers.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_tier_figures_reach_prometheus_through_vllms_connector_metrics(tmp_path):
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvslots.vllm.connector import KVSlotsConnector
    from kvslots.vllm.connector.stats import KVSlotsConnectorStats, TierStats

    ds = make(tmp_path)
    for h in (1, 2, 3):
        store(ds, h)
    meta = ds.build()
    ds.complete(Report(disk_done=[(s[1], True) for s in meta.spills],
                       disk_stats={"queue_depth": 2, "bytes_written": 64, "bytes_read": 0}))
    r = request("r", [1, 50])
    ds.lookup(r, 0, 0)
    ds.after_alloc(r, [10, 11], BS)
    ds.build()
    src = TierStats(bytes_per_block=64)
    sched = SimpleNamespace(planner=ds.planner)
    first = src.collect(sched, ds)
    assert src.collect(sched, ds) is None, "at most one snapshot a second"
    g, c = first.data["gauges"], first.data["counters"]
    assert (g["host/capacity_blocks"], g["disk/capacity_blocks"], g["disk/used_blocks"]) == (2, 4, 1)
    assert (g["disk/reads_in_flight"], g["disk/queue_depth"]) == (1, 2)
    assert (c["disk/hit_tokens"], c["disk/written_bytes"], c["host/written_bytes"]) == (BS, 64, 3 * 64)
    ds.complete(Report(disk_loaded=[("r", 1)], disk_stats={"queue_depth": 0, "bytes_written": 64, "bytes_read": 64}))
    second = src.collect(sched, ds, force=True)
    assert second.data["counters"]["disk/hit_tokens"] == 0, "increments, not totals"
    assert second.data["counters"]["disk/read_bytes"] == 64 and second.data["gauges"]["disk/reads_in_flight"] == 0

    # vLLM's side: the dict crosses to the front end, is rebuilt, aggregated and observed.
    agg = KVSlotsConnector.build_kv_connector_stats(first.to_dict())
    agg = agg.aggregate(KVSlotsConnector.build_kv_connector_stats(second.to_dict()))
    assert isinstance(agg, KVSlotsConnectorStats) and not agg.is_empty()
    assert agg.reduce()["disk/read_bytes"] == 64 and agg.reduce()["disk/reads_in_flight"] == 0
    reg = CollectorRegistry()
    types = {t: partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = KVSlotsConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(first.to_dict(), 0)
    prom.observe(second.to_dict(), 0)
    text = generate_latest(reg).decode()
    assert 'vllm:kvslots_tier_hit_tokens_total{engine="0",model_name="m",tier="disk"} 4.0' in text
    assert 'vllm:kvslots_tier_capacity_blocks{engine="0",model_name="m",tier="host"} 2.0' in text
    assert 'vllm:kvslots_tier_read_bytes_total{engine="0",model_name="m",tier="disk"} 64.0' in text


def test_a_read_that_fails_with_an_io_error_drops_its_first_block_like_a_corrupt_one(tmp_path):
    # The file cut short under the running engine: the read fails as a whole (an I/O error).
    # Its blocks were recomputed but stayed on disk, so every later hit of that prefix read and
    # failed again; now the first leaves the index, as a corrupt record's does.
    import os

    import numpy as np

    from kvslots.vllm.connector.disk import DiskLoad, DiskStepMeta, DiskWorker

    layout = DiskLayout(num_layers=1, bytes_per_block=3000, dtype="float32", fingerprint=1)
    w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
    for i in range(4):
        assert w.store.submit(i, np.full(3000, i, np.uint8), 100 + i, [i] * BS)
    w.store.flush()
    assert w.take_done() == [(i, True) for i in range(4)]
    os.truncate(w.path, 4096 + 4096)  # slot 0 alone is left
    w.start(DiskStepMeta(loads=[DiskLoad("r", [1, 2, 3], [101, 102, 103], [5, 6, 7], [-1, -1, -1])]))
    load_errors: set[int] = set()
    corrupt: set[int] = set()
    assert w.store.wait_reads(30.0)
    assert w.poll(load_errors, corrupt) == [("r", 0)]
    assert load_errors == {5, 6, 7} and corrupt == {101}
    w.close()


def test_other_weights_under_the_same_model_path_change_the_disk_fingerprint(tmp_path):
    # A model directory retrained or re-downloaded in place: same name, other weights. The disk
    # file's fingerprint was the name alone, so the restarted engine served the old weights' KV.
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\1" * 100)

    def layout() -> DiskLayout:
        cfg = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None, dtype="float16"),
                              cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS),
                              speculative_config=None)
        kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])])
        return DiskLayout.of(cfg, kv, 64)

    before = layout()
    assert layout() == before, "the same weights: the same fingerprint"
    (model / "model.safetensors").write_bytes(b"\2" * 101)
    assert layout().fingerprint != before.fingerprint
    again = layout()
    st = os.stat(model / "model.safetensors")
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, rewritten
    assert layout().fingerprint != again.fingerprint


def test_a_worker_let_go_but_not_yet_collected_does_not_keep_the_next_one_out(tmp_path):
    # The file is locked by the store that holds it (one engine per file). An engine of this
    # process that was dropped but sits in a reference cycle (vLLM's objects have them) holds
    # the lock until the cycle collector runs: a new engine on the same disk_path must start.
    import gc

    from kvslots.errors import DiskTierError
    from kvslots.vllm.connector.disk import DiskWorker

    layout = DiskLayout(num_layers=1, bytes_per_block=3000, dtype="float32", fingerprint=1)
    gc.disable()
    try:
        old = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
        old.cycle = old
        del old
        new = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
        assert new.store.opened == "reused"
        # One that is still alive keeps it: refused, as another process's.
        try:
            DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
        except DiskTierError as e:
            assert "in use" in str(e)
        else:
            raise AssertionError("a second live worker on one file")
    finally:
        gc.enable()
    new.close()
