"""`POST /score` over HTTP: uvicorn's own HTTP protocol against kvslots' guarded one
(kvslots.indexer.httpguard.uvicorn_options: head size and read-time limits, no WebSockets), same
app, same run.

Each variant is a fresh `kvslots indexer` app in its own process (embedded defaults, no
workers); one keep-alive httpx client sends 200 warm-up and then `--requests` scores of a
512-token prompt. Variants alternate (A, B, B, A, ...) `--repeats` times; the median and the
spread of the per-request time are printed, and the ratio guard / plain.

    python benches/bench_indexer_http.py [--requests 3000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

SERVER = r'''
import sys, uvicorn
from kvslots.indexer.config import IndexerConfig
from kvslots.indexer.service import IndexerService
from kvslots.indexer.app import create_app
from kvslots.indexer.httpguard import uvicorn_options
cfg = IndexerConfig()
app = create_app(IndexerService(cfg), own_service=True)
kw = uvicorn_options() if sys.argv[2] == "guard" else {}  # what `kvslots indexer` runs
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False, **kw)
'''

def free_port() -> int:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def run(mode: str, n: int) -> float:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(port), mode])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(url + "/healthz", timeout=0.5); break
            except Exception:
                time.sleep(0.1)
        body = json.dumps({"token_ids": list(range(512))})
        with httpx.Client(base_url=url) as c:
            for _ in range(200):
                c.post("/score", content=body, headers={"content-type": "application/json"})
            t = time.perf_counter()
            for _ in range(n):
                r = c.post("/score", content=body, headers={"content-type": "application/json"})
            dt = (time.perf_counter() - t) / n * 1e6
            assert r.status_code == 200, r.text
        return dt
    finally:
        p.terminate(); p.wait()

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    res: dict[str, list[float]] = {"plain": [], "guard": []}
    for i in range(args.repeats):
        for m in ("guard", "plain") if i % 2 else ("plain", "guard"):
            res[m].append(run(m, args.requests))
            print(f"  {m:5s} {res[m][-1]:7.1f} us/request", flush=True)
    for m, v in res.items():
        print(f"{m}: median {statistics.median(v):.1f} us/request (min {min(v):.1f}, max {max(v):.1f})")
    print(f"guard / plain: {statistics.median(res['guard']) / statistics.median(res['plain']):.3f}")


if __name__ == "__main__":
    main()
