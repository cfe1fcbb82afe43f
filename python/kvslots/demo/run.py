"""``kvslots demo``: the whole of kvslots on one machine, with no weights downloaded.

1. Builds a tiny random-weight Llama target and its EAGLE / EAGLE-3 heads locally (cached).
2. Starts ``kvslots serve`` (vLLM's OpenAI server on CPU) with speculative decoding, the
   KVSlotsConnector (host-memory tier) and KV events on.
3. Starts an in-process ``kvslots indexer`` subscribed to the server's KV event stream (vLLM's
   device-tier events and the connector's host-tier events travel on it together).
4. Sends requests sharing a long prefix, asks the indexer which worker holds how much of it,
   resets vLLM's device prefix cache, repeats a request (now served from the host tier), and
   shows the host-tier hits, the speculative-decoding acceptance counts and the index's scores.
5. Stops the server cleanly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from ..errors import ServeError

BLOCK_SIZE = 32
MODEL_NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()
    except (OSError, ValueError) as e:  # HTTPError, URLError, a timeout, an answer that is not JSON
        raise ServeError(f"{method} {url}: {e}") from None


#: The demo server's --max-model-len, and the tokens each request adds to the shared prefix.
MAX_MODEL_LEN = 2048
SUFFIX_LEN = 40


def check_args(args: argparse.Namespace) -> None:
    """Refuses, before anything is built or started, what the demo cannot run: a ServeError
    naming the flag (a zero --requests was an IndexError, --max-tokens 0 vLLM's 400 as a
    traceback, a NaN --timeout a server started and given up at once)."""
    from ..config.connector import ConnectorConfig
    from ..config.loader import text_problem
    from ..errors import ConfigError

    def bad(flag: str, value: Any, why: str) -> ServeError:
        return ServeError(f"{flag} {value!r}: {why}")

    if not 1 <= args.k <= 64:
        raise bad("-k", args.k, "must be in [1, 64]")
    if not 1 <= args.requests <= 1000:
        raise bad("--requests", args.requests, "must be in [1, 1000]")
    if args.prefix_len < 0 or args.max_tokens < 1 \
            or args.prefix_len + SUFFIX_LEN + args.max_tokens > MAX_MODEL_LEN:
        raise ServeError(f"--prefix-len {args.prefix_len} and --max-tokens {args.max_tokens}: need "
                         f"--prefix-len >= 0, --max-tokens >= 1 and their sum <= {MAX_MODEL_LEN - SUFFIX_LEN} "
                         f"(the demo's model length, less {SUFFIX_LEN} tokens per prompt)")
    try:  # the connector's own rule for the size
        cfg = ConnectorConfig(host_cache_gb=args.host_cache_gb)
    except ConfigError:
        raise bad("--host-cache-gb", args.host_cache_gb, "must be a number of GiB > 0 and < 2**20") from None
    try:  # kvslots serve's check (1e-300 holds not one byte): it failed only once the models were built
        cfg.check_tiers_hold_a_block()
    except ConfigError:
        raise bad("--host-cache-gb", args.host_cache_gb, "holds no block (not one byte)") from None
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise bad("--timeout", args.timeout, "must be a finite number of seconds > 0")
    # The configuration paths' rule: a name with bytes that are no UTF-8 (a lone surrogate here)
    # had the target model written there, then the tokenizer failed (files left, progress bars
    # and the error on stderr); a NUL failed only after the ~5 s of importing torch.
    problem = text_problem(args.cache_dir)
    if problem:
        raise bad("--cache-dir", args.cache_dir, f"{problem}: a directory kvslots can write models to")


def _metrics(base: str) -> dict[str, float]:
    """The counters the demo reports, summed over label sets, from vLLM's /metrics."""
    wanted = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total", "vllm:prefix_cache_hits_total",
              "vllm:prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
              "vllm:external_prefix_cache_queries_total")
    out = dict.fromkeys(wanted, 0.0)
    for line in _http("GET", base + "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServeError(f"kvslots serve exited with status {proc.returncode} before it was ready "
                             "(--verbose shows its output)")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise ServeError(f"the server was not ready after {timeout:.0f} s (--timeout)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..indexer.config import IndexerConfig, WorkerSpec
    from ..indexer.service import IndexerService
    from .._dev.tiny import build_tiny_models

    check_args(args)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    models = build_tiny_models(args.cache_dir)
    log(f"[1/5] tiny random-weight models in {args.cache_dir}")
    http, events, replay = _free_port(), _free_port(), _free_port()
    base = f"http://127.0.0.1:{http}"

    draft = models["target"] if args.method == "draft_model" else models[args.method]
    spec = {"method": args.method, "model": draft, "num_speculative_tokens": args.k}
    cmd = [sys.executable, "-m", "kvslots", "serve", models["target"],
           "--speculative-config", json.dumps(spec), "--host-cache-gb", str(args.host_cache_gb),
           "--kv-events-endpoint", f"tcp://[::ffff:127.0.0.1]:{events}",
           "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
           "--kv-events-topic", "kv", "--host", "127.0.0.1", "--port", str(http), "--",
           "--served-model-name", MODEL_NAME, "--enforce-eager", "--dtype", "float32",
           "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_SERVER_DEV_MODE="1")  # dev mode: /reset_prefix_cache
    log("[2/5] starting kvslots serve (vLLM on CPU; this takes a minute or two here)")
    proc = subprocess.Popen(cmd, env=env, stdout=None if args.verbose else subprocess.DEVNULL,
                            stderr=None if args.verbose else subprocess.DEVNULL, start_new_session=True)
    indexer = IndexerService(IndexerConfig(
        workers=[WorkerSpec("worker-0", f"tcp://127.0.0.1:{events}", replay=f"tcp://127.0.0.1:{replay}", topic="kv")],
        block_size=BLOCK_SIZE))
    try:
        _wait_healthy(base, proc, args.timeout)
        indexer.start()
        log(f"[3/5] kvslots indexer (in-process) subscribed to the server's KV events, tcp://127.0.0.1:{events}")
        report = _workload(base, indexer, args, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        indexer.stop()
    log("[5/5] server stopped")
    return report


def _workload(base: str, indexer: Any, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    rng = random.Random(args.seed)
    shared = [rng.randrange(3, 2000) for _ in range(args.prefix_len)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(SUFFIX_LEN)] for _ in range(args.requests)]

    def complete(tokens: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = _http("POST", base + "/v1/completions", {"model": MODEL_NAME, "prompt": tokens,
                                                       "max_tokens": args.max_tokens, "temperature": 0,
                                                       "ignore_eos": True, "return_token_ids": True})
        choice = out["choices"][0]
        return choice.get("token_ids") or choice["text"], time.perf_counter() - t0

    def score(tokens: list[int]) -> dict[str, Any]:
        time.sleep(1.0)  # events are published asynchronously
        return indexer.score(tokens, BLOCK_SIZE, None, None)["workers"]["worker-0"]

    log(f"[4/5] {args.requests} requests sharing a {args.prefix_len}-token prefix ({args.method}, K={args.k})")
    first = [complete(p) for p in prompts]
    before_reset = score(prompts[0])
    ok = _http("POST", base + "/reset_prefix_cache")
    complete([7, 8, 9])  # vLLM publishes the reset (AllBlocksCleared) with its next step
    after_reset = score(prompts[0])
    m0 = _metrics(base)
    again, t_again = complete(prompts[0])
    m1 = _metrics(base)
    host_hit_tokens = m1["vllm:external_prefix_cache_hits_total"] - m0["vllm:external_prefix_cache_hits_total"]
    return {
        "requests": args.requests,
        "prefix_len": args.prefix_len,
        "identical_after_reset": again == first[0][0],
        "device_cache_reset": ok,
        "host_tier_hit_tokens_on_repeat": host_hit_tokens,
        "latency_first_s": first[0][1],
        "latency_repeat_from_host_s": t_again,
        "spec_decode": {k.split("vllm:spec_decode_")[1]: v for k, v in m1.items() if "spec_decode" in k},
        "prefix_cache": {k.split("vllm:")[1]: v for k, v in m1.items() if "prefix_cache" in k},
        "indexer_before_reset": before_reset,
        "indexer_after_reset": after_reset,
    }


def format_report(r: dict[str, Any]) -> str:
    sd = r["spec_decode"]
    acc = sd["num_accepted_tokens_total"] / sd["num_draft_tokens_total"] if sd["num_draft_tokens_total"] else 0.0

    def tiers(s: dict[str, Any]) -> str:
        return ", ".join(f"{t} {s['tiers'][t]['tokens']} tokens" for t in s["tiers"]) + f"; score {s['score']:.1f}"

    return "\n".join([
        f"requests sharing a {r['prefix_len']}-token prefix: {r['requests']}",
        f"speculative decoding: {sd['num_drafts_total']:.0f} drafts, {sd['num_draft_tokens_total']:.0f} draft tokens, "
        f"{sd['num_accepted_tokens_total']:.0f} accepted ({acc:.0%})",
        f"indexer, shared prefix, before the device reset: {tiers(r['indexer_before_reset'])}",
        f"indexer, shared prefix, after the device reset:  {tiers(r['indexer_after_reset'])}",
        f"repeat after the device reset: {r['host_tier_hit_tokens_on_repeat']:.0f} tokens loaded from the host tier, "
        f"output identical: {r['identical_after_reset']}",
        f"latency: first {r['latency_first_s'] * 1e3:.0f} ms, repeat from host tier {r['latency_repeat_from_host_s'] * 1e3:.0f} ms",
    ])


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve a tiny local model with the connector, events and the indexer, and show what happens",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=["draft_model", "eagle", "eagle3"], default="draft_model",
                   help="speculative method; draft_model uses the target itself (100%% acceptance), "
                        "the tiny random EAGLE heads accept almost nothing (default %(default)s)")
    p.add_argument("-k", type=int, default=3, help="draft tokens per step ([1, 64]; default %(default)s)")
    p.add_argument("--requests", type=int, default=4,
                   help="requests sharing the prefix ([1, 1000]; default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=320,
                   help=f"tokens of the shared prefix (with --max-tokens, at most {MAX_MODEL_LEN - SUFFIX_LEN}; "
                        "default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens generated per request (>= 1; default %(default)s)")
    p.add_argument("--host-cache-gb", type=float, default=0.25,
                   help="host-memory tier in GiB (> 0 and < 2**20, room for one block at least; "
                        "default %(default)s)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kvslots", "tiny-models"),
                   help="directory the tiny models are built in once and reused from (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds to wait for the server (> 0; default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the prompts (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verbose", action="store_true", help="show the server's output")
    p.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    """The command; a KVSlotsError (a server that does not come up) is raised, for
    :func:`kvslots.cli.main` to print as one line (exit status 2)."""
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _main(args: argparse.Namespace) -> int:
    """``kvslots demo`` run as :func:`kvslots.cli.main` runs it (a KVSlotsError: one line, 2)."""
    from ..cli import run_command

    return run_command(_show, args, "kvslots demo")
