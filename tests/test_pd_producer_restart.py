"""A producer restarted on the same port under the same engine id (a fixed kv_transfer_config
engine_id): the consumer kept the hello of its life before (Mooncake session, memory layout), so
every later pull from it read the old session and failed (recomputed) until the consumer
restarted. Now a failed read asks the producer again and reads once more if it changed."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

from kvslots.vllm.connector.pd import PDStepMeta, PDWorker, RecvSpec  # noqa: E402
from ports import free_port  # noqa: E402
from test_pd_connector import BS, NB, _caches, _wait_finished  # noqa: E402


def worker(producer: bool, port: int, caches) -> PDWorker:
    w = PDWorker(engine_id="P" if producer else "D", host="127.0.0.1", port=port, block_size=BS, model="m",
                 timeout_s=10.0, producer=producer, consumer=not producer, control_timeout_s=3.0)
    w.register(caches, NB)
    return w


def test_pulls_from_a_producer_restarted_under_the_same_engine_id_succeed():
    port = free_port()
    first, later, mine = _caches(1), _caches(3), _caches(2)
    prod = worker(True, port, first)
    cons = worker(False, 0, mine)
    try:
        results = []
        for i in range(3):
            if i == 1:
                prod.close()
                prod = worker(True, port, later)  # restarted: same engine id and port, new session
            prod.on_step(PDStepMeta(holds={f"p{i}": 30.0}))
            cons.on_step(PDStepMeta(recvs=[RecvSpec(f"d{i}", f"p{i}", "P", "127.0.0.1", port, [3 + i], [9 + i])]))
            _, recv, failed = _wait_finished(cons)
            results.append((recv, failed))
        assert results == [({f"d{i}"}, set()) for i in range(3)]  # d1 and d2 failed on the old code
        for name in mine:
            assert torch.equal(mine[name][9], first[name][3])
            assert torch.equal(mine[name][[10, 11]], later[name][[4, 5]])
        assert prod.take_finished()[0] == {"p1", "p2"}
    finally:
        cons.close()
        prod.close()
