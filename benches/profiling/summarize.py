"""Where the time of a profiled served run went (``bench_served.py --profile DIR``).

    python benches/profiling/summarize.py DIR/kvslots-*/ DIR/none-*/ [--top 15]

For each directory (one server): the engine core's busy loop and the worker's, the time inside
the KVSlotsConnector's hooks (every function of ``kvslots/``, cumulative, as vLLM calls it), and
vLLM's top functions by own time. cProfile slows Python code down (roughly 1.5-2x), which
inflates the Python-heavy parts (ours and vLLM's scheduler) against the model's compute.
"""

from __future__ import annotations

import argparse
import glob
import os
import pstats

#: The connector's entry points vLLM calls, scheduler side then worker side.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "take_events", "has_pending_push_work",
         "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_block_ids_with_load_errors", "build_connector_worker_meta")


def _ours(path: str) -> bool:
    return f"{os.sep}kvslots{os.sep}" in path


def summarize(prof: str, top: int) -> None:
    st = pstats.Stats(prof)
    stats = st.stats  # type: ignore[attr-defined]
    total = max((ct for (f, _, name), (_, _, _, ct, _) in stats.items()
                 if name in ("run_busy_loop", "worker_busy_loop")), default=st.total_tt)  # type: ignore[attr-defined]
    print(f"\n{os.path.basename(os.path.dirname(prof))}/{os.path.basename(prof)}: busy loop {total:.2f} s")
    hooks = [(name, nc, ct) for (f, _, name), (_, nc, _, ct, _) in stats.items()
             if _ours(f) and name in HOOKS and "connector" in f]
    ours = sum(ct for _, _, ct in hooks)
    print(f"  inside the KVSlotsConnector's hooks: {ours:.3f} s = {100 * ours / total:.2f}% of the loop")
    for name, nc, ct in sorted(hooks, key=lambda h: -h[2]):
        print(f"    {name:32s} {nc:7d} calls {ct:8.3f} s {1e6 * ct / max(nc, 1):9.1f} us/call")
    print(f"  top {top} functions by own time (ours marked *):")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (f, line, name), (_, nc, tt, ct, _) in rows:
        mark = "*" if _ours(f) else " "
        short = f if len(f) < 60 else "..." + f[-57:]
        print(f"   {mark} {tt:8.3f} s {100 * tt / total:5.1f}%  {name} ({short}:{line}) x{nc}")


def steptime(d: str) -> None:
    """The wall-clock totals of a ``--steptime`` server: per process, each timed method's calls,
    seconds and milliseconds per engine step (EngineCore.step calls)."""
    import json

    files = sorted(glob.glob(os.path.join(d, "steptime.*.json")))
    if not files:
        print(f"{d}: no steptime files")
        return
    data = [json.load(open(f)) for f in files]
    steps = max((x["totals"].get("EngineCore.step", [0])[0] for x in data), default=0) or 1
    print(f"\n{d}: {steps} engine steps")
    for x, f in zip(data, files):
        rows = [(k, n, t) for k, (n, t) in x["totals"].items() if n]
        if not rows:
            continue
        print(f"  {x['comm']} ({os.path.basename(f)})")
        for k, n, t in sorted(rows, key=lambda r: -r[2]):
            print(f"    {k:40s} {n:7d} calls {t:8.3f} s {t / steps * 1e3:7.3f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--steptime", action="store_true", help="DIRS are bench_served.py --steptime directories")
    args = ap.parse_args()
    if args.steptime:
        for d in args.dirs:
            steptime(d)
        return
    for d in args.dirs:
        files = sorted(glob.glob(os.path.join(d, "*.prof")))
        if not files:
            print(f"{d}: no .prof files")
        for p in files:
            summarize(p, args.top)


if __name__ == "__main__":
    main()
