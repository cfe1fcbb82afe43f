"""Disaggregated prefill/decode with the real vLLM engine on CPU: a prefill engine (kv_producer)
and a decode engine (kv_consumer) in two processes, the KV of target and draft layers moved
over Mooncake on loopback. The decode engine's greedy outputs equal an aggregated engine's, it
computes one prompt token itself (not a block), with the drafter = the target it accepts as many
drafts as the aggregated run, the prefill engine frees every block it held once the decode
engine acked. Faults (a decode engine that never comes or dies, a prefill engine stopped or
killed during the pull, a hold that expired, mismatched models or block sizes): the request is
recomputed on the decode engine with the same output, and both pools end whole.

Each engine runs in its own process (tests/pd_engine_run.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import queue
import signal
import tempfile
import threading
import time

import pytest
from engine_procs import EngineProcess, InteractiveRun, own_core_env
from ports import free_port
from sigstop import sigstop

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


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    # 200 tokens: 6 full blocks + a partial one; 96: exactly 3 blocks (no partial block).
    return [[rng.randrange(3, 2000) for _ in range(200)], [rng.randrange(3, 2000) for _ in range(96)]]


def _start(spec: dict) -> EngineProcess:
    return EngineProcess(os.path.join(HERE, "pd_engine_run.py"), spec, timeout=900, GLOG_minloglevel="2")


_AGG: dict[tuple, EngineProcess] = {}


def _agg(models_dir: str, method: str | None, block_size: int = 32) -> dict:
    """The aggregated engine's run of _prompts() (one per configuration per test session)."""
    return _agg_started(models_dir, method, block_size).result()


def _agg_started(models_dir: str, method: str | None, block_size: int = 32) -> EngineProcess:
    """The aggregated run, started now unless it was before (it runs beside a test's engines)."""
    key = (models_dir, method, block_size)
    if key not in _AGG:
        _AGG[key] = _start({"models": models_dir, "method": method, "role": "aggregated", "prompts": _prompts(),
                            "max_tokens": MAX_TOKENS, "block_size": block_size})
    return _AGG[key]


class Engine:
    """A P/D engine process (tests/pd_engine_run.py) driven over stdin/stdout, forked from the
    pre-imported parent (engine_procs.InteractiveRun); several start side by side (their
    start-up is most of a test's time)."""

    def __init__(self, spec: dict):
        env = own_core_env(GLOG_minloglevel="2")
        fd, self.err_path = tempfile.mkstemp(prefix="pd-engine-", suffix=".err")
        os.close(fd)
        self.proc = InteractiveRun(os.path.join(HERE, "pd_engine_run.py"), [json.dumps(spec)], env, self.err_path)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def tail(self) -> str:
        with open(self.err_path, errors="replace") as f:
            return f.read()[-6000:]

    def expect(self, prefix: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s:\n{self.tail()}") from None
            if line is None:
                raise AssertionError(f"engine exited (rc {self.proc.wait()}) before {prefix!r}:\n{self.tail()}")
            if line.startswith(prefix):
                return line

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: dict, timeout: float = 600) -> dict:
        self.send(cmd)
        return json.loads(self.expect("RESULT ", timeout)[len("RESULT "):])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a test may have stopped it
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        else:
            self.proc.wait()
        os.unlink(self.err_path)


# All five speculative modes (none, EAGLE, EAGLE-3, draft model, n-gram) run served, through two
# `kvslots serve` and the proxy (tests/test_pd_served.py). Here, at engine level, the two whose
# drafter KV is shipped in layers of its own, with what only the engine shows: the layers
# shipped, the blocks pulled, both pools whole. (None and n-gram ran here too until the served
# test took them over, with EAGLE-3; the suite has a 30-minute budget.)
@pytest.mark.parametrize("method", ["eagle", "draft_model"], ids=str)
def test_pd_outputs_and_acceptance_equal_aggregated(models_dir, method):
    prompts = _prompts()
    prefill, decode = _pair(models_dir, free_port(), prefill={"method": method}, decode={"method": method})
    try:
        pre = prefill.call({"prompts": prompts})
        params = pre["params"]
        for p, prm in zip(prompts, params):
            assert prm["do_remote_prefill"] and prm["num_tokens"] == len(p)
            assert len(prm["remote_block_ids"]) >= -(-len(p) // 32)
        agg = _agg_started(models_dir, method)  # beside the decode engine
        dec = decode.call({"prompts": prompts, "params": params})
        held = prefill.call({"held": True, "wait_s": 30})
    finally:
        prefill.close()
        decode.close()
    agg = agg.result()
    assert dec["outputs"] == agg["outputs"]
    assert [o[0] for o in dec["outputs"]] == [f[0] for f in pre["first"]]
    # the decode engine computed the last prompt token only (the rest came from the prefill engine)
    assert all(n == 1 for n in dec["local_prompt_tokens"]), dec["local_prompt_tokens"]
    assert dec["pd"]["pulled_blocks"] == sum(-(-len(p) // 32) for p in prompts)
    assert dec["pd"]["failed_pulls"] == 0
    # the drafter's layers are in what was shipped (EAGLE: one more layer; a draft model = the
    # target: as many again)
    draft_layers = {"eagle": 1, "draft_model": dec["target_layers"]}[method]
    assert len(dec["segments"]) == dec["target_layers"] + draft_layers, dec["segments"]
    # the prefill engine freed every block it held, on the decode engine's acks (no timeout)
    assert held["held"] == 0 and held["free"] == held["baseline_free"], held
    assert held["stats"]["acks"] == len(prompts) and held["stats"]["expired"] == 0
    # and the decode engine's pool is whole again
    assert dec["free_end"] == dec["free_start"], dec
    acc = "vllm:spec_decode_num_accepted_tokens"
    # Accepted drafts are equal. (The decode engine verifies one more, wholly rejected round per
    # request than the aggregated one, which computes its whole prompt: vLLM's drafter does so
    # after any one-token prefill chunk, P/D or not; docs/pd.md.)
    assert dec["spec"][acc] == agg["spec"][acc], (dec["spec"], agg["spec"])
    if method == "draft_model":  # the drafter is the target: its shipped KV decides the acceptance
        assert agg["spec"][acc] > 0, agg["spec"]


def _pair(models_dir: str, port: int, prefill: dict | None = None, decode: dict | None = None) -> tuple[Engine, Engine]:
    """A prefill and a decode engine started side by side (EAGLE unless told), both READY."""
    p = Engine({"models": models_dir, "method": "eagle", "role": "prefill", "pd_port": port, **(prefill or {})})
    d = Engine({"models": models_dir, "method": "eagle", "role": "decode", "max_tokens": MAX_TOKENS,
                **(decode or {})})
    try:
        p.expect("READY")
        d.expect("READY")
    except BaseException:
        p.close()
        d.close()
        raise
    return p, d


def _assert_recomputed(dec: dict, prompts: list[list[int]], agg: dict) -> None:
    """The decode engine computed every prompt token itself, got the aggregated output, and its
    pool is whole."""
    assert dec["outputs"] == agg["outputs"][:len(prompts)]
    assert dec["local_prompt_tokens"] == [len(p) for p in prompts], dec["local_prompt_tokens"]
    assert dec["free_end"] == dec["free_start"], dec


def test_decode_never_comes_then_a_late_pull_is_recomputed(models_dir):
    """No decode engine within pd_timeout_s: the prefill engine frees every held block. A decode
    engine that comes after that (a restarted one, with the old hand-off) reads, learns from the
    ack that the hold was gone, and recomputes: stale bytes are never used."""
    prompts = _prompts()
    prefill, decode = _pair(models_dir, free_port(), prefill={"pd_timeout_s": 2}, decode={"pd_timeout_s": 5})
    try:
        pre = prefill.call({"prompts": prompts})
        held = prefill.call({"held": True, "wait_s": 60})
        assert held["held"] == 0 and held["free"] == held["baseline_free"], held
        assert held["stats"]["expired"] == len(prompts) and held["stats"]["acks"] == 0, held
        dec = decode.call({"prompts": prompts, "params": pre["params"]})
        after = prefill.call({"held": True})
    finally:
        prefill.close()
        decode.close()
    assert dec["pd"]["failed_pulls"] == len(prompts), dec["pd"]
    _assert_recomputed(dec, prompts, _agg(models_dir, "eagle"))
    # the late acks were answered "not held" and changed nothing on the prefill side
    assert after["stats"]["acks"] == len(prompts) and after["held"] == 0, after
    assert after["free"] == after["baseline_free"], after


@pytest.mark.parametrize("fault", ["prefill_stopped", "prefill_killed", "decode_killed"])
def test_a_peer_fault_during_the_pull(models_dir, fault):
    """The decode engine shook hands with the prefill engine and is about to read the blocks when
    the fault strikes. A stopped prefill engine: Mooncake's read times out, the ack too, the
    request is recomputed; once the prefill engine runs again its hold times out and frees. A
    killed prefill engine: the read fails, recomputed (its pool died with it). A killed decode
    engine: the prefill engine frees the blocks after pd_timeout_s.

    The stopped prefill engine is one the decode engine has pulled from before: Mooncake knows
    the peer, so the read gives up at the transfer timeout, which the decode engine's
    pd_timeout_s (3 s) caps. (A first contact waits on Mooncake's own segment hand-shake, a fixed
    60 s in 0.3.13; docs/pd.md.)"""
    stopped = fault == "prefill_stopped"
    prompts = _prompts()[:2] if stopped else _prompts()[:1]
    prefill, decode = _pair(models_dir, free_port(), prefill={"pd_timeout_s": 10},
                            decode={"pd_timeout_s": 3, "pause_pull": 3, "pause_after": int(stopped)})
    try:
        pre = prefill.call({"prompts": prompts})
        decode.send({"prompts": prompts, "params": pre["params"]})
        decode.expect("PULL", timeout=120)
        t0 = time.monotonic()
        if fault == "prefill_stopped":
            sigstop(prefill.proc.pid)
        elif fault == "prefill_killed":
            prefill.proc.kill()
        else:
            decode.proc.kill()
        if fault != "decode_killed":
            try:
                dec = json.loads(decode.expect("RESULT ", timeout=180)[len("RESULT "):])
            finally:
                if fault == "prefill_stopped":
                    os.kill(prefill.proc.pid, signal.SIGCONT)
            waited = time.monotonic() - t0
            assert dec["pd"]["failed_pulls"] == 1, dec["pd"]
            agg = _agg(models_dir, "eagle")
            if stopped:  # the first prompt was pulled (one prompt token computed), the second not
                assert dec["pd"]["pulled_blocks"] == -(-len(prompts[0]) // 32), dec["pd"]
                assert dec["local_prompt_tokens"][0] == 1, dec["local_prompt_tokens"]
                assert dec["outputs"][0] == agg["outputs"][0]
                dec = {**dec, "outputs": dec["outputs"][1:], "local_prompt_tokens": dec["local_prompt_tokens"][1:]}
                agg = {"outputs": agg["outputs"][1:]}
                # the read gave up at pd_timeout_s, not at Mooncake's 30 s: pause 3 s, read 3 s,
                # ack 2 x 3 s, then the recompute
                assert waited < 28, waited
            _assert_recomputed(dec, prompts[1:] if stopped else prompts, agg)
        if fault != "prefill_killed":
            held = prefill.call({"held": True, "wait_s": 60})
            assert held["held"] == 0 and held["free"] == held["baseline_free"], held
            assert held["stats"]["expired"] == 1, held
    finally:
        prefill.close()
        decode.close()
    if fault != "decode_killed":
        print(f"{fault}: the decode engine answered {waited:.1f} s after the fault")


@pytest.mark.parametrize("mismatch", ["model", "block_size"])
def test_mismatched_engines_recompute_and_free_the_prefill(models_dir, mismatch):
    """A decode engine with another drafter (so another model key and layout) or another block
    size: the request is computed on the decode engine, and its ack frees the prefill engine's
    blocks at once (no timeout)."""
    prompts = _prompts()[:1]
    # (vLLM's CPU attention takes multiples of 32 only)
    prefill, decode = {"model": ({}, {"method": None}), "block_size": ({"block_size": 64}, {})}[mismatch]
    agg = _agg_started(models_dir, None if mismatch == "model" else "eagle")  # beside the pair
    prefill, dec_engine = _pair(models_dir, free_port(), prefill={"pd_timeout_s": 120, **prefill}, decode=decode)
    try:
        pre = prefill.call({"prompts": prompts})
        dec = dec_engine.call({"prompts": prompts, "params": pre["params"]})
        held = prefill.call({"held": True, "wait_s": 30})
    finally:
        prefill.close()
        dec_engine.close()
    if mismatch == "model":  # found at the hand-shake: a failed pull
        assert dec["pd"]["failed_pulls"] == 1 and dec["pd"]["pulled_blocks"] == 0, dec["pd"]
    else:  # found in the hand-off itself: never pulled
        assert dec["pd"]["failed_pulls"] == 0 and dec["pd"]["pulled_blocks"] == 0, dec["pd"]
    _assert_recomputed(dec, prompts, agg.result())
    assert held["held"] == 0 and held["free"] == held["baseline_free"], held
    assert held["stats"]["acks"] == 1 and held["stats"]["expired"] == 0, held


def test_kv_events_of_both_engines_keep_the_indexer_true(models_dir):
    """Both engines publish vLLM's KV events (ZMQ, with replay) to a kvslots indexer. After a
    P/D request the indexer scores the decode engine for every full block of the prompt: vLLM
    caches the pulled blocks like computed ones (BlockStored, medium GPU), so received blocks
    count as the decode engine's (and the connector stores them in its host tier, medium CPU).
    The prefill engine keeps its score after it freed its hold: freed blocks stay in vLLM's
    prefix cache (a request there would hit them) and vLLM reports a removal only when a block
    is evicted or the cache is reset; after a reset only its host-tier copies count, and its
    score drops below the decode engine's."""
    from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec

    prompt = _prompts()[0]
    full = len(prompt) // 32
    ports = {w: (free_port(), free_port()) for w in ("prefill", "decode")}

    def events(w: str) -> dict:
        return {"endpoint": f"tcp://*:{ports[w][0]}", "replay_endpoint": f"tcp://*:{ports[w][1]}"}

    svc = IndexerService(IndexerConfig(
        workers=[WorkerSpec(w, f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}", topic="kv") for w, (a, b) in ports.items()],
        block_size=32, replay_timeout=1.0, capacity=None))
    svc.start()

    def blocks() -> dict[str, tuple[int, int, int]]:  # worker -> (blocks, GPU-tier, CPU-tier blocks)
        ws = svc.score(prompt, 32, None, None)["workers"]
        return {w: (e["blocks"], e["tiers"]["GPU"]["blocks"], e["tiers"]["CPU"]["blocks"]) for w, e in ws.items()}

    def wait(cond, what: str) -> dict:
        deadline = time.monotonic() + 60
        while not cond(b := blocks()):
            assert time.monotonic() < deadline, f"indexer: {what}: {b}"
            time.sleep(0.1)
        return b

    prefill, decode = _pair(models_dir, free_port(), prefill={"kv_events": events("prefill")},
                            decode={"kv_events": events("decode"), "linger": True})
    try:
        assert blocks() == {"prefill": (0, 0, 0), "decode": (0, 0, 0)}
        pre = prefill.call({"prompts": [prompt]})
        wait(lambda b: b["prefill"][:2] == (full, full), "the prefill engine's blocks")
        assert blocks()["decode"] == (0, 0, 0)
        dec = decode.call({"prompts": [prompt], "params": pre["params"]})
        assert dec["pd"]["pulled_blocks"] == -(-len(prompt) // 32) and dec["pd"]["failed_pulls"] == 0, dec["pd"]
        held = prefill.call({"held": True, "wait_s": 30})
        assert held["held"] == 0 and held["free"] == held["baseline_free"], held
        # the received blocks are the decode engine's: in vLLM's cache (GPU) and, once the
        # connector stored them, in its host tier (CPU); the prefill engine's are still cached
        # after its hold was freed (no removal reported), on both tiers
        both = {"prefill": (full, full, full), "decode": (full, full, full)}
        wait(lambda b: b == both, "the received blocks as the decode engine's")
        assert prefill.call({"reset": True})["reset"]
        # vLLM's AllBlocksCleared clears the prefill engine's GPU tier; its host tier keeps them
        b = wait(lambda b: b["prefill"][1] == 0, "the prefill engine's cache reset")
        assert b == {"prefill": (full, 0, full), "decode": (full, full, full)}, b
        ws = svc.score(prompt, 32, None, None)["workers"]
        assert 0 < ws["prefill"]["score"] < ws["decode"]["score"], ws
    finally:
        prefill.close()
        decode.close()
        svc.stop()
