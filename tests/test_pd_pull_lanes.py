"""The consumer's pull lanes: which prefill workers count as answering (the last control
exchange, by the pulls' start), and how the pull threads are shared between them. The control
channel and Mooncake are fakes here, so every interleaving is driven by the test."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvslots.errors import TransferError
from kvslots.vllm.connector import pd
from kvslots.vllm.connector.pd import PDStepMeta, PDWorker, RecvSpec
from kvslots.vllm.pd import control

KEY = ("127.0.0.1", 5)


class FakeLayout:
    def check_compatible(self, other: Any) -> None:
        pass


class FakeTransport:
    session_id = "S1"

    def __init__(self) -> None:
        self.fail = False
        self.reads = 0

    def read_blocks(self, session: str, layout: Any, remote: list[int], local: list[int]) -> int:
        self.reads += 1
        if self.fail:
            raise TransferError("mooncake read failed", details={"kind": "transfer"})
        return 100 * len(local)

    def close(self) -> None:
        pass


def consumer() -> PDWorker:
    w = PDWorker(engine_id="D", host="127.0.0.1", port=0, block_size=4, model="m", timeout_s=30.0,
                 producer=False, consumer=True, control_timeout_s=0.5)
    w.layout, w.transport = FakeLayout(), FakeTransport()
    return w


def spec(req: str, port: int = KEY[1]) -> RecvSpec:
    return RecvSpec(req, "p-" + req, "P", "127.0.0.1", port, [1], [1])


def wait_for(w: PDWorker, reqs: set[str], timeout: float = 10) -> tuple[set[str], set[str]]:
    end, done, failed = time.monotonic() + timeout, set(), set()
    while time.monotonic() < end and not reqs <= done:
        _, r, f = w.take_finished()
        done |= r
        failed |= f
        time.sleep(0.002)
    return done, failed


def test_a_producer_that_answered_once_and_died_is_failing_after_one_call(monkeypatch):
    # Its hello was kept, so its pull read (failed), asked a new hello (no answer) and still sent
    # the ack (no answer either): twice the control calls, and the host stayed "live" (4
    # threads at once, its queued pulls each waiting the same timeouts).
    calls: list[str] = []
    alive = [True]

    def call(host: str, port: int, msg: dict[str, Any], **kw: Any) -> dict[str, Any]:
        calls.append(msg["op"])
        if not alive[0]:
            raise TransferError("no answer", details={"kind": "timeout"})
        if msg["op"] == "hello":
            return {"session": "S1", "layout": {}, "engine_id": "P", "block_size": 4, "model": "m"}
        return {"held": True}

    monkeypatch.setattr(control, "control_call", call)
    monkeypatch.setattr("kvslots.vllm.pd.BlockLayout.from_wire", staticmethod(lambda wire: object()))
    cons = consumer()
    try:
        cons.on_step(PDStepMeta(recvs=[spec("a")]))
        assert wait_for(cons, {"a"}) == ({"a"}, set())
        assert calls == ["hello", "done"] and cons._answers[KEY] is True
        alive[0], cons.transport.fail = False, True  # dead: neither Mooncake nor the control channel answers
        calls.clear()
        cons.on_step(PDStepMeta(recvs=[spec("b")]))
        assert wait_for(cons, {"b"}) == ({"b"}, {"b"})
        assert calls == ["hello"], calls  # the new hello got no answer: no ack
        assert cons._answers[KEY] is False
        # Now a failing host: one pull at a time, and those queued behind it fail with it.
        calls.clear()
        reads = cons.transport.reads
        cons.on_step(PDStepMeta(recvs=[spec(f"c{i}") for i in range(8)]))
        assert cons._running["failing"] == 1 and cons._running["live"] == 0
        assert wait_for(cons, {f"c{i}" for i in range(8)}) == ({f"c{i}" for i in range(8)},) * 2
        assert calls == ["hello"] and cons.transport.reads == reads
    finally:
        cons.close()


def test_a_new_hello_that_answers_after_a_failed_read_still_acks(monkeypatch):
    # A refusal is an answer: the host stays live and the ack is sent.
    calls: list[str] = []

    def call(host: str, port: int, msg: dict[str, Any], **kw: Any) -> dict[str, Any]:
        calls.append(msg["op"])
        if msg["op"] == "hello":
            return {"session": "S1", "layout": {}, "engine_id": "P", "block_size": 4, "model": "m"}
        return {"held": True}

    monkeypatch.setattr(control, "control_call", call)
    monkeypatch.setattr("kvslots.vllm.pd.BlockLayout.from_wire", staticmethod(lambda wire: object()))
    cons = consumer()
    try:
        cons.on_step(PDStepMeta(recvs=[spec("a")]))
        wait_for(cons, {"a"})
        calls.clear()
        cons.transport.fail = True
        cons.on_step(PDStepMeta(recvs=[spec("b")]))
        assert wait_for(cons, {"b"}) == ({"b"}, {"b"})
        assert calls == ["hello", "done"] and cons._answers[KEY] is True
    finally:
        cons.close()


def _blocking_pulls(cons: PDWorker, answers: dict[str, bool]) -> dict[str, threading.Event]:
    """Replaces the worker's pull: request r waits for its event, then answers answers[r]."""
    gates: dict[str, threading.Event] = {}

    def pull(s: RecvSpec) -> bool:
        gates.setdefault(s.req_id, threading.Event()).wait(10)
        cons._finish(s, answers.get(s.req_id, True))
        return answers.get(s.req_id, True)

    cons._pull = pull  # type: ignore[method-assign]
    return gates


def until(cond, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_an_older_pulls_late_timeout_does_not_mark_a_host_that_answered_since_failing():
    # The last contact was whichever pull finished last: one that started before the host came
    # back and timed out after a newer one succeeded marked it failing and failed its queue.
    cons = consumer()
    cons._answers[KEY] = True
    gates = _blocking_pulls(cons, {"old": False})
    for r in ("old", "new", "b1", "b2", "q"):
        gates[r] = threading.Event()
    try:
        cons.on_step(PDStepMeta(recvs=[spec("old")]))
        until(lambda: cons._running["live"] == 1)
        cons.on_step(PDStepMeta(recvs=[spec("new")]))
        gates["new"].set()
        until(lambda: cons._running["live"] == 1)  # new answered; old still waits
        cons.on_step(PDStepMeta(recvs=[spec("b1"), spec("b2"), spec("b3"), spec("q")]))
        assert len(cons._lanes[KEY].queue) == 1  # q waits: old, b1, b2, b3 run
        gates["old"].set()  # its answer (none) is older than new's
        until(lambda: not cons._lanes[KEY].queue)  # q started (or, before, failed untried)
        assert cons._answers[KEY] is True and cons._running["live"] == 4
        for g in ("b1", "b2", "b3", "q"):
            gates.setdefault(g, threading.Event()).set()
        done, failed = wait_for(cons, {"old", "new", "b1", "b2", "b3", "q"})
        assert failed == {"old"} and "q" in done
    finally:
        for g in gates.values():
            g.set()
        cons.close()


def test_a_free_thread_goes_to_the_host_that_waited_not_the_first_lane():
    # Lanes were walked from the start, each filled: with 8 busy prefill workers taking all 32
    # threads, every thread that freed went back to them and a 9th's pulls never started.
    cons = consumer()
    gates = _blocking_pulls(cons, {})
    hosts = {p: ("127.0.0.1", p) for p in range(1, 10)}
    for k in hosts.values():
        cons._answers[k] = True
    busy = [spec(f"h{p}-{j}", p) for p in range(1, 9) for j in range(8)]
    for s in [*busy, spec("h9", 9)]:
        gates[s.req_id] = threading.Event()
    try:
        cons.on_step(PDStepMeta(recvs=busy))
        assert cons._running["live"] == pd.PULL_THREADS
        assert all(cons._lanes[hosts[p]].running == pd.PULLS_PER_HOST for p in range(1, 9))
        cons.on_step(PDStepMeta(recvs=[spec("h9", 9)]))
        assert len(cons._lanes[hosts[9]].queue) == 1
        gates["h1-0"].set()
        until(lambda: len(cons._lanes[hosts[1]].queue) < 4 or not cons._lanes[hosts[9]].queue)
        assert not cons._lanes[hosts[9]].queue and len(cons._lanes[hosts[1]].queue) == 4
        # And the next thread that frees goes to host 1, which has waited longest since.
        gates["h2-0"].set()
        until(lambda: len(cons._lanes[hosts[1]].queue) < 4 or len(cons._lanes[hosts[2]].queue) < 4)
        assert len(cons._lanes[hosts[1]].queue) == 3 and len(cons._lanes[hosts[2]].queue) == 4
    finally:
        for g in gates.values():
            g.set()
        cons.close()


def test_a_new_hello_from_a_known_host_drops_no_other(monkeypatch):
    # At the bound, a known host's new hello (a restarted producer) dropped the oldest other one.
    engines = {1: "P", 2: "P", 3: "P"}
    monkeypatch.setattr(pd, "MAX_KNOWN_HOSTS", 3)
    monkeypatch.setattr(control, "control_call", lambda host, port, msg, **kw: {
        "engine_id": engines[port], "block_size": 4, "model": "m"})
    monkeypatch.setattr("kvslots.vllm.pd.BlockLayout.from_wire", staticmethod(lambda wire: object()))
    cons = consumer()
    try:
        for port in (1, 2, 3):
            cons._hello(spec("r", port))
        engines[2] = "P2"
        cons._hello(RecvSpec("r", "p", "P2", "127.0.0.1", 2, [1], [1]))
        assert list(cons._peers) == [("127.0.0.1", 1), ("127.0.0.1", 3), ("127.0.0.1", 2)]
        assert cons._peers[("127.0.0.1", 2)]["engine_id"] == "P2"
    finally:
        cons.close()
