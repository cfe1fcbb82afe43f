"""Disaggregated prefill/decode with the real vLLM engine on CPU: a prefill engine (kv_producer)
and a decode engine (kv_consumer) in two processes, the KV of target and draft layers moved
over Mooncake on loopback. The decode engine's greedy outputs equal an aggregated engine's, it
computes one prompt token itself (not a block), with the drafter = the target it accepts as many
drafts as the aggregated run, the prefill engine frees every block it held once the decode
engine acked, and a prefill engine killed before the pull makes the decode engine recompute.

Each engine runs in its own process (tests/pd_engine_run.py)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    root = str(tmp_path_factory.mktemp("tiny-pd"))
    build_tiny_models(root)
    return root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    # 200 tokens: 6 full blocks + a partial one; 96: exactly 3 blocks (no partial block).
    return [[rng.randrange(3, 2000) for _ in range(200)], [rng.randrange(3, 2000) for _ in range(96)]]


def _run(spec: dict) -> dict:
    env = dict(os.environ, GLOG_minloglevel="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pd_engine_run.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


class Prefill:
    """The prefill engine, a long-lived process driven over stdin/stdout."""

    def __init__(self, spec: dict):
        env = dict(os.environ, GLOG_minloglevel="2")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "pd_engine_run.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read()[-6000:]
                raise AssertionError(f"prefill engine exited:\n{err}")
            if line.startswith(prefix):
                return line

    def call(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT ")[len("RESULT "):])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "ngram"])
def test_pd_outputs_and_acceptance_equal_aggregated(models_dir, method):
    prompts = _prompts()
    port = _port()
    prefill = Prefill({"models": models_dir, "method": method, "role": "prefill", "pd_port": port})
    try:
        pre = prefill.call({"prompts": prompts})
        params = pre["params"]
        for p, prm in zip(prompts, params):
            assert prm["do_remote_prefill"] and prm["num_tokens"] == len(p)
            assert len(prm["remote_block_ids"]) >= -(-len(p) // 32)
        dec = _run({"models": models_dir, "method": method, "role": "decode", "prompts": prompts, "params": params,
                    "max_tokens": MAX_TOKENS})
        held = prefill.call({"held": True, "wait_s": 30})
    finally:
        prefill.close()
    agg = _run({"models": models_dir, "method": method, "role": "aggregated", "prompts": prompts,
                "max_tokens": MAX_TOKENS})
    assert dec["outputs"] == agg["outputs"]
    assert [o[0] for o in dec["outputs"]] == [f[0] for f in pre["first"]]
    # the decode engine computed the last prompt token only (the rest came from the prefill engine)
    assert all(n == 1 for n in dec["local_prompt_tokens"]), dec["local_prompt_tokens"]
    assert dec["pd"]["pulled_blocks"] == sum(-(-len(p) // 32) for p in prompts)
    assert dec["pd"]["failed_pulls"] == 0
    # the drafter's layers are in what was shipped (EAGLE: one more layer; a draft model = the
    # target: as many again)
    draft_layers = {"eagle": 1, "eagle3": 1, "draft_model": dec["target_layers"], "ngram": 0}[method]
    assert len(dec["segments"]) == dec["target_layers"] + draft_layers, dec["segments"]
    # the prefill engine freed every block it held, on the decode engine's acks (no timeout)
    assert held["held"] == 0 and held["free"] == held["baseline_free"], held
    assert held["stats"]["acks"] == len(prompts) and held["stats"]["expired"] == 0
    acc = "vllm:spec_decode_num_accepted_tokens"
    assert dec["spec"][acc] == agg["spec"][acc], (dec["spec"], agg["spec"])
    if method == "draft_model":  # the drafter is the target: its shipped KV decides the acceptance
        assert agg["spec"][acc] > 0, agg["spec"]
