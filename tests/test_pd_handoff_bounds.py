"""A hand-off's remote_block_ids are read only as far as the prompt's blocks: a client's list of
2**24 ids was checked item by item on the scheduler's thread (2.8 s, every request waiting), at
each scheduling attempt; ids past the prompt's blocks are never pulled."""

from __future__ import annotations

import time

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from kvslots.errors import TransferError  # noqa: E402
from kvslots.vllm.connector.pd import PDScheduler, parse_remote_params  # noqa: E402

BS = 32


def params(ids, num_tokens=70):
    return {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_request_id": "r1",
            "remote_host": "127.0.0.1", "remote_port": 5000, "remote_block_ids": ids, "remote_block_size": BS,
            "num_tokens": num_tokens}


def test_only_the_prompts_blocks_are_checked_and_kept():
    # 70 tokens: 3 blocks; what follows is not looked at (here: not even ids).
    got = parse_remote_params(params([4, 5, 6] + ["junk", -1, None] * 100_000))
    assert got["remote_block_ids"] == [4, 5, 6]
    with pytest.raises(TransferError):  # within the prompt's blocks: still checked
        parse_remote_params(params([4, -1, 6, 7]))


def test_a_long_id_list_is_kept_as_far_as_the_prompts_blocks():
    # A lying num_tokens (2**31 tokens) does not widen it: the request's prompt bounds it. The
    # whole list was checked and kept (2**24 ids: 2.8 s of the scheduler's thread).
    s = PDScheduler(engine_id="me", host="127.0.0.1", port=6000, block_size=BS, timeout_s=30.0,
                    producer=False, consumer=True)
    long = [1] * (1 << 20)
    p = parse_remote_params(params(long, num_tokens=1 << 31), num_prompt_tokens=70)
    assert p is not None and p["remote_block_ids"] == [1, 1, 1]
    req = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(70)), status=None,
                          kv_transfer_params=params(long, num_tokens=1 << 31))
    assert s.matched(req, 0) == (0, False)  # 2**31 tokens computed there, 70 here: computed here
    (spec,) = s.build().recvs
    assert spec.local_block_ids == [] and spec.remote_req_id == "r1"  # the producer is released
    req = SimpleNamespace(request_id="d2", prompt_token_ids=list(range(70)), status=None,
                          kv_transfer_params=params(long))
    assert s.matched(req, 0) == (70, True)
    assert s._matched["d2"][1]["remote_block_ids"] == [1, 1, 1]


@pytest.mark.parametrize("over", [{"remote_host": "h" * 10_000_000}, {"remote_block_ids": [-1] * (1 << 20)},
                                  {"remote_engine_id": ["e"] * (1 << 20)}])
def test_a_bad_field_is_named_in_a_short_message(over):
    # The whole value's repr was the message (and the scheduler's log line): 10 MB for that host.
    with pytest.raises(TransferError) as e:
        parse_remote_params({**params([1, 2, 3]), **over})
    assert len(str(e.value)) < 200 and next(iter(over)) in str(e.value)


def test_a_late_ack_after_many_expired_holds_is_still_told_the_blocks_are_gone():
    # Past MAX_EXPIRED timed-out holds the producer forgot them all at once: a late consumer's
    # ack for one that had just timed out was taken for an early ack (answered held: True) and
    # the consumer used KV the producer had freed. Now only the oldest past the bound are
    # forgotten (an ack for one of those is still answered held: True: the bound's residual risk).
    import logging

    from kvslots.vllm.connector import pd

    n = pd.MAX_EXPIRED + 1
    logging.getLogger(pd.__name__).setLevel(logging.CRITICAL)
    try:
        w = pd.PDWorker(engine_id="p", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=30.0,
                        producer=True, consumer=False)
        w.on_step(pd.PDStepMeta(holds={f"r{i}": 0.0 for i in range(n)}))
        t0 = time.perf_counter()
        w._expire()
        took = time.perf_counter() - t0
    finally:
        logging.getLogger(pd.__name__).setLevel(logging.NOTSET)
    assert w._handle({"op": "done", "req": f"r{n - 1}"}) == {"held": False}  # the latest: remembered
    assert w._handle({"op": "done", "req": "r0"}) == {"held": True}  # the oldest: forgotten
    sending, _, _ = w.take_finished()
    assert len(sending) == n
    assert took < 10, took  # the step's thread, with the lock held (about 1 s here, mostly logging)


def test_forgetting_the_oldest_expired_holds_is_linear():
    # The trim took the first key of a dict after many deletions from its front: each step
    # skipped every deleted slot (a burst of 50,000 past the bound: 0.96 s, quadratic).
    from collections import OrderedDict

    from kvslots.vllm.connector import pd

    w = pd.PDWorker(engine_id="p", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=30.0,
                    producer=True, consumer=False)
    assert isinstance(w._expired, OrderedDict) and isinstance(w._early_acks, OrderedDict)
    w._expired.update((f"x{i}", None) for i in range(pd.MAX_EXPIRED + 50_000))
    t0 = time.perf_counter()
    w._expire()
    assert len(w._expired) == pd.MAX_EXPIRED and next(iter(w._expired)) == "x50000"
    assert time.perf_counter() - t0 < 0.5


def test_a_step_with_many_holds_does_not_scan_them_all():
    # _expire looked at every hold at every step (take_finished, on the worker's thread): 8 ms a
    # step with 50,000 held here, 16 ms with 100,000. Now the soonest deadlines only.
    import logging

    from kvslots.vllm.connector import pd

    w = pd.PDWorker(engine_id="p", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=600.0,
                    producer=True, consumer=False)
    w.on_step(pd.PDStepMeta(holds={f"r{i}": 600.0 for i in range(100_000)}))
    w.on_step(pd.PDStepMeta(holds={"soon": 0.0}))
    t0 = time.perf_counter()
    for _ in range(20):
        w.take_finished()
    per_step = (time.perf_counter() - t0) / 20
    assert per_step < 0.002, per_step
    assert w.num_held() == 100_000 and w.stats["expired"] == 1
    # Acked holds leave entries behind until their deadline: the heap is rebuilt past twice
    # the holds, so it stays bounded.
    for i in range(100_000):
        assert w._handle({"op": "done", "req": f"r{i}"}) == {"held": True}
    logging.getLogger(pd.__name__).setLevel(logging.CRITICAL)
    try:
        w.take_finished()
    finally:
        logging.getLogger(pd.__name__).setLevel(logging.NOTSET)
    assert w.num_held() == 0 and len(w._deadlines) <= 1024
