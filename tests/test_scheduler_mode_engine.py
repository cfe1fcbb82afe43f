"""Scheduler mode in the real vLLM engine on CPU, with the tiny random-weight models built by the
tests, in all five speculative modes (none, EAGLE, EAGLE-3, draft model = target, n-gram), with
and without the KVSlotsConnector: ``--scheduler-cls kvslots.vllm.KVSlotsScheduler`` gives the
same greedy tokens as vLLM's own KV cache manager, the same speculative-decoding counters
(every draft accepted with draft model = target), the same prefix-cache counters and hits on a
repeated prompt, and with the connector on the same against vLLM's manager with the connector,
the repeat served from the host tier after a device reset.

Per mode two processes side by side (tests/sched_engine_run.py), each on a core of its own,
run two engines each in turn, without and with the connector (n-gram: one process per engine,
vLLM 0.32 on CPU cannot build a second n-gram engine in a process: its kernel-override scan
trips over a module the n-gram proposer imports).

A model scheduler mode refuses (a sliding-window layer) stops the engine at start-up with the
error that names the feature and says to use ``--slot-manager vllm``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from engine_procs import run_side_by_side

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
PROMPT = 400


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    root = str(tmp_path_factory.mktemp("tiny-sched-engine"))
    build_tiny_models(root)
    return root


def run_engines(models_dir: str, *groups: list[dict]) -> list[dict]:
    """Each group of runs in a process of its own (its engines one after the other), the
    processes side by side; the results in the runs' order."""
    specs = [{"models": models_dir, "prompt_len": PROMPT, "runs": runs} for runs in groups]
    return [r for group in run_side_by_side(os.path.join(HERE, "sched_engine_run.py"), specs) for r in group]


@pytest.mark.parametrize("method", [None, "eagle", "eagle3", "draft_model", "ngram"])
def test_scheduler_mode_serves_like_vllms_manager(models_dir, method):
    runs = [{"method": method, "kvslots": kv, "connector": conn} for conn in (False, True) for kv in (False, True)]
    groups = [[r] for r in runs] if method == "ngram" else [runs[:2], runs[2:]]
    vllm, kvslots, vllm_conn, kvslots_conn = run_engines(models_dir, *groups)
    for base, ours in ((vllm, kvslots), (vllm_conn, kvslots_conn)):
        assert base["manager"] == "KVCacheManager"
        assert ours["manager"] == "KVSlotsKVCacheManager" and ours["scheduler"] == "KVSlotsScheduler"
        assert ours["outputs"] == base["outputs"], "greedy tokens differ"
        assert ours["metrics"] == base["metrics"], "speculative-decoding or prefix-cache counters differ"
        assert ours["cached_tokens"] == base["cached_tokens"], "prefix hits differ"
        assert ours["pool_whole"]
    assert kvslots_conn["connector"] == vllm_conn["connector"], "the host tier served differently"
    assert kvslots_conn["outputs"] == kvslots["outputs"], "the connector changed what is computed"
    out = kvslots["outputs"]
    assert out[0] == out[4] == out[5], "the repeated prompt decodes the same"
    # The repeat hit every full block of the prompt but the last token's, less the block EAGLE
    # drops; after the device reset nothing (the connector's host tier serves it, with its own
    # EAGLE rule: tests/test_vllm_engine.py).
    full = (PROMPT - 1) // BLOCK
    expect = (full - 1 if method in ("eagle", "eagle3") else full) * BLOCK
    assert kvslots["cached_tokens"][4] == expect
    assert kvslots["cached_tokens"][5] == 0
    # The host tier recovers the block EAGLE drops (its successor token matches): every full
    # block, on the repeat before the device reset (device hit + that block) and after it.
    assert kvslots_conn["cached_tokens"] == kvslots["cached_tokens"][:4] + [full * BLOCK, full * BLOCK]
    conn = kvslots_conn["connector"]
    # Loads: the dropped block on the repeat before the reset (EAGLE family), then every block.
    assert conn["loaded_blocks"] == full + (method in ("eagle", "eagle3")) and conn["failed_loads"] == conn["failed_stores"] == 0
    m, mc = kvslots["metrics"], kvslots_conn["metrics"]
    for key in m:
        if key.startswith("vllm:spec_decode"):
            assert mc[key] == m[key], key
    assert m["vllm:prefix_cache_hits"] > 0
    if method == "draft_model":
        assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"] > 0
    if method is not None:
        assert m["vllm:spec_decode_num_drafts"] > 0


def test_dynamic_speculative_decoding_lookahead_in_the_engine(models_dir):
    """A dynamic-SD schedule: kvslots materialises each step's lookahead for its K; the tokens
    and counters are vLLM's."""
    dyn = [[1, 1, 4], [2, 4, 2]]
    base, ours = run_engines(models_dir, *([{"method": "eagle", "k": 4, "dynamic_sd": dyn, "kvslots": kv}]
                                           for kv in (False, True)))
    assert ours["outputs"] == base["outputs"]
    assert ours["metrics"] == base["metrics"]
    assert ours["pool_whole"]


_START = """
import sys


def main():
    from vllm import LLM

    LLM(model=sys.argv[1], dtype="float32", block_size=32, max_model_len=512, max_num_seqs=2,
        enforce_eager=True, distributed_executor_backend="uni",
        scheduler_cls="kvslots.vllm.KVSlotsScheduler")
    print("ENGINE STARTED", flush=True)


if __name__ == "__main__":
    main()
"""


def test_refused_feature_stops_the_engine_at_start_up(models_dir, tmp_path):
    """The tiny target with its first layer made sliding-window (two KV cache groups, a hybrid
    model) in vLLM's real engine, its engine core in a process of its own as ``vllm serve`` runs
    it, with the kvslots scheduler: start-up fails with the SchedulerModeError that names the
    feature and says to use ``--slot-manager vllm``, without hanging, and leaves no process."""
    from kvslots._dev.tiny import build_tiny_models

    model = tmp_path / "sliding"
    shutil.copytree(build_tiny_models(models_dir)["target"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention"] + ["full_attention"] * (cfg["num_hidden_layers"] - 1)
    cfg["sliding_window"] = 64
    (model / "config.json").write_text(json.dumps(cfg))
    script = tmp_path / "start_engine.py"
    script.write_text(_START)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # A session of its own: every process the engine starts is in its process group.
    proc = subprocess.Popen([sys.executable, str(script), str(model)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the engine hung at start-up")
    assert "ENGINE STARTED" not in out and proc.returncode != 0, out[-4000:]
    refusals = [line for line in out.splitlines() if "SchedulerModeError:" in line]
    assert refusals, f"no SchedulerModeError in the engine's output:\n{out[-4000:]}"
    assert all("2 KV cache groups" in line and "SlidingWindowSpec" in line
               and "use --slot-manager vllm" in line for line in refusals), refusals
    # The engine core and its worker went with the front end.
    deadline = time.monotonic() + 15
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the failed engine left processes behind")
        time.sleep(0.2)
