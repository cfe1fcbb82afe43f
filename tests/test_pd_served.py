"""Served disaggregated prefill/decode end to end: ``kvslots serve --is-prefill-worker``,
``kvslots serve --role decode`` (EAGLE, tiny models, CPU) and ``kvslots proxy`` in front. The
proxy's greedy answer equals the one the prefill server gives computing the request alone, the
decode server computed one prompt token itself (vLLM's prompt-token counters), and the prefill
server freed the blocks it held for the decode server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "..", "python")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    return build_tiny_models(str(tmp_path_factory.mktemp("tiny-pd-served")))


def test_served_pd_through_the_proxy(models, tmp_path):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", GLOG_minloglevel="2",
               VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join(p for p in [PKG, os.environ.get("PYTHONPATH")] if p))
    spec = json.dumps({"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3})
    tail = ["--", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--dtype", "float32"]
    p_port, d_port, x_port, pd_port = _port(), _port(), _port(), _port()
    procs: list[subprocess.Popen] = []
    logs = {}

    def start(name: str, argv: list[str], core: int | None = None) -> None:
        logs[name] = open(tmp_path / f"{name}.log", "w+")
        e = dict(env)
        if core is not None and (os.cpu_count() or 1) > 1:
            # vLLM's CPU workers both bind to core 0 by default; the prefill server's busy loop
            # (it steps while it holds blocks) then starves the decode server's worker.
            e["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        procs.append(subprocess.Popen([sys.executable, "-m", "kvslots", *argv], env=e, stdout=logs[name],
                                      stderr=subprocess.STDOUT, start_new_session=True))

    def log_tail(name: str) -> str:
        logs[name].flush()
        return (tmp_path / f"{name}.log").read_text()[-5000:]

    def pd_lines(name: str) -> str:
        logs[name].flush()
        return "\n".join(line for line in (tmp_path / f"{name}.log").read_text().splitlines()
                         if "kvslots" in line or "Mooncake" in line or "Error" in line)[-6000:]

    def wait_up(name: str, url: str, proc: subprocess.Popen) -> None:
        t0 = time.time()
        while True:
            assert proc.poll() is None, f"{name} exited:\n{log_tail(name)}"
            assert time.time() - t0 < 600, f"{name}: no answer after 600 s:\n{log_tail(name)}"
            try:
                _get(url)
                return
            except OSError:
                time.sleep(1)

    try:
        start("prefill", ["serve", models["target"], "--is-prefill-worker", "--pd-port", str(pd_port), "--port",
                          str(p_port), "--speculative-config", spec, "--no-kv-events", "--host-cache-gb", "0.05", *tail], core=0)
        start("decode", ["serve", models["target"], "--role", "decode", "--port", str(d_port), "--speculative-config",
                         spec, "--no-kv-events", "--host-cache-gb", "0.05", *tail], core=1)
        start("proxy", ["proxy", "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
                        "--port", str(x_port)])
        wait_up("prefill", f"http://127.0.0.1:{p_port}/health", procs[0])
        wait_up("decode", f"http://127.0.0.1:{d_port}/health", procs[1])
        wait_up("proxy", f"http://127.0.0.1:{x_port}/healthz", procs[2])

        prompt = [(i * 37) % 1900 + 3 for i in range(200)]  # 6 full blocks and a partial one
        body = {"model": models["target"], "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        req = urllib.request.Request(f"http://127.0.0.1:{x_port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.headers["x-kvslots-pd"] == "disaggregated", log_tail("proxy")
            pd_out = json.load(r)
        metrics = _get(f"http://127.0.0.1:{d_port}/metrics")
        local = _metric(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute")
        pulled = _metric(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        # vLLM counts the whole prompt as transferred (the last token it recomputes is not "local")
        assert local < 32 and pulled >= len(prompt) - 32, (local, pulled, pd_lines("decode"), pd_lines("prefill"))
        # The reference: the prefill server computing the whole request alone (same config).
        ref = _post(f"http://127.0.0.1:{p_port}/v1/completions", body)
        assert pd_out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert pd_out["usage"]["completion_tokens"] == 12
        # The prefill server freed what it held: its held requests went back (the decode acked).
        deadline = time.time() + 30
        while time.time() < deadline and "freeing its blocks" not in log_tail("prefill"):
            text = _get(f"http://127.0.0.1:{p_port}/metrics")
            if _metric(text, "vllm:num_requests_running") == 0:
                break
            time.sleep(0.5)
        assert "no decode worker took request" not in log_tail("prefill")
        assert "kvslots P/D: request" not in pd_lines("decode"), pd_lines("decode")  # no failed pull
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs.values():
            f.close()
