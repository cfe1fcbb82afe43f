"""A producer answers an ack for a hold that came and went (acked already, or timed out and
forgotten past MAX_EXPIRED) or of another life of it 'not held', with memory bounded: each
hand-off carries a hold number (``remote_hold``) the consumer's ack sends back, and holds come
to the worker in number order. Before, such an ack was taken for an early one and answered
held: True, and the consumer used KV the producer had freed."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvslots.errors import TransferError  # noqa: E402
from kvslots.vllm.connector import pd  # noqa: E402

BS = 16


def producer():
    s = pd.PDScheduler(engine_id="P", host="127.0.0.1", port=1, block_size=BS, timeout_s=30.0, producer=True,
                       consumer=False)
    w = pd.PDWorker(engine_id="P", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=30.0,
                    producer=True, consumer=False)
    return s, w


class Req:
    def __init__(self, rid: str) -> None:
        self.request_id, self.prompt_token_ids = rid, list(range(20))
        self.kv_transfer_params = {"do_remote_decode": True}
        self.status = RequestStatus.FINISHED_LENGTH_CAPPED


def hand_off(s: pd.PDScheduler, rid: str) -> dict:
    keep, params = s.request_finished(Req(rid), [1, 2])
    assert keep
    return params


def ack(w: pd.PDWorker, params: dict) -> dict:
    p = pd.parse_remote_params(params, 20)  # as the consumer reads the hand-off
    spec = pd.RecvSpec("d", p["remote_request_id"], "P", "127.0.0.1", 1, [1], [1], p.get("remote_hold"))
    return w._handle({"op": "done", "req": spec.remote_req_id, "hold": list(spec.remote_hold)})


def test_an_ack_for_a_hold_forgotten_past_max_expired_is_not_held(monkeypatch, caplog):
    monkeypatch.setattr(pd, "MAX_EXPIRED", 3)
    caplog.set_level(logging.ERROR, logger=pd.__name__)
    s, w = producer()
    w.on_step(s.build())  # the first step: this producer's life
    params = [hand_off(s, f"r{i}") for i in range(5)]
    meta = s.build()
    w.on_step(pd.PDStepMeta(holds={k: 0.0 for k in meta.holds}, hold_seqs=meta.hold_seqs,
                            hold_epoch=meta.hold_epoch))
    w._expire()  # all 5 time out; r0 and r1 are forgotten (MAX_EXPIRED 3)
    assert list(w._expired) == ["r2", "r3", "r4"]
    assert ack(w, params[0]) == {"held": False, "unknown": True}  # {"held": True} on the old code
    assert ack(w, params[4]) == {"held": False}
    assert not w._early_acks and w.stats["unknown_acks"] == 1


def test_a_second_ack_an_early_ack_and_another_lifes_ack():
    s, w = producer()
    w.on_step(s.build())
    a, b = hand_off(s, "a"), hand_off(s, "b")
    meta = s.build()
    assert meta.hold_seqs == {"a": 1, "b": 2} and a["remote_hold"] == [meta.hold_epoch, 1]
    assert 0 < meta.hold_epoch < 2**53  # exact as a double (JSON readers)
    w.on_step(meta)
    assert ack(w, a) == {"held": True}
    assert ack(w, a) == {"held": False, "unknown": True}  # acked already: its blocks may be gone
    c = hand_off(s, "c")  # its metadata not at the worker yet: an early ack, held
    assert ack(w, c) == {"held": True} and "c" in w._early_acks
    w.on_step(s.build())
    assert w.take_finished()[0] == {"a", "c"}
    # A restarted producer (another life) knows nothing of the hand-offs of the one before.
    s2, w2 = producer()
    w2.on_step(s2.build())
    assert ack(w2, b) == {"held": False, "unknown": True}
    # A consumer that sends no hold (an older one) is answered as before.
    assert w2._handle({"op": "done", "req": "b"}) == {"held": True}


@pytest.mark.parametrize("bad", [[1], [1, 2, 3], [0, 1], [1, -1], [1, 2**63], ["1", 2], [True, 1], {"a": 1}, 7])
def test_a_bad_remote_hold_is_a_bad_hand_off(bad):
    s, _ = producer()
    params = hand_off(s, "r")
    params["remote_hold"] = bad
    with pytest.raises(TransferError, match="remote_hold"):
        pd.parse_remote_params(params, 20)
    del params["remote_hold"]
    assert "remote_hold" not in pd.parse_remote_params(params, 20)


def test_a_bad_hold_in_an_ack_is_taken_as_no_hold():
    s, w = producer()
    w.on_step(s.build())
    for bad in ([1], "x", [2**64, 1], None):
        assert w._handle({"op": "done", "req": "z", "hold": bad}) == {"held": True}


class _AckWhenReleased:
    """The worker's lock, running ``hook`` once, right after its first release: as the control
    thread's ack would between two locked sections of a step."""

    def __init__(self, lock, hook) -> None:
        self.lock, self.hook = lock, hook

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc) -> None:
        self.lock.release()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def test_an_ack_while_its_holds_step_is_taken_finds_the_hold():
    # The step raised the numbers seen in one locked section and added the holds in the next:
    # an ack in between was answered unknown (held: False) for a good hold, which then waited
    # for pd_timeout_s.
    s, w = producer()
    w.on_step(s.build())  # the first step: this life
    params = hand_off(s, "r1")
    replies = []
    w._lock = _AckWhenReleased(w._lock, lambda: replies.append(ack(w, params)))
    w.on_step(s.build())
    assert replies == [{"held": True}]
    assert w.num_held() == 0 and w.take_finished()[0] == {"r1"}


def test_an_ack_of_an_earlier_hold_of_the_same_id_leaves_the_current_one():
    # A held id's ack was taken whatever its hold number: an earlier hold's (ids repeat with
    # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, or a replayed ack) released the current hold and
    # was answered held: True.
    _, w = producer()

    def done(req, hold=None):
        return w._handle({"op": "done", "req": req, **({"hold": hold} if hold else {})})

    w.on_step(pd.PDStepMeta(holds={"r": 120.0}, hold_seqs={"r": 1}, hold_epoch=9))
    assert done("r", [9, 1]) == {"held": True}
    w.on_step(pd.PDStepMeta(holds={"r": 120.0}, hold_seqs={"r": 2}, hold_epoch=9))
    assert done("r", [9, 1]) == {"held": False, "unknown": True} and w.num_held() == 1
    assert done("r", [8, 2]) == {"held": False, "unknown": True} and w.num_held() == 1  # another life's
    assert done("r", [9, 2]) == {"held": True} and w.num_held() == 0
    # With no number on either side, by the id as before.
    w.on_step(pd.PDStepMeta(holds={"s": 120.0, "t": 120.0}, hold_seqs={"s": 3}, hold_epoch=9))
    assert done("s") == {"held": True} and done("t", [9, 3]) == {"held": True} and w.num_held() == 0


def test_a_late_ack_is_matched_with_the_expired_hold_by_its_number():
    _, w = producer()
    w.on_step(pd.PDStepMeta(holds={"r": 0.0}, hold_seqs={"r": 1}, hold_epoch=9))
    w.take_finished()  # hold 1 times out
    w.on_step(pd.PDStepMeta(holds={"r": 120.0}, hold_seqs={"r": 2}, hold_epoch=9))
    assert w._handle({"op": "done", "req": "r", "hold": [9, 2]}) == {"held": True} and w.num_held() == 0
    assert w._handle({"op": "done", "req": "r", "hold": [9, 1]}) == {"held": False}
