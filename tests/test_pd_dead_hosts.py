"""Pulls from a prefill worker that answers are not held up by pulls to ones that do not (a
dead, blackholed or hung host: each pull to it holds its thread for the control timeouts): the
consumer's pull threads have separate budgets for hosts not known to answer, and the pulls
waiting for a host that just did not answer fail at once."""

from __future__ import annotations

import os
import socket
import time

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")
pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

from kvslots.vllm.connector import pd  # noqa: E402
from kvslots.vllm.connector.pd import PDStepMeta, PDWorker, RecvSpec  # noqa: E402
from ports import free_port  # noqa: E402
from test_pd_connector import BS, NB, _caches  # noqa: E402

CONTROL_S = 1.0  # each try of a control call to a dead host waits this long


def dead_host() -> socket.socket:
    """A host that takes connections (the kernel's backlog) and never answers them."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def worker(producer: bool, consumer: bool, engine_id: str, port: int = 0) -> PDWorker:
    w = PDWorker(engine_id=engine_id, host="127.0.0.1", port=port, block_size=BS, model="m", timeout_s=30.0,
                 producer=producer, consumer=consumer, control_timeout_s=CONTROL_S)
    w.register(_caches(1 if producer else 2), NB)
    return w


def spec(req: str, port: int, local: int, remote: int = 3) -> RecvSpec:
    return RecvSpec(req, "p-" + req, "P", "127.0.0.1", port, [remote], [local])


def wait_for(w: PDWorker, reqs: set[str], timeout: float) -> tuple[set[str], set[str], float]:
    start, done, failed = time.monotonic(), set(), set()
    while time.monotonic() - start < timeout and not reqs <= done:
        _, r, f = w.take_finished()
        done |= r
        failed |= f
        time.sleep(0.01)
    return done, failed, time.monotonic() - start


def test_a_live_producer_is_served_while_pulls_to_dead_hosts_wait():
    # Old code: 2 pull threads; 4 pulls to 2 dead hosts each held one for ~4 s (the hello's
    # two tries and the ack's), so the live pull (a host never contacted before either) came
    # after ~8 s. Now at once.
    port = free_port()
    prod = worker(True, False, "P", port)
    cons = worker(False, True, "D")
    dead = [dead_host(), dead_host()]
    try:
        prod.on_step(PDStepMeta(holds={"p-live": 30.0}))
        ports = [d.getsockname()[1] for d in dead]
        cons.on_step(PDStepMeta(recvs=[spec(f"dead{i}", ports[i % 2], local=i) for i in range(4)]))
        cons.on_step(PDStepMeta(recvs=[spec("live", port, local=9)]))
        done, failed, took = wait_for(cons, {"live"}, 30)
        assert "live" in done and "live" not in failed, (done, failed)
        assert took < 2 * CONTROL_S, took
        # The dead hosts' pulls fail; those queued behind a host's first failure at once:
        # one round of timeouts per host, not one per pull.
        done, failed, took = wait_for(cons, {f"dead{i}" for i in range(4)}, 30)
        assert done == failed == {f"dead{i}" for i in range(4)}, (done, failed)
        assert took < 4 * CONTROL_S, took
        assert cons._lanes == {} and sum(cons._running.values()) == 0
        assert [cons._answers[("127.0.0.1", p)] for p in (*ports, port)] == [False, False, True]
    finally:
        cons.close()
        prod.close()
        for d in dead:
            d.close()


def test_a_host_that_stopped_answering_takes_one_thread_and_live_ones_keep_theirs(monkeypatch):
    # A host known to answer that goes silent: its next pulls run one at a time, within the
    # failing hosts' budget; a burst of them never takes the live host's threads.
    cons = PDWorker(engine_id="D", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=30.0,
                    producer=False, consumer=True, control_timeout_s=CONTROL_S)
    running: list[tuple[str, int]] = []

    def fake_pull(s: RecvSpec) -> bool:
        running.append((s.remote_port, sum(cons._running.values())))
        time.sleep(0.01 if s.remote_port == 2 else 0.2)
        cons._finish(s, s.remote_port != 1)
        return s.remote_port != 1

    monkeypatch.setattr(cons, "_pull", fake_pull)
    cons._answers[("127.0.0.1", 1)] = False
    cons._answers[("127.0.0.1", 2)] = True
    dead = {f"dead{i}" for i in range(20)}
    live = {f"live{i}" for i in range(20)}
    new = {f"new{i}" for i in range(40)}
    try:
        cons.on_step(PDStepMeta(recvs=[spec(f"dead{i}", 1, local=i) for i in range(20)]))
        assert cons._running["failing"] == 1 and sum(cons._running.values()) == 1
        # 40 hosts never seen (dead ones, say: each holds its thread 0.2 s) take at most
        # NEW_HOST_THREADS.
        cons.on_step(PDStepMeta(recvs=[spec(f"new{i}", 1000 + i, local=i) for i in range(40)]))
        assert cons._running["new"] == pd.NEW_HOST_THREADS
        cons.on_step(PDStepMeta(recvs=[spec(f"live{i}", 2, local=i) for i in range(20)]))
        done, failed, took = wait_for(cons, live, 10)
        assert live <= done and not failed & live
        assert took < 1.0, took
        # The first dead pull failed: the 19 behind it failed with it, never tried.
        more = wait_for(cons, (dead | new) - done, 20)
        done, failed = done | more[0], failed | more[1]
        assert done == dead | new | live and failed == dead
        assert sum(1 for _, port in running if port == 1) == 1  # one dead pull tried
        assert max(n for _, n in running) <= pd.PULL_THREADS
    finally:
        cons.close()
    assert pd.PULL_THREADS > pd.NEW_HOST_THREADS + pd.FAILING_THREADS + pd.PULLS_PER_HOST


def test_the_producers_said_hello_to_are_bounded(monkeypatch):
    # Each prefill worker's hello (its layout, some KiB) was kept for good, for any host and
    # port a hand-off named that answered: a client naming many grew the consumer without bound.
    from kvslots.vllm.pd import control

    monkeypatch.setattr(pd, "MAX_KNOWN_HOSTS", 8)
    monkeypatch.setattr(control, "control_call", lambda *a, **k: {"engine_id": "P", "block_size": BS, "model": "m"})
    monkeypatch.setattr("kvslots.vllm.pd.BlockLayout.from_wire", staticmethod(lambda wire: object()))
    cons = PDWorker(engine_id="D", host="127.0.0.1", port=0, block_size=BS, model="m", timeout_s=30.0,
                    producer=False, consumer=True)
    try:
        for port in range(1, 101):
            cons._hello(spec("r", port, local=0))
        assert len(cons._peers) == 8 and ("127.0.0.1", 100) in cons._peers
    finally:
        cons.close()
