"""Served traffic, with and without the KVSlotsConnector, driven by vLLM's own serving benchmark.

For each model, ``--rounds`` rounds (default 4, even: each mode goes first in half of them);
each round runs both modes back to back (the order alternates from one round to the next), each
on a fresh server, after the previous server's whole process group has exited. Before round 0,
``--warmup`` discarded runs of each mode (fewer prompts, another seed) warm what a first server
would otherwise pay for (imports, page cache) so that it cannot land on one mode:

  server   ``kvslots serve MODEL`` (vLLM's OpenAI server; ``--no-connector`` for the baseline),
           EAGLE K=3, 96 device blocks of 32 tokens (``--num-gpu-blocks-override``), fp32, eager,
           vLLM's KV events on (as ``kvslots serve`` sets them), on free loopback ports;
  client   ``vllm.benchmarks.serve`` in-process, dataset ``prefix_repetition``: 8 prefixes of
           1,024 tokens, 64-token suffixes, 64 output tokens (``--ignore-eos``), all requests at
           once under ``--max-concurrency``. The prefixes (256 blocks) do not fit in the 96
           device blocks, so repeats must come from the host tier;
  metrics  vLLM's /metrics before and after: ``prompt_tokens_cached_by_source{source=host|device}``,
           ``prompt_tokens``, failed requests.

Printed per model: output tok/s and mean TTFT of every run, the median over rounds of each
mode, the spread (min-max), the ratios (connector / none, per round and the median), prompt
tokens from host / device, and the hit rate against the ideal (every full block of a prompt
that an earlier prompt shares, minus what EAGLE cannot serve: see ``ideal_cached_tokens``).
Position: a round's two runs are paired by round; the ratios of the rounds where ``none`` ran
first and of those where ``kvslots`` did are shown apart, with the first / second run's
throughput of every round (the position effect, whatever the mode), and the position-balanced
ratio, the geometric mean of the two groups' medians: a slowdown of whichever server runs first
multiplies one group's ratios by f and the other's by 1/f, and cancels there.

    PYTHONPATH=python python benches/bench_served.py                          # both models, 4 rounds
    PYTHONPATH=python python benches/bench_served.py --models tiny --rounds 7
    PYTHONPATH=python python benches/bench_served.py --rounds tiny=4,real=3 --json r.json --plot r.png
    PYTHONPATH=python python benches/bench_served.py --profile /tmp/prof      # cProfile the engine core
    PYTHONPATH=python python benches/bench_served.py --models tiny --order kvslots,kvslots,none,none --steptime /tmp/st
        # a forced run order; wall-clock totals of vLLM's per-step methods (profiling/summarize.py --steptime)

Every run also prints its engine steps (vLLM's iteration-tokens histogram) and the server's CPU
seconds per 1,000 output tokens (``/proc``, every thread of ``kvslots serve`` and its children,
sampled at the client's start and end); the summary breaks them down per process/thread name.
    PYTHONPATH=python python benches/bench_served.py --slot-manager kvslots   # both servers in scheduler mode

``--baseline-root DIR`` adds a third mode, ``baseline``: the connector of another kvslots checkout
(built: ``DIR/python/kvslots/_core.abi3.so``), served by that checkout's own ``kvslots serve``
with the same core reservation as the current connector's server, so that only the connector's
code differs. The three modes rotate their order from round to round (use a multiple of 3
rounds); the summary adds the ratios baseline / none and kvslots / baseline, per round.

    git archive e1bbb45 | tar -x -C /tmp/first && (cd /tmp/first && cargo build --release -p kvslots-python \
        && cp target/release/lib_core.so python/kvslots/_core.abi3.so)
    PYTHONPATH=python python benches/bench_served.py --models tiny --rounds 6 --baseline-root /tmp/first

``--slot-manager {vllm,kvslots}`` picks the device KV manager of both servers (default ``vllm``:
vLLM's own, so the connector is compared with plain vLLM). It is always passed on to
``kvslots serve``, whose own default is scheduler mode.

The models are built locally (``kvslots._dev.tiny``): ``tiny`` (2 layers, hidden 128) and ``real``
(8 layers, hidden 1024, 16 heads, 4 KV heads, MLP 2,048; fp32) with their EAGLE heads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BLOCK = 32
DEVICE_BLOCKS = 96

MODES = ("none", "kvslots")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dims: dict
    prompts: int
    concurrency: int


MODELS = {
    "tiny": ModelSpec("tiny", {}, prompts=128, concurrency=8),
    "real": ModelSpec("real", {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2048},
                      prompts=32, concurrency=4),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_models(spec: ModelSpec, root: str) -> dict[str, str]:
    from kvslots._dev.tiny import TINY, Dims, build_tiny_models

    dims = Dims(**spec.dims) if spec.dims else TINY
    return build_tiny_models(os.path.join(root, spec.name), dims)


# ----------------------------------------------------------------------------- the server


class Server:
    """``kvslots serve`` in its own process group, stopped with SIGINT (then harder)."""

    health_path = "/health"

    def __init__(self, models: dict[str, str], mode: str, args: argparse.Namespace, log_path: str) -> None:
        self.port = free_port()
        ev, replay = free_port(), free_port()
        spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3}
        cmd = [sys.executable, "-m", "kvslots", "serve", models["target"],
               "--speculative-config", json.dumps(spec), "--port", str(self.port),
               "--kv-events-endpoint", f"tcp://[::ffff:127.0.0.1]:{ev}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "-q"]
        # Always explicit: kvslots serve's own default is scheduler mode.
        base = getattr(args, "baseline_root", None) if mode == "baseline" else None
        if base is None or _cli_knows(base, "--slot-manager"):
            cmd += ["--slot-manager", args.slot_manager]
        if mode == "none":
            cmd.append("--no-connector")
        else:
            cmd += ["--host-cache-gb", str(args.host_cache_gb)]
        cmd += ["--", "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK),
                "--num-gpu-blocks-override", str(getattr(args, "device_blocks", DEVICE_BLOCKS)), "--max-model-len", "2048",
                "--max-num-seqs", str(args.max_num_seqs), "--seed", "0", "--disable-uvicorn-access-log",
                *(getattr(args, "vllm_arg", None) or [])]
        env = dict(os.environ)
        src = os.path.join(base or ROOT, "python")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if base is not None:
            # The reservation today's kvslots serve gives its connector server (an earlier one
            # may not set it): the worker gets the same cores in every mode.
            from kvslots.vllm.cpu_cores import connector_cpu_env

            env.update(connector_cpu_env(1, env))
        for kv in (args.env or []) + ((args.env_none or []) if mode == "none" else (args.env_kvslots or [])):
            # (--env-kvslots applies to both connector servers, today's and the baseline's)
            k, _, v = kv.partition("=")
            env[k] = v
        if getattr(args, "steptime", None):
            env["PYTHONPATH"] = os.pathsep.join((os.path.join(HERE, "profiling"), env["PYTHONPATH"]))
            env["KVSLOTS_STEPTIME_DIR"] = os.path.join(args.steptime, f"{mode}-{int(time.time())}")
            os.makedirs(env["KVSLOTS_STEPTIME_DIR"], exist_ok=True)
            self.steptime_dir = env["KVSLOTS_STEPTIME_DIR"]
        if args.profile:
            env["PYTHONPATH"] = os.pathsep.join((os.path.join(HERE, "profiling"), env["PYTHONPATH"]))
            env["KVSLOTS_PROFILE_DIR"] = os.path.join(args.profile, f"{mode}-{int(time.time())}")
            os.makedirs(env["KVSLOTS_PROFILE_DIR"], exist_ok=True)
            self.profile_dir = env["KVSLOTS_PROFILE_DIR"]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        # The API server exits before its engine core: the next server must not start while
        # this one's processes still run (or free their memory) beside it.
        if not _wait_group_gone(self.proc.pid, 60):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            _wait_group_gone(self.proc.pid, 30)
        self.log.close()


def _cli_knows(root: str, flag: str) -> bool:
    """Whether the ``kvslots serve`` of checkout ``root`` has ``flag`` (read from its source: an
    earlier one had no ``--slot-manager``)."""
    for path in ("python/kvslots/serve/cli.py", "python/kvslots/serve.py"):
        with contextlib.suppress(OSError):
            with open(os.path.join(root, path)) as f:
                return f'"{flag}"' in f.read()
    return False


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Waits until no process is left in process group ``pgid``; False on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of the group we may not signal: still there
            pass
        time.sleep(0.2)
    return False


_METRIC = re.compile(r'^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$')


def parse_metrics(text: str) -> dict[str, float]:
    """The counters this bench reads, summed over engines: ``name`` or ``name{source}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        src = re.search(r'source="([a-z_]+)"', labels)
        key = f"{name}{{{src.group(1)}}}" if src else name
        out[key] = out.get(key, 0.0) + value
    return out


# ----------------------------------------------------------------------------- per-thread CPU


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants: ``kvslots serve``, and the vLLM server it starts in a
    new session (API server, engine core, worker)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        # ppid is the 2nd field after the ")" that closes comm (comm may hold spaces or parens).
        parent[int(d)] = int(st[st.rindex(")") + 2:].split()[1])
    out = [root] if root in parent else []
    for pid in out:  # grows while it is walked: breadth first
        out.extend(c for c, pp in parent.items() if pp == pid)
    return out


def thread_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) per ``process/thread`` name of every live thread of ``root``
    and its descendants (a process's main thread apart from its other threads of the same name);
    threads of one name in one process are summed (vLLM names its processes through comm)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/comm") as f:
                pname = f.read().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            tname = st[st.index("(") + 1: st.rindex(")")]
            rest = st[st.rindex(")") + 2:].split()
            cpu = (int(rest[11]) + int(rest[12])) / tick  # utime, stime: fields 14 and 15
            # Python threads keep their process's comm: the main thread is told apart by tid.
            key = f"{pname}/{tname}" + ("" if int(tid) == pid else " (other threads)")
            out[key] = out.get(key, 0.0) + cpu
    return out


def start_perf(root: int, path: str) -> subprocess.Popen:
    """``perf record`` (call graphs, 499 Hz) of every thread of the server's processes until
    SIGINT; read it with ``perf report -i PATH --no-children --sort comm,dso``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pids = ",".join(str(p) for p in process_tree(root))
    proc = subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", pids, "-o", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the first request
    return proc


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two samples, per thread name (threads started in between
    count from zero; those that ended in between are lost)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


# ----------------------------------------------------------------------------- the client


def run_client(server: Server, model_dir: str, spec: ModelSpec, seed: int) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    args = p.parse_args([
        "--backend", "vllm", "--base-url", server.url, "--model", model_dir,
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
        "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "8",
        "--prefix-repetition-output-len", "64", "--num-prompts", str(spec.prompts),
        "--max-concurrency", str(spec.concurrency), "--ignore-eos", "--temperature", "0",
        "--seed", str(seed), "--num-warmups", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el",
    ])
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        result = asyncio.run(main_async(args))
    return result


def ideal_cached_tokens(prompts: list[list[int]], eagle: bool) -> int:
    """Prompt tokens a perfect two-tier cache serves: for each prompt in arrival order, the full
    blocks it shares with any earlier prompt (never the block holding its last token: vLLM
    computes at least one), and for EAGLE-family drafters the last shared block only when the
    token after it is the same too (its draft KV depends on that token)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for toks in prompts:
        full = (len(toks) - 1) // BLOCK
        hit = 0
        while hit < full and tuple(toks[: (hit + 1) * BLOCK]) in seen:
            hit += 1
        if eagle and hit > 0:
            nxt = tuple(toks[: hit * BLOCK + 1])
            if nxt not in seen:
                hit -= 1
        total += hit * BLOCK
        for b in range(1, len(toks) // BLOCK + 1):
            seen.add(tuple(toks[: b * BLOCK]))
            if b * BLOCK < len(toks):
                seen.add(tuple(toks[: b * BLOCK + 1]))
    return total


def dataset_prompts(model_dir: str, spec: ModelSpec, seed: int) -> list[list[int]]:
    """The benchmark's prompts as token ids, in the order it sends them (same seed, same sampler)."""
    import random

    import numpy as np
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(model_dir)
    random.seed(seed)
    np.random.seed(seed)
    ds = PrefixRepetitionRandomDataset(random_seed=seed)
    reqs = ds.sample(tok, spec.prompts, prefix_len=1024, suffix_len=64, num_prefixes=8, output_len=64)
    return [tok.encode(r.prompt, add_special_tokens=False) for r in reqs]


# ----------------------------------------------------------------------------- one run


def one_run(models: dict[str, str], spec: ModelSpec, mode: str, seed: int, args: argparse.Namespace,
            logdir: str, rnd: int | None = None, position: int | None = None) -> dict:
    import gc

    gc.collect()  # the client runs in this process: no run inherits another's garbage
    log = os.path.join(logdir, f"{spec.name}-{mode}-{seed}-{int(time.time())}.log")
    server = Server(models, mode, args, log)
    try:
        server.wait_ready(args.start_timeout)
        before = server.metrics()
        cpu0 = thread_cpu(server.proc.pid)
        perf_dir = getattr(args, "perf", None)  # bench_served_sched's namespace has none
        perf = start_perf(server.proc.pid, os.path.join(perf_dir, f"{spec.name}-{mode}-{seed}-{int(time.time())}.data")
                          ) if perf_dir else None
        try:
            r = run_client(server, models["target"], spec, seed)
        finally:
            cpu1 = thread_cpu(server.proc.pid)
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(120)
        time.sleep(1.5)  # the engine's last stats reach /metrics
        after = server.metrics()
    finally:
        server.stop()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {
        "mode": mode, "seed": seed, "round": rnd, "position": position,
        "output_tps": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
        "median_ttft_ms": r["median_ttft_ms"], "mean_tpot_ms": r.get("mean_tpot_ms"),
        "completed": r["completed"], "failed": r.get("failed", spec.prompts - r["completed"]),
        "duration_s": r["duration"], "total_input_tokens": r["total_input_tokens"],
        "host_tokens": d.get("vllm:prompt_tokens_cached_by_source{host}", 0.0),
        "device_tokens": d.get("vllm:prompt_tokens_cached_by_source{device}", 0.0),
        "prompt_tokens": d.get("vllm:prompt_tokens", 0.0),
        "preemptions": d.get("vllm:num_preemptions", 0.0),
        "accepted": d.get("vllm:spec_decode_num_accepted_tokens", 0.0),
        "drafts": d.get("vllm:spec_decode_num_draft_tokens", 0.0),
        "output_tokens": r.get("total_output_tokens", 0),
        # Engine steps (vLLM observes its iteration-tokens histogram once per step) and the
        # tokens they scheduled: output tok/s = tokens per step / time per step.
        "steps": d.get("vllm:iteration_tokens_total_count", 0.0),
        "step_tokens": d.get("vllm:iteration_tokens_total_sum", 0.0),
        "thread_cpu_s": cpu_delta(cpu0, cpu1),
        "log": log,
    }
    if args.profile:
        out["profile_dir"] = server.profile_dir
    if getattr(args, "steptime", None):
        out["steptime_dir"] = server.steptime_dir
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(name: str, runs: list[dict], ideal: dict[int, int]) -> dict:
    by = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    s: dict = {"model": name}
    for m in MODES:
        rs = by[m]
        s[m] = {k: med([r[k] for r in rs]) for k in ("output_tps", "mean_ttft_ms", "host_tokens", "device_tokens")}
        s[m]["tps_range"] = (min(r["output_tps"] for r in rs), max(r["output_tps"] for r in rs)) if rs else None
        s[m]["ttft_range"] = (min(r["mean_ttft_ms"] for r in rs), max(r["mean_ttft_ms"] for r in rs)) if rs else None
        s[m]["failed"] = sum(r["failed"] for r in rs)
    # A round's two runs, paired by round (by seed for runs saved without one).
    key = "round" if all(r.get("round") is not None for r in runs) else "seed"
    pairs = [(a, b) for a in by["none"] for b in by["kvslots"] if a[key] == b[key]]
    s["tps_ratios"] = [b["output_tps"] / a["output_tps"] for a, b in pairs]
    s["ttft_ratios"] = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in pairs]
    # By which mode ran first in the round (known when positions were recorded).
    for first in ("none", "kvslots"):
        sel = [(a, b) for a, b in pairs if (a if first == "none" else b).get("position") == 0]
        s[f"tps_ratios_{first}_first"] = [b["output_tps"] / a["output_tps"] for a, b in sel]
        s[f"ttft_ratios_{first}_first"] = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in sel]
    s["first_over_second_tps"] = [
        (a if a.get("position") == 0 else b)["output_tps"] / (b if a.get("position") == 0 else a)["output_tps"]
        for a, b in pairs if {a.get("position"), b.get("position")} == {0, 1}]
    for k in ("tps", "ttft"):
        g1, g2 = s[f"{k}_ratios_none_first"], s[f"{k}_ratios_kvslots_first"]
        s[f"{k}_balanced"] = (med(g1) * med(g2)) ** 0.5 if g1 and g2 else None
    hit = [(r["host_tokens"] + r["device_tokens"]) / ideal[r["seed"]] for r in by["kvslots"] if ideal.get(r["seed"])]
    s["hit_vs_ideal"] = hit
    if "baseline" in MODES:
        for num, den in (("baseline", "none"), ("kvslots", "baseline")):
            pr = [(a, b) for a in by[den] for b in by[num] if a[key] == b[key]]
            s[f"tps_ratios_{num}_{den}"] = [b["output_tps"] / a["output_tps"] for a, b in pr]
            s[f"ttft_ratios_{num}_{den}"] = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in pr]
        s["hit_vs_ideal_baseline"] = [(r["host_tokens"] + r["device_tokens"]) / ideal[r["seed"]]
                                      for r in by["baseline"] if ideal.get(r["seed"])]
    s["ideal_tokens"] = med(list(ideal.values()))
    return s


def print_summary(s: dict, spec: ModelSpec) -> None:
    print(f"\n== {s['model']}: {spec.prompts} prompts, concurrency {spec.concurrency}, EAGLE K=3, "
          f"{DEVICE_BLOCKS} device blocks of {BLOCK}; median of {len(s['tps_ratios'])} rounds (min-max)")
    print(f"  {'mode':14s} {'output tok/s':>22s} {'mean TTFT ms':>24s} {'host / device prompt tokens':>30s} failed")
    for m in (m for m in ("none", "baseline", "kvslots") if m in s):  # a saved run's modes
        x = s[m]
        if x["tps_range"] is None:
            continue
        print(f"  {m:14s} {x['output_tps']:8.2f} ({x['tps_range'][0]:6.2f}-{x['tps_range'][1]:6.2f}) "
              f"{x['mean_ttft_ms']:9.0f} ({x['ttft_range'][0]:6.0f}-{x['ttft_range'][1]:6.0f}) "
              f"{x['host_tokens']:14,.0f} / {x['device_tokens']:9,.0f}   {x['failed']}")
    if s["tps_ratios"]:
        tr, fr = s["tps_ratios"], s["ttft_ratios"]
        print(f"  kvslots / none: output tok/s {med(tr):.3f}x ({min(tr):.3f}-{max(tr):.3f}), "
              f"mean TTFT {med(fr):.3f}x ({min(fr):.3f}-{max(fr):.3f})")
        print("    per round: " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(tr, fr)))
    for first in MODES:
        g = s.get(f"tps_ratios_{first}_first") or []
        if g:
            f = s[f"ttft_ratios_{first}_first"]
            print(f"    rounds with {first} first ({len(g)}): output tok/s {med(g):.3f}x ({min(g):.3f}-{max(g):.3f}), "
                  f"mean TTFT {med(f):.3f}x")
    fs = s.get("first_over_second_tps") or []
    if fs:
        print(f"    first run / second run of a round, output tok/s: {med(fs):.3f} ({min(fs):.3f}-{max(fs):.3f}) "
              f"(position effect, whichever mode)")
    if s.get("tps_balanced") is not None:
        print(f"  position-balanced ratio (geometric mean of the two groups' medians): output tok/s "
              f"{s['tps_balanced']:.3f}x, mean TTFT {s['ttft_balanced']:.3f}x")
    elif s["tps_ratios"]:
        print("  (no position-balanced ratio: each mode must run first in at least one round; use an even --rounds)")
    for num, den in (("baseline", "none"), ("kvslots", "baseline")):
        tr, fr = s.get(f"tps_ratios_{num}_{den}") or [], s.get(f"ttft_ratios_{num}_{den}") or []
        if tr:
            print(f"  {num} / {den}: output tok/s {med(tr):.3f}x ({min(tr):.3f}-{max(tr):.3f}), "
                  f"mean TTFT {med(fr):.3f}x ({min(fr):.3f}-{max(fr):.3f})")
            print("    per round: " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(tr, fr)))
    for label, k in (("", "hit_vs_ideal"), (" (baseline)", "hit_vs_ideal_baseline")):
        h = s.get(k) or []
        if h:
            print(f"  cached prompt tokens (host + device) / ideal{label} ({s['ideal_tokens']:,.0f}): {med(h):.3f} "
                  f"({min(h):.3f}-{max(h):.3f})")


def plot(out: dict, path: str) -> None:
    """Bar chart of the per-round ratios (connector / none) per model: output tok/s and mean TTFT,
    median with the min-max range. Needs matplotlib (any interpreter: --from-json)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label, target in ((axes[0], "tps_ratios", "output tok/s, kvslots / none", None),
                                   (axes[1], "ttft_ratios", "mean TTFT, kvslots / none", None)):
        meds = [med(out["summary"][n][key]) for n in names]
        lo = [m - min(out["summary"][n][key]) for n, m in zip(names, meds)]
        hi = [max(out["summary"][n][key]) - m for n, m in zip(names, meds)]
        bars = ax.bar(names, meds, yerr=[lo, hi], capsize=6, color=["#4c72b0", "#dd8452"][: len(names)])
        ax.axhline(1.0, color="black", linewidth=0.8)
        for b, m in zip(bars, meds):
            ax.text(b.get_x() + b.get_width() / 2, m, f"{m:.2f}x", ha="center", va="bottom")
        ax.set_title(label, fontsize=10)
    rounds = {n: len(out["summary"][n]["tps_ratios"]) for n in names}
    fig.suptitle("kvslots serve, EAGLE K=3, prefix_repetition (vLLM's serving benchmark); median of "
                 + ", ".join(f"{n} {r} rounds" for n, r in rounds.items()) + " (bars: min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global MODES  # three with --baseline-root
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    ap.add_argument("--rounds", type=_rounds, default=_rounds("4"),
                    help="rounds per model: N for every model, or per model as tiny=4,real=2 (even: each mode "
                         "goes first equally often)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="discarded warm-up runs of each mode per model before round 0 (default 1; 0: none)")
    ap.add_argument("--warmup-prompts", type=int, default=16,
                    help="prompts of a warm-up run (at least the dataset's 8 prefixes)")
    ap.add_argument("--first", choices=MODES, default="none", help="mode run first in round 0")
    ap.add_argument("--order", type=_order, metavar="M,M,...",
                    help="run the modes in exactly this order instead of alternating rounds, e.g. "
                         "kvslots,kvslots,none,none (each mode equally often; the i-th run of each mode "
                         "forms round i; replaces --rounds and --first)")
    ap.add_argument("--prompts", type=int, help="override the model's number of prompts")
    ap.add_argument("--concurrency", type=int, help="override the model's max concurrency")
    ap.add_argument("--seed", type=int, default=0, help="seed of round 0 (round r uses seed + r)")
    ap.add_argument("--same-seed", action="store_true", help="every round uses the same prompts")
    ap.add_argument("--slot-manager", choices=("kvslots", "vllm"), default="vllm",
                    help="device KV manager of both servers, passed as kvslots serve --slot-manager: "
                         "vllm (default: vLLM's own; the connector is compared with plain vLLM) or "
                         "kvslots (scheduler mode)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--vllm-arg", action="append", metavar="ARG",
                    help="one more vLLM argument for both servers (repeat; e.g. --vllm-arg=--enable-logging-iteration-details)")
    ap.add_argument("--device-blocks", type=int, default=DEVICE_BLOCKS,
                    help=f"device KV blocks of both servers (default {DEVICE_BLOCKS}: the prefixes do not fit, "
                         "repeats must come from the host tier; more: less admission pressure)")
    ap.add_argument("--host-cache-gb", type=float, default=1.0)
    ap.add_argument("--model-root", default="/tmp/kvslots-served-models")
    ap.add_argument("--logdir", default=None, help="server logs (default: a temporary directory)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--profile", metavar="DIR", help="cProfile the engine core and time the connector's hooks")
    ap.add_argument("--perf", metavar="DIR", help="perf record every server thread during each run's client "
                    "(one DIR/MODEL-MODE-SEED-TIME.data per run; needs perf)")
    ap.add_argument("--steptime", metavar="DIR", help="wall-clock totals of vLLM's per-step methods in the "
                    "engine core and worker (no cProfile; read with profiling/summarize.py --steptime)")
    ap.add_argument("--json", metavar="FILE", help="write every run and the summaries")
    ap.add_argument("--env", action="append", metavar="K=V", help="environment of both servers")
    ap.add_argument("--env-none", action="append", metavar="K=V", help="environment of the no-connector server")
    ap.add_argument("--env-kvslots", action="append", metavar="K=V", help="environment of the connector server "
                    "(e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0 reproduces vLLM's reservation without kvslots serve)")
    ap.add_argument("--baseline-root", metavar="DIR",
                    help="a built checkout of an earlier kvslots: adds its connector as a third mode, baseline "
                         "(rounds rotate the three modes' order; use a multiple of 3)")
    ap.add_argument("--plot", metavar="PNG", help="chart of the ratios (needs matplotlib)")
    ap.add_argument("--from-json", metavar="FILE", nargs="+",
                    help="only print and plot saved runs (several files: their models together)")
    args = ap.parse_args()
    if args.baseline_root:
        so = os.path.join(args.baseline_root, "python", "kvslots", "_core.abi3.so")
        if not os.path.exists(so):
            ap.error(f"--baseline-root {args.baseline_root!r}: no {so} (build that checkout's extension first)")
        if args.order:
            ap.error("--order takes the two modes none and kvslots only; not with --baseline-root")
        MODES = ("none", "baseline", "kvslots")
    if args.from_json:
        out = {"runs": {}, "summary": {}}
        for path in args.from_json:
            with open(path) as f:
                one = json.load(f)
            out["runs"].update(one["runs"])
            out["summary"].update(one["summary"])
        for name, s in out["summary"].items():
            base = MODELS[name]
            spec = ModelSpec(name, base.dims, s.get("prompts", base.prompts), s.get("concurrency", base.concurrency))
            print_summary(s, spec)
        if args.plot:
            plot(out, args.plot)
        return
    logdir = args.logdir or tempfile.mkdtemp(prefix="kvslots-served-")
    os.makedirs(logdir, exist_ok=True)
    out: dict = {"runs": {}, "summary": {}, "uptime_before": _uptime(),
                 "slot_manager": args.slot_manager}
    print(f"bench_served: slot manager {out['slot_manager']}; logs in {logdir}; load before: {out['uptime_before']}",
          flush=True)
    for name in args.models.split(","):
        spec = MODELS[name]
        if args.prompts or args.concurrency:
            spec = ModelSpec(spec.name, spec.dims, args.prompts or spec.prompts, args.concurrency or spec.concurrency)
        models = build_models(spec, args.model_root)
        runs: list[dict] = []
        ideal: dict[int, int] = {}
        order = list(MODES) if args.first == "none" else list(reversed(MODES))
        n_rounds = args.rounds.get(name, args.rounds.get("*", 4))
        if args.order:
            n_rounds = len(args.order) // 2
        # Every round's ideal first: the client's tokenizer work must not precede one run only.
        for rnd in range(n_rounds):
            seed = args.seed if args.same_seed else args.seed + rnd
            if seed not in ideal:
                ideal[seed] = ideal_cached_tokens(dataset_prompts(models["target"], spec, seed), eagle=True)
        if n_rounds % len(MODES) and not args.order:
            print(f"  note: {n_rounds} rounds, not a multiple of {len(MODES)}: the modes do not run first "
                  "equally often", flush=True)
        warm = ModelSpec(spec.name, spec.dims, min(max(args.warmup_prompts, 8), spec.prompts), spec.concurrency)
        for w in range(args.warmup):
            for mode in (order if w % 2 == 0 else order[::-1]):
                r = one_run(models, warm, mode, args.seed + 10_000 + w, args, logdir)
                print(f"  {name} warm-up {w} {mode:8s} (discarded): {r['output_tps']:8.2f} tok/s, "
                      f"mean TTFT {r['mean_ttft_ms']:8.0f} ms, {r['duration_s']:.0f} s", flush=True)
        for rnd, position, mode in schedule(args.order, n_rounds, order):
            seed = args.seed if args.same_seed else args.seed + rnd
            r = one_run(models, spec, mode, seed, args, logdir, rnd, position)
            runs.append(r)
            cpu = sum(r["thread_cpu_s"].values()) / max(r["output_tokens"], 1) * 1000
            print(f"  {name} round {rnd} {mode:8s}: {r['output_tps']:8.2f} tok/s, mean TTFT {r['mean_ttft_ms']:8.0f} ms, "
                  f"host/device {r['host_tokens']:,.0f}/{r['device_tokens']:,.0f} (ideal {ideal[seed]:,}), "
                  f"failed {r['failed']}, {r['duration_s']:.0f} s, {r['steps']:,.0f} steps "
                  f"({r['duration_s'] / max(r['steps'], 1) * 1e3:.2f} ms each), "
                  f"server CPU {cpu:.2f} s per 1k output tokens; "
                  f"load {_uptime()}", flush=True)
        s = summarize(name, runs, ideal)
        s["prompts"], s["concurrency"] = spec.prompts, spec.concurrency
        print_summary(s, spec)
        print_thread_cpu(runs)
        out["runs"][name], out["summary"][name] = runs, s
        _save(out, args.json)  # after each model: a run cut short keeps what it measured
    out["uptime_after"] = _uptime()
    print(f"\nload after: {out['uptime_after']}")
    _save(out, args.json)
    if args.plot:
        try:
            plot(out, args.plot)
        except ImportError:
            print("--plot needs matplotlib: save --json and render with --from-json FILE --plot PNG "
                  "under an interpreter that has it")


def _save(out: dict, path: str | None) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)


def _rounds(text: str) -> dict[str, int]:
    """``--rounds``: "3" (every model) or "tiny=4,real=3"."""
    out: dict[str, int] = {}
    try:
        for part in text.split(","):
            name, eq, n = part.rpartition("=")
            if eq and name not in MODELS:
                raise ValueError(f"unknown model {name!r}")
            out[name if eq else "*"] = int(n)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--rounds {text!r}: {e}") from None
    if any(n < 1 for n in out.values()):
        raise argparse.ArgumentTypeError(f"--rounds {text!r}: at least 1 round")
    return out


def _order(text: str) -> list[str]:
    """``--order``: modes, comma-separated, each as often as the other."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"--order {text!r}: unknown mode {bad[0]!r} (expected {', '.join(MODES)})")
    if not modes or modes.count(MODES[0]) != modes.count(MODES[1]):
        raise argparse.ArgumentTypeError(f"--order {text!r}: each mode must appear equally often (at least once)")
    return modes


def schedule(order_arg: list[str] | None, n_rounds: int, order: list[str]) -> list[tuple[int, int, str]]:
    """The runs as (round, position in its round, mode). Default: ``n_rounds`` rounds of both
    modes, ``order`` first in even rounds and reversed in odd ones. With ``--order``: the runs in
    that order, the i-th run of each mode in round i (position 0: it ran before the other mode's)."""
    if not order_arg:
        if len(order) > 2:  # three modes: each round the order rotates by one
            return [(rnd, pos, mode) for rnd in range(n_rounds)
                    for pos, mode in enumerate(order[rnd % len(order):] + order[:rnd % len(order)])]
        return [(rnd, pos, mode) for rnd in range(n_rounds)
                for pos, mode in enumerate(order if rnd % 2 == 0 else order[::-1])]
    seen = {m: 0 for m in MODES}
    out = []
    for mode in order_arg:
        rnd = seen[mode]
        seen[mode] += 1
        other = [m for m in MODES if m != mode][0]
        out.append((rnd, 0 if seen[other] <= rnd else 1, mode))
    return out


def print_thread_cpu(runs: list[dict]) -> None:
    """Server CPU seconds per 1,000 output tokens, per process/thread name: the median over each
    mode's runs, busiest first (sampled from /proc at the client's start and end)."""
    per = {m: [r for r in runs if r["mode"] == m and r.get("thread_cpu_s") is not None] for m in MODES}
    if not all(per.values()):
        return

    def norm(r: dict) -> dict[str, float]:
        k = max(r.get("output_tokens") or 0, 1) / 1000
        return {t: v / k for t, v in r["thread_cpu_s"].items()}

    rows = {m: [norm(r) for r in per[m]] for m in MODES}
    names = sorted({t for m in MODES for x in rows[m] for t in x})
    table = {t: [med([x.get(t, 0.0) for x in rows[m]]) for m in MODES] for t in names}
    print("  server CPU s per 1k output tokens, per process/thread (median over runs): "
          + " / ".join(MODES))
    tot = [med([sum(x.values()) for x in rows[m]]) for m in MODES]
    print(f"    {'all threads':50s} " + " ".join(f"{v:8.3f}" for v in tot))
    for t in sorted(names, key=lambda t: -max(table[t]))[:16]:
        if max(table[t]) >= 0.005:
            print(f"    {t:50s} " + " ".join(f"{v:8.3f}" for v in table[t]))


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
