"""Scheduler mode against vLLM's own KV cache manager, at scheduler level.

vLLM's real scheduler is driven step by step twice over the same workload (random arrivals,
shared prefixes, aborts, EAGLE acceptance drawn by hypothesis; fake model outputs that do not
depend on the schedule, see sched_mode_harness): once over vLLM's ``KVCacheManager``, once over
kvslots. The kvslots allocator's invariants are checked after every step, and:

- with a static K, every step schedules the same tokens for the same requests, with the same
  preemptions and resumptions, the same prefix-cache stats, the same KV events (so the same
  stored block hashes) and the same outputs and finishes, whatever the pool size;
- with a dynamic speculative-decoding schedule kvslots holds lookahead only for the step's K:
  outputs and finishes are the same, the pool is whole at the end, and summed over a fixed
  seeded set of small-pool cases (``test_preempts_no_more_often_than_vllm_summed``, static K
  too, sync and async) kvslots preempts no more often than vLLM.

The sync engine loop and the async one (vLLM's batch queue of two), with and without the
KVSlotsConnector. ``KVSLOTS_SCHED_EXAMPLES`` sets the examples per test: default 300, so the
seven differential tests run 2,100 cases per CI run (on a loaded 2-core VM about 25 ms of CPU
per case, 0.05-0.25 s wall depending on the load); e.g. ``KVSLOTS_SCHED_EXAMPLES=3000`` for
ten times more, ``KVSLOTS_SCHED_EXAMPLES=30`` for a quick run. The summed-preemption test runs
a fixed set of 300 seeded cases per variant (four variants) whatever that setting
(``KVSLOTS_SUMMED_CASES`` takes the first N of them).
"""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import hypothesis.strategies as st  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from sched_mode_harness import Arrival, Run, Workload, compare, engine_config, run_config  # noqa: E402

EXAMPLES = int(os.environ.get("KVSLOTS_SCHED_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BIG_POOL = 400  # never preempts: 12 requests of at most 150 + 40 + lookahead tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    return build_tiny_models(str(tmp_path_factory.mktemp("tiny-sched")))


_configs: dict[tuple, object] = {}


def config(models, **kw):
    key = tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in kw.items()))
    if key not in _configs:
        method = kw.pop("method", "eagle")
        draft = None if method in ("ngram", None) else (models["target"] if method == "draft_model" else models[method])
        _configs[key] = engine_config(models["target"], draft, method=method or "eagle", **kw)
    return _configs[key]


def make_workload(integer, unit, max_requests: int = 12) -> Workload:
    """Requests arriving over the first steps; most share one of two long prefixes (so hits,
    duplicate registrations and EAGLE's dropped block happen); some are aborted. ``integer(lo,
    hi)`` and ``unit()`` draw the shape (from hypothesis, or from a seeded ``random.Random``)."""
    seed = integer(0, 2**16)
    rng = random.Random(seed)
    n = integer(1, max_requests)
    prefixes = [[rng.randrange(1, 2000) for _ in range(integer(16, 120))] for _ in range(2)]
    arrivals = []
    for i in range(n):
        pre = prefixes[integer(0, 1)] if integer(0, 3) else []
        body = [rng.randrange(1, 2000) for _ in range(integer(1, 70))]
        abort = integer(1, 40) if integer(0, 6) == 0 else None
        arrivals.append(Arrival(f"req-{i}", integer(0, 15), pre + body, integer(1, 48), abort))
    return Workload(arrivals, acceptance=unit(), seed=seed)


@st.composite
def workloads(draw, max_requests: int = 12):
    return make_workload(lambda lo, hi: draw(st.integers(lo, hi)), lambda: draw(st.floats(0.0, 1.0)),
                         max_requests)


STATS = {"cases": 0, "steps": 0, "preemptions": 0, "hit_tokens": 0, "accepted": 0, "events": 0, "aborted": 0}


def _tally(a):
    STATS["cases"] += 1
    STATS["steps"] += a.steps
    STATS["preemptions"] += a.preemptions
    STATS["hit_tokens"] += sum(h for _, h in a.hits)
    STATS["accepted"] += sum(a.accepted.values())
    STATS["events"] += len(a.events)
    STATS["aborted"] += sum(1 for f in a.finish.values() if "abort" in f.lower())


def servable(wl, num_blocks: int, k: int = 5) -> int:
    """At least enough blocks for the longest request on its own (plus the null block)."""
    need = max(-(-(len(a.prompt) + a.max_tokens + 2 * k + 1) // 16) for a in wl.arrivals)
    return max(num_blocks, need + 1)


def _same(cfg, num_blocks, wl):
    num_blocks = servable(wl, num_blocks)
    a = Run(cfg, num_blocks, False, wl).run()
    b = Run(cfg, num_blocks, True, wl).run()
    compare(a, b, same_schedule=True)
    _tally(a)
    assert b.pool_is_whole() and a.pool_is_whole()
    return a, b


@SETTINGS
@given(wl=workloads())
def test_eagle_same_schedule_large_pool(models, wl):
    a, _ = _same(config(models, method="eagle", k=3, num_blocks=BIG_POOL), BIG_POOL, wl)
    assert a.preemptions == 0


@SETTINGS
@given(wl=workloads(), num_blocks=st.integers(12, 40))
def test_eagle_same_schedule_small_pool(models, wl, num_blocks):
    _same(config(models, method="eagle", k=3, num_blocks=BIG_POOL), num_blocks, wl)


@SETTINGS
@given(wl=workloads(), num_blocks=st.sampled_from([16, 24, BIG_POOL]))
def test_eagle_async_same_schedule(models, wl, num_blocks):
    _same(config(models, method="eagle", k=3, num_blocks=BIG_POOL, async_scheduling=True), num_blocks, wl)


@SETTINGS
@given(wl=workloads(max_requests=8), num_blocks=st.sampled_from([17, 28, BIG_POOL]),
       async_scheduling=st.booleans())
def test_eagle_with_connector_same_schedule(models, wl, num_blocks, async_scheduling):
    _same(config(models, method="eagle", k=3, num_blocks=BIG_POOL, connector=True,
                 async_scheduling=async_scheduling), num_blocks, wl)


@SETTINGS
@given(wl=workloads(max_requests=8), num_blocks=st.sampled_from([14, 30, BIG_POOL]),
       method=st.sampled_from(["ngram", "draft_model", None]))
def test_other_speculative_methods_same_schedule(models, wl, num_blocks, method):
    cfg = config(models, method=method, k=2, num_blocks=BIG_POOL) if method else config(
        models, method=None, num_blocks=BIG_POOL)
    _same(cfg, num_blocks, wl)


@SETTINGS
@given(wl=workloads(max_requests=8), num_blocks=st.sampled_from([14, 30, BIG_POOL]))
def test_prefix_caching_off_same_schedule(models, wl, num_blocks):
    _same(config(models, method="eagle", k=3, num_blocks=BIG_POOL, enable_prefix_caching=False), num_blocks, wl)


_dynamic = {"vllm": 0, "kvslots": 0, "cases": 0, "same_schedule": 0, "vllm_peak": 0, "kvslots_peak": 0}
DYNAMIC = {(1, 2): 5, (3, 4): 3, (5, 16): 1}


@SETTINGS
@given(wl=workloads(), num_blocks=st.integers(17, 48), async_scheduling=st.booleans(),
       connector=st.booleans())
def test_dynamic_sd_lookahead_for_the_step_k(models, wl, num_blocks, async_scheduling, connector):
    """kvslots holds lookahead for the step's K only and fits requests as vLLM would (the
    lookahead it does not hold counts as held for every fit check but its owner's), so at the
    first step where the two runs differ kvslots has not preempted where vLLM did not: it got
    more prefix hits (fewer cached blocks were evicted, or a hit shared a held duplicate), so
    it needed fewer blocks. Past that point the runs are different schedules."""
    cfg = config(models, method="eagle", k=5, num_blocks=BIG_POOL, dynamic_sd=DYNAMIC,
                 async_scheduling=async_scheduling, max_num_seqs=16, connector=connector)
    num_blocks = servable(wl, num_blocks)
    a = Run(cfg, num_blocks, False, wl).run()
    b = Run(cfg, num_blocks, True, wl).run()
    compare(a, b, same_schedule=False)
    assert b.pool_is_whole()
    for x, y in zip(a.trace, b.trace):
        if x == y:
            continue
        assert len(y["preempted"]) <= len(x["preempted"]), f"kvslots preempted first:\n {x}\n {y}"
        if len(y["preempted"]) == len(x["preempted"]):
            # No preemption difference: more prefix hits or more room (admission or tokens).
            assert sum(y["tokens"].values()) <= sum(x["tokens"].values()) or len(y["tokens"]) >= len(x["tokens"])
        break
    else:
        assert len(a.trace) == len(b.trace)
        assert b.peak_blocks <= a.peak_blocks, "same schedule, more blocks held"
        _dynamic["same_schedule"] += 1
    _dynamic["vllm"] += a.preemptions
    _dynamic["kvslots"] += b.preemptions
    _dynamic["cases"] += 1
    _dynamic["vllm_peak"] += a.peak_blocks
    _dynamic["kvslots_peak"] += b.peak_blocks


def test_dynamic_sd_summary():
    """The figures over every case of the test above (run before this one in the file):
    peak blocks held (asserted) and preemptions, summed (reported here; the summed preemptions
    are asserted over a fixed seeded set by the test below)."""
    if not _dynamic["cases"]:
        pytest.skip("the dynamic-SD cases did not run")
    print("dynamic-SD cases:", _dynamic)
    assert _dynamic["kvslots_peak"] <= _dynamic["vllm_peak"], _dynamic


#: Cases per variant of the summed-preemption test: the first N of a fixed seeded set, the same
#: every run whatever KVSLOTS_SCHED_EXAMPLES says (the property is about this set: a single case
#: may preempt more or less, see the test). ``KVSLOTS_SUMMED_CASES`` shortens it: the vLLM 0.33
#: part of ``make test`` runs the first 100.
SUMMED_CASES = int(os.environ.get("KVSLOTS_SUMMED_CASES", "300"))


def seeded_case(i: int) -> tuple[Workload, int, bool]:
    """Case ``i`` of the seeded set: a workload as ``workloads`` draws them, a pool from tight
    to roomy (17-48 blocks, at least one request's worth) and the connector on or off."""
    rng = random.Random(f"kvslots-summed-{i}")
    wl = make_workload(rng.randint, rng.random)
    return wl, servable(wl, rng.randint(17, 48)), rng.random() < 0.5


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static_k", "dynamic_sd"])
def test_preempts_no_more_often_than_vllm_summed(models, dynamic, async_scheduling):
    """Summed over a fixed seeded set of ``SUMMED_CASES`` small-pool cases, kvslots preempts no
    more often than vLLM's manager. Static K: every case schedules the same (so the sums are
    equal). Dynamic SD: kvslots holds lookahead for the step's K only, and every fit check
    counts the lookahead vLLM would hold for the other requests as held (rust/core/src/device.rs,
    ``DeviceAllocator::allocate``), so the schedules differ only where kvslots got more prefix
    hits (it evicted fewer cached blocks, or shared a held duplicate); a single case may then
    preempt more or less, the sum does not preempt more."""
    totals = {"vllm": 0, "kvslots": 0, "same_schedule": 0, "worse": 0, "better": 0}
    for i in range(SUMMED_CASES):
        wl, num_blocks, connector = seeded_case(i)
        if dynamic:
            cfg = config(models, method="eagle", k=5, num_blocks=BIG_POOL, dynamic_sd=DYNAMIC,
                         async_scheduling=async_scheduling, max_num_seqs=16, connector=connector)
        else:
            cfg = config(models, method="eagle", k=3, num_blocks=BIG_POOL, async_scheduling=async_scheduling,
                         connector=connector)
        a = Run(cfg, num_blocks, False, wl).run()
        b = Run(cfg, num_blocks, True, wl).run()
        compare(a, b, same_schedule=not dynamic)
        assert a.pool_is_whole() and b.pool_is_whole()
        totals["vllm"] += a.preemptions
        totals["kvslots"] += b.preemptions
        totals["same_schedule"] += a.trace == b.trace
        totals["worse"] += b.preemptions > a.preemptions
        totals["better"] += b.preemptions < a.preemptions
    print(f"summed preemptions ({'dynamic SD' if dynamic else 'static K'}, "
          f"{'async' if async_scheduling else 'sync'}, {SUMMED_CASES} cases):", totals)
    assert totals["vllm"] > SUMMED_CASES // 10, ("the pools were too roomy to preempt", totals)
    assert totals["kvslots"] <= totals["vllm"], totals
    if not dynamic:
        assert totals["same_schedule"] == SUMMED_CASES


def test_runs_leave_the_config_as_it_was(models):
    """The harness shares one copy of the engine config between the runs over a pool size
    (sched_mode_harness.run_config): both schedulers, the connector and the async loop only
    read it (attributes a run adds, such as lazily cached properties, aside)."""
    wl = Workload([Arrival("a", 0, list(range(1, 60)), 20, None), Arrival("b", 1, list(range(1, 40)), 30, 5)],
                  acceptance=0.7, seed=1)
    for kw in ({"connector": True, "async_scheduling": True}, {"dynamic_sd": DYNAMIC, "k": 5},
               {"method": "ngram", "k": 2}, {"enable_prefix_caching": False}):
        cfg = config(models, **{"method": "eagle", "k": 3, "num_blocks": BIG_POOL, **kw})
        shared = run_config(cfg, 21)
        before = {name: dict(vars(sub)) for name, sub in vars(shared).items() if hasattr(sub, "__dict__")}
        for kvslots in (False, True):
            Run(cfg, 21, kvslots, wl).run()
        for name, fields in before.items():
            now = vars(getattr(shared, name))
            changed = [k for k, v in fields.items() if repr(now.get(k)) != repr(v)]
            assert not changed, (kw, name, changed)


def test_the_cases_exercised_what_they_should():
    """Preemptions, prefix hits, accepted drafts, KV events and aborts all happened."""
    if not STATS["cases"]:
        pytest.skip("the differential cases did not run")
    print(STATS)
    for key in ("steps", "preemptions", "hit_tokens", "accepted", "events", "aborted"):
        assert STATS[key] > 0, (key, STATS)
