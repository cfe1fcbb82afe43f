"""Dynamic speculative-decoding schedules: validation, lookup, and the slot manager's lookahead."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslots import ConfigError, SlotManager, SlotTracker, UnknownRequestError
from kvslots.config.schedule import (
    DEFAULT_FIELD,
    DynamicSDSchedule,
    apply_lookahead,
    lookahead_array,
)

F = DEFAULT_FIELD


def test_parse_and_lookup():
    s = DynamicSDSchedule.parse([[1, 4, 3], [5, 16, 2], [17, 64, 0]], 3)
    assert s.rows == ((1, 4, 3), (5, 16, 2), (17, 64, 0))
    assert [s.k_for_batch_size(n) for n in (1, 4, 5, 16, 17, 64)] == [3, 3, 2, 2, 0, 0]
    assert s.k_for_batch_size(1000) == 0  # beyond the last row: the last K (as vLLM)
    assert s.k_for_batch_size(0) == 3
    assert s.max_k == 3
    assert s.to_list() == [[1, 4, 3], [5, 16, 2], [17, 64, 0]]
    assert s.dense(6) == [0, 3, 3, 3, 3, 2, 2]
    assert "1-4: K=3" in str(s)


def test_tuples_and_numpy_ints_accepted():
    s = DynamicSDSchedule.parse(((1, 2, np.int64(2)), (np.int32(3), 9, 1)), np.int64(2))
    assert s.to_list() == [[1, 2, 2], [3, 9, 1]]


@pytest.mark.parametrize(
    "rows, nst, field, fragment",
    [
        ([], 3, F, "at least one"),
        ("1,2,3", 3, F, "must be a list"),
        ({"a": 1}, 3, F, "must be a list"),
        (5, 3, F, "must be a list"),
        ([[1, 4]], 3, f"{F}[0]", "row must be [start, end"),
        ([[1, 4, 3, 4]], 3, f"{F}[0]", "row must be [start, end"),
        (["abc"], 3, f"{F}[0]", "row must be [start, end"),
        ([[1, 4, "3"]], 3, f"{F}[0]", "num_speculative_tokens must be an integer"),
        ([[1.0, 4, 3]], 3, f"{F}[0]", "start must be an integer"),
        ([[True, 4, 3]], 3, f"{F}[0]", "start must be an integer"),
        ([[0, 4, 3]], 3, f"{F}[0]", "start must be >= 1"),
        ([[-2, 4, 3]], 3, f"{F}[0]", "start must be >= 1"),
        ([[2, 4, 3]], 3, f"{F}[0]", "first row must start at batch size 1"),
        ([[1, 4, 3], [6, 8, 1]], 3, f"{F}[1]", "leaves batch sizes 5..5 without a K"),
        ([[1, 4, 3], [4, 8, 1]], 3, f"{F}[1]", "overlaps"),
        ([[1, 4, 3], [5, 8, 1], [2, 3, 1]], 3, f"{F}[2]", "overlaps or precedes"),
        ([[1, 4, 3], [5, 3, 1]], 3, f"{F}[1]", "end must be >= start"),
        ([[1, 4, 4]], 3, f"{F}[0]", "exceeds the maximum num_speculative_tokens 3"),
        ([[1, 4, -1]], 3, f"{F}[0]", "num_speculative_tokens must be >= 0"),
        ([[1, 4, 1]], 0, "speculative_config.num_speculative_tokens", "must be >= 1"),
        ([[1, 4, 1]], "3", "speculative_config.num_speculative_tokens", "must be an integer"),
    ],
)
def test_bad_schedules_name_the_row(rows, nst, field, fragment):
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.parse(rows, nst)
    assert ei.value.field == field
    assert fragment in str(ei.value)
    assert str(ei.value).startswith(field)
    assert isinstance(ei.value, ValueError)


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError):
        DynamicSDSchedule(((1, 2, 5),), 3)


@pytest.mark.parametrize("rows, nst, field", [
    (((1, "2", 3),), 3, f"{F}[0]"),
    (((1, 2, 3),), "3", "speculative_config.num_speculative_tokens"),
    (5, 3, F),
    (((1, 2, 3),), None, "speculative_config.num_speculative_tokens"),
    (((1, 2**63, 0),), 3, f"{F}[0]"),  # past 64 bits
    (["abc"], 3, f"{F}[0]"),
])
def test_direct_construction_checks_types_too(rows, nst, field):
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule(rows, nst)
    assert ei.value.field == field


@pytest.mark.parametrize("make, field", [
    (lambda k: DynamicSDSchedule(((1, 4, 3),), k), "speculative_config.num_speculative_tokens"),
    (lambda k: DynamicSDSchedule.parse([[1, 4, 3]], k), "speculative_config.num_speculative_tokens"),
    (lambda k: DynamicSDSchedule.from_draft_len_schedule({4: k}, k), "speculative_config.max_draft_len"),
    (lambda k: DynamicSDSchedule.from_max_concurrency(4, k), "speculative_config.max_draft_len"),
], ids=["constructor", "parse", "draft_len_schedule", "max_concurrency"])
def test_k_past_the_bound_is_refused_however_a_schedule_is_built(make, field):
    # A file's K is capped at 128 (check_num_speculative_tokens); a schedule built in code took
    # 2**63-1 (vLLM's rejection sampler verifies at most 128 draft tokens per step).
    for k in (129, 2**40, 2**63 - 1, 2**64):
        with pytest.raises(ConfigError, match="must be <= 128") as ei:
            make(k)
        assert ei.value.field == field, str(ei.value)
    assert make(128).num_speculative_tokens == 128


def test_direct_construction_normalises_rows():
    s = DynamicSDSchedule([[1, np.int64(4), 3], (5, 8, 1)], np.int32(3))
    assert s.rows == ((1, 4, 3), (5, 8, 1)) and type(s.rows[0][1]) is int and s.num_speculative_tokens == 3
    assert s == DynamicSDSchedule.parse([[1, 4, 3], [5, 8, 1]], 3)


@pytest.mark.parametrize("call, field", [
    (lambda: DynamicSDSchedule.from_draft_len_schedule({1: 3}, "3"), "speculative_config.max_draft_len"),
    (lambda: DynamicSDSchedule.from_draft_len_schedule({1: 3}, None), "speculative_config.max_draft_len"),
    (lambda: DynamicSDSchedule.from_draft_len_schedule({1: 3}, 3, max_batch_size="x"), "max_batch_size"),
    (lambda: DynamicSDSchedule.from_draft_len_schedule({1: 3}, 3, max_batch_size=2**63), "max_batch_size"),
    (lambda: DynamicSDSchedule.from_draft_len_schedule({2**63 - 1: 3}, 3),
     f"speculative_config.draft_len_schedule.{2**63 - 1}"),
    (lambda: DynamicSDSchedule.from_max_concurrency([4], 3), "speculative_config.max_concurrency"),
    (lambda: DynamicSDSchedule.from_max_concurrency("4", 3), "speculative_config.max_concurrency"),
    (lambda: DynamicSDSchedule.from_max_concurrency(2**63 - 1, 3), "speculative_config.max_concurrency"),
    (lambda: DynamicSDSchedule.from_max_concurrency(0, 3), "speculative_config.max_concurrency"),
    (lambda: lookahead_array(3, batch_size=-1), "batch_size"),
    (lambda: lookahead_array(3, batch_size="2"), "batch_size"),
    (lambda: lookahead_array(3, batch_size=2, num_requests=-1), "num_requests"),
    (lambda: lookahead_array(3, batch_size=2, num_requests=2.0), "num_requests"),
    (lambda: lookahead_array(3, batch_size=2**40), "batch_size"),
    (lambda: lookahead_array(2**40, 2), "lookahead"),
    (lambda: DynamicSDSchedule.parse([[1, 4, 3]], 3).dense(2**40), "max_batch_size"),
])
def test_api_arguments_are_config_errors_naming_them(call, field):
    with pytest.raises(ConfigError) as ei:
        call()
    assert ei.value.field == field and isinstance(ei.value, ValueError)


def test_field_keyword_and_huge_k_are_kvslots_errors():
    from kvslots.errors import ArgumentTypeError

    for call in (lambda: DynamicSDSchedule.parse([[1, 4, 3]], 3, field=5),  # AttributeError
                 lambda: DynamicSDSchedule.from_draft_len_schedule({4: 3}, 3, field=None)):
        with pytest.raises(ArgumentTypeError, match="field must be a str"):
            call()
    with pytest.raises(ConfigError, match="<= 128") as ei:  # num_speculative_tokens 2**64 was taken
        DynamicSDSchedule.parse([[1, 4, 3]], 2**64)
    assert ei.value.field == "speculative_config.num_speculative_tokens"


def test_bad_query_arguments_are_config_errors():
    s = DynamicSDSchedule.parse([[1, 4, 3], [5, 8, 1]], 3)
    for call, field in [(lambda: s.k_for_batch_size(-1), "batch_size"), (lambda: s.k_for_batch_size("2"), "batch_size"),
                        (lambda: s.dense(0), "max_batch_size"), (lambda: s.dense(2.5), "max_batch_size"),
                        (lambda: lookahead_array(-1, 4), "lookahead"), (lambda: lookahead_array(1.5, 4), "lookahead"),
                        (lambda: lookahead_array(s, -1), "batch_size")]:
        with pytest.raises(ConfigError) as ei:
            call()
        assert ei.value.field == field and isinstance(ei.value, ValueError)


def test_from_speculative_config():
    spec = {"method": "eagle3", "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 32, 2]]}
    s = DynamicSDSchedule.from_speculative_config(spec)
    assert s is not None and s.k_for_batch_size(9) == 2
    assert DynamicSDSchedule.from_speculative_config({"num_speculative_tokens": 3}) is None
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.from_speculative_config({"num_speculative_tokens_per_batch_size": [[1, 2, 1]]})
    assert ei.value.field == "speculative_config.num_speculative_tokens"
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.from_speculative_config(
            {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2, 3]]})
    assert ei.value.field == "speculative_config.num_speculative_tokens_per_batch_size[0]"
    with pytest.raises(ConfigError):
        DynamicSDSchedule.from_speculative_config([1, 2])  # type: ignore[arg-type]


def test_from_trtllm_draft_len_schedule():
    # TRT-LLM's documented example: {4: 4, 8: 2, 32: 1}, speculation off above 32.
    s = DynamicSDSchedule.from_draft_len_schedule({8: 2, 4: 4, 32: 1}, 4, max_batch_size=64)
    assert s.to_list() == [[1, 4, 4], [5, 8, 2], [9, 32, 1], [33, 64, 0]]
    assert s.k_for_batch_size(33) == 0
    # Thresholds beyond max_batch_size still produce a well-formed tail row.
    s = DynamicSDSchedule.from_draft_len_schedule({4: 3, 16: 3}, 3, max_batch_size=8)
    assert s.to_list() == [[1, 16, 3], [17, 17, 0]]
    s = DynamicSDSchedule.from_max_concurrency(16, 3, max_batch_size=256)
    assert s.to_list() == [[1, 16, 3], [17, 256, 0]]


@pytest.mark.parametrize(
    "sched, max_draft, field, fragment",
    [
        ({4: 3, 8: 1}, 4, "x.4", "must map to max_draft_len"),
        ({4: 2, 8: 5}, 2, "x.8", "exceeds max_draft_len"),
        ({0: 2}, 2, "x.0", "threshold must be >= 1"),
        ({4: 2, 8: -1}, 2, "x.8", "draft length must be >= 0"),
        ({"4": 2}, 2, "x.4", "batch-size threshold must be an integer"),
        ({4: "2"}, 2, "x.4", "draft length must be an integer"),
        ({}, 2, "x", "non-empty mapping"),
        ([4, 2], 2, "x", "non-empty mapping"),
    ],
)
def test_bad_draft_len_schedules(sched, max_draft, field, fragment):
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.from_draft_len_schedule(sched, max_draft, field="x")
    assert ei.value.field == field, str(ei.value)
    assert fragment in str(ei.value)


# ------------------------------------------------------------------ property tests


@st.composite
def valid_schedules(draw):
    nst = draw(st.integers(1, 8))
    n_rows = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 20), min_size=n_rows, max_size=n_rows))
    ks = draw(st.lists(st.integers(0, nst), min_size=n_rows, max_size=n_rows))
    rows, start = [], 1
    for length, k in zip(lengths, ks, strict=True):
        rows.append([start, start + length - 1, k])
        start += length
    return rows, nst


@settings(max_examples=120, deadline=None)
@given(valid_schedules(), st.integers(0, 200))
def test_valid_schedules_parse_and_lookup_matches_brute_force(case, n):
    rows, nst = case
    s = DynamicSDSchedule.parse(rows, nst)
    expected = rows[0][2] if n == 0 else next((k for a, b, k in rows if a <= n <= b), rows[-1][2])
    assert s.k_for_batch_size(n) == expected
    assert 0 <= s.k_for_batch_size(n) <= nst


@settings(max_examples=120, deadline=None)
@given(valid_schedules(), st.data())
def test_broken_schedules_are_rejected_at_the_broken_row(case, data):
    rows, nst = case
    i = data.draw(st.integers(0, len(rows) - 1))
    kind = data.draw(st.sampled_from(["k_too_big", "k_negative", "gap", "overlap", "start_zero", "reversed"]))
    bad = [list(r) for r in rows]
    if kind == "k_too_big":
        bad[i][2] = nst + data.draw(st.integers(1, 5))
    elif kind == "k_negative":
        bad[i][2] = -data.draw(st.integers(1, 5))
    elif kind == "gap":
        if i == 0:
            bad[0][0] += 1
            bad[0][1] = max(bad[0][1], bad[0][0])
        else:
            shift = data.draw(st.integers(1, 3))
            bad[i][0] += shift
            bad[i][1] = max(bad[i][1], bad[i][0])
    elif kind == "overlap":
        if i == 0:
            bad[0][0] = 0
        else:
            bad[i][0] = bad[i - 1][1] - data.draw(st.integers(0, bad[i - 1][1] - bad[i - 1][0]))
    elif kind == "start_zero":
        bad[i][0] = 0
        bad[i][1] = max(bad[i][1], 0)
    else:  # end before start
        bad[i][1] = bad[i][0] - 1
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.parse(bad, nst)
    assert ei.value.field == f"{F}[{i}]", (kind, bad, str(ei.value))


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(1, 300), st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 400))
def test_draft_len_schedule_matches_trtllm_semantics(sched, n):
    max_draft = sched[min(sched)]
    if max_draft == 0 or any(v > max_draft for v in sched.values()):
        with pytest.raises(ConfigError):
            DynamicSDSchedule.from_draft_len_schedule(sched, max(max_draft, 1) if max_draft else 1)
        return
    s = DynamicSDSchedule.from_draft_len_schedule(sched, max_draft, max_batch_size=256)
    # TRT-LLM: the draft length of the smallest threshold >= n; 0 above the largest.
    above = [t for t in sorted(sched) if t >= n]
    assert s.k_for_batch_size(n) == (sched[above[0]] if above else 0)


# ------------------------------------------------------------------ slot manager side

BS = 4


def _running(mgr: SlotManager, n: int, k: int, prompt_len: int = 10) -> list[str]:
    rids = []
    for i in range(n):
        rid = f"r{i}"
        mgr.create(rid, np.arange(1000 * i, 1000 * i + prompt_len, dtype=np.uint32), lookahead=k)
        mgr.reserve(rid, prompt_len)
        mgr.commit(rid, np.arange(1000 * i, 1000 * i + prompt_len, dtype=np.uint32))
        rids.append(rid)
    return rids


def test_apply_lookahead_returns_surplus_blocks_when_k_drops():
    sched = DynamicSDSchedule.parse([[1, 2, 8], [3, 4, 4], [5, 64, 0]], 8)
    mgr = SlotManager(256, BS)
    rids = _running(mgr, 2, sched.k_for_batch_size(2))
    for rid in rids:  # a decode step's reservation: 1 + K positions plus K lookahead
        mgr.reserve(rid, 1 + 8)
    assert all(mgr.slot_info(r).reserved_lookahead == 8 for r in rids)
    held_before, free_before = mgr.num_held, mgr.num_free

    # Two more requests join: batch size 4 -> K = 4 (the new ones have no slot yet, so pass the
    # batch size explicitly).
    up = apply_lookahead(mgr, rids, sched, batch_size=4)
    assert up.k == 4 and up.batch_size == 4
    assert up.freed_blocks > 0 and up.freed_block_ids == ()
    assert mgr.num_free == free_before + up.freed_blocks
    assert mgr.num_held == held_before - up.freed_blocks
    for rid in rids:
        info = mgr.slot_info(rid)
        assert info.lookahead == 4 and info.reserved_lookahead == 4
        assert info.capacity >= info.committed + info.pending + 4
    assert mgr.check_invariants() is None

    # Batch of 5: speculation off, the remaining lookahead blocks come back too.
    up2 = apply_lookahead(mgr, rids, sched, batch_size=5)
    assert up2.k == 0
    assert mgr.num_free == free_before + up.freed_blocks + up2.freed_blocks
    for rid in rids:
        info = mgr.slot_info(rid)
        assert info.num_blocks == -(-(info.committed + info.pending) // BS)

    # K grows again: nothing is freed now; the next reserve allocates the room.
    free_now = mgr.num_free
    up3 = apply_lookahead(mgr, rids, sched)  # batch size 2 -> K = 8
    assert up3.k == 8 and up3.freed_blocks == 0 and mgr.num_free == free_now
    mgr.rollback(rids[0], 8)
    assert mgr.reserve(rids[0], 1 + 8) > 0
    assert mgr.check_invariants() is None


def test_apply_lookahead_is_atomic_on_unknown_request():
    mgr = SlotManager(64, BS)
    rids = _running(mgr, 2, 4)
    for rid in rids:
        mgr.reserve(rid, 5)
    before = [mgr.slot_info(r).lookahead for r in rids]
    free = mgr.num_free
    with pytest.raises(UnknownRequestError):
        apply_lookahead(mgr, [rids[0], "nope", rids[1]], 1)
    assert [mgr.slot_info(r).lookahead for r in rids] == before and mgr.num_free == free
    with pytest.raises(ValueError):
        apply_lookahead(mgr, rids, -1)


def test_apply_lookahead_on_slot_tracker_returns_block_ids():
    t = SlotTracker(BS)
    t.add("a", lookahead=6)
    need = t.blocks_needed("a", 3)
    t.reserve("a", 3, list(range(100, 100 + need)))
    up = apply_lookahead(t, ["a"], DynamicSDSchedule.parse([[1, 1, 1], [2, 8, 0]], 6))
    assert up.k == 1
    assert up.freed_blocks == len(up.freed_block_ids) > 0
    assert set(up.freed_block_ids) <= set(range(100, 100 + need))
    assert not set(up.freed_block_ids) & set(t.block_table("a"))


def test_lookahead_array_drives_step():
    sched = DynamicSDSchedule.parse([[1, 1, 6], [2, 16, 2]], 6)
    mgr = SlotManager(256, BS)
    rids = _running(mgr, 3, 6)
    slots = np.array([mgr.slot_id(r) for r in rids], dtype=np.uint32)
    look = lookahead_array(sched, len(rids))
    assert look.dtype == np.uint32 and look.tolist() == [2, 2, 2]
    assert lookahead_array(4, 2).tolist() == [4, 4]
    assert lookahead_array(sched, 1, 3).tolist() == [6, 6, 6]
    zeros = np.zeros(3, dtype=np.uint32)
    mgr.step(slots, zeros, np.zeros(0, dtype=np.uint32), zeros, np.full(3, 3, dtype=np.uint32), look)
    for rid in rids:
        assert mgr.slot_info(rid).lookahead == 2
    assert mgr.check_invariants() is None


class _Boom(Exception):
    pass


class _RowsThatRaise:
    def __iter__(self):
        raise _Boom("iter")


class _RowThatRaises(list):
    def __len__(self):
        raise _Boom("len")


class _MappingThatRaises(dict):
    def items(self):
        raise _Boom("items")


class _EndlessMapping(dict):
    def __len__(self):
        return 2**62


def _endless_rows():
    start = 1
    while True:  # read until memory ran out
        yield (start, start, 1)
        start += 1


@pytest.mark.parametrize("rows, fragment", [
    (_RowsThatRaise(), "cannot be read as rows: _Boom: 'iter'"),  # were the _Boom itself
    ([_RowThatRaises([1, 4, 3])], "cannot be read as rows: _Boom: 'len'"),
    (_endless_rows(), "more than 100000 rows"),  # read without end
], ids=["iter-raises", "len-raises", "endless"])
def test_rows_that_cannot_be_read_are_config_errors(rows, fragment):
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.parse(rows, 3)
    assert fragment in str(ei.value) and ei.value.field == "speculative_config.num_speculative_tokens_per_batch_size"
    assert DynamicSDSchedule.parse(((s, s, 1) for s in range(1, 100_001)), 3).rows[-1] == (100_000, 100_000, 1)


@pytest.mark.parametrize("sched, fragment", [
    (_MappingThatRaises({4: 2}), "cannot be read as a mapping: _Boom: 'items'"),
    (_EndlessMapping({4: 2}), "more than 100000 batch-size thresholds"),
], ids=["items-raises", "endless"])
def test_draft_len_schedules_that_cannot_be_read_are_config_errors(sched, fragment):
    with pytest.raises(ConfigError) as ei:
        DynamicSDSchedule.from_draft_len_schedule(sched, 2, field="x")
    assert fragment in str(ei.value) and ei.value.field == "x"
