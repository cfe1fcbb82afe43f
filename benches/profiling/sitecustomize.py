"""Profiling hook for benches/bench_served.py --profile (put this directory on PYTHONPATH).

When KVSLOTS_PROFILE_DIR is set, vLLM's engine core busy loop and its workers' busy loops run
under cProfile in whichever process runs them (the engine core process and the worker process of
the OpenAI server on CPU), and the stats are written to KVSLOTS_PROFILE_DIR/<what>.<pid>.prof
every 200 calls of the loop body and at exit (each dump replaces the last one atomically).
Nothing happens otherwise.

When KVSLOTS_STEPTIME_DIR is set instead, a handful of vLLM's per-step methods (the scheduler's
schedule and update_from_output, the engine core's step, the worker's RPCs and the model runner's
phases) are wrapped in a wall-clock timer, without cProfile's overhead, and the totals (calls,
seconds) are written to KVSLOTS_STEPTIME_DIR/steptime.<pid>.json every 200 engine/worker steps
and at exit: where a step's time goes in each process (summarize.py --steptime reads them)."""

import os
import sys

_DIR = os.environ.get("KVSLOTS_PROFILE_DIR")

#: module -> (class, loop method, per-step method, file prefix)
_TARGETS = {
    "vllm.v1.engine.core": ("EngineCoreProc", "run_busy_loop", "_process_engine_step", "engine_core"),
    "vllm.v1.executor.multiproc_executor": ("WorkerProc", "worker_busy_loop", "_execute_worker_rpc", "worker"),
}


def _patch(mod, cls_name, loop_name, step_name, what):
    import cProfile

    cls = getattr(mod, cls_name)
    orig_loop = getattr(cls, loop_name)
    orig_step = getattr(cls, step_name)
    state = {"prof": None, "n": 0}

    def dump():
        prof = state["prof"]
        if prof is not None:
            prof.disable()
            path = os.path.join(_DIR, f"{what}.{os.getpid()}.prof")
            prof.dump_stats(path + ".tmp")
            os.replace(path + ".tmp", path)
            prof.enable()

    def loop(self, *a, **kw):
        state["prof"] = cProfile.Profile()
        state["prof"].enable()
        try:
            return orig_loop(self, *a, **kw)
        finally:
            dump()
            state["prof"].disable()

    def step(self, *a, **kw):
        r = orig_step(self, *a, **kw)
        state["n"] += 1
        if state["n"] % 200 == 0:
            dump()
        return r

    setattr(cls, loop_name, loop)
    setattr(cls, step_name, step)


_STEP_DIR = os.environ.get("KVSLOTS_STEPTIME_DIR")

#: module -> [(class, method)]; the first method of each process's list triggers the dumps.
_STEP_TARGETS = {
    "vllm.v1.engine.core": [("EngineCore", "step"), ("EngineCore", "post_step"),
                            ("EngineCoreProc", "_process_input_queue"),
                            ("EngineCoreProc", "_process_engine_step")],
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule"), ("Scheduler", "update_from_output")],
    "vllm.v1.executor.multiproc_executor": [("WorkerProc", "_execute_worker_rpc"),
                                            ("WorkerProc", "handle_output")],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "execute_model"), ("GPUModelRunner", "sample_tokens"),
                                        ("GPUModelRunner", "_update_states"), ("GPUModelRunner", "_prepare_inputs"),
                                        ("GPUModelRunner", "_model_forward"),
                                        ("GPUModelRunner", "propose_draft_token_ids"),
                                        ("GPUModelRunner", "_bookkeeping_sync")],
}
_TRIGGERS = {"EngineCoreProc._process_engine_step", "WorkerProc._execute_worker_rpc"}
_totals: dict = {}


def _dump_steptime():
    import json

    path = os.path.join(_STEP_DIR, f"steptime.{os.getpid()}.json")
    try:
        with open(f"/proc/{os.getpid()}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = "?"
    with open(path + ".tmp", "w") as f:
        json.dump({"comm": comm, "totals": _totals}, f)
    os.replace(path + ".tmp", path)


def _time_methods(mod, targets):
    import time

    for cls_name, meth in targets:
        cls = getattr(mod, cls_name, None)
        orig = getattr(cls, meth, None) if cls is not None else None
        if orig is None:
            continue
        key = f"{cls_name}.{meth}"
        acc = _totals.setdefault(key, [0, 0.0])
        trigger = key in _TRIGGERS

        def timed(*a, _orig=orig, _acc=acc, _trigger=trigger, **kw):
            t = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                _acc[0] += 1
                _acc[1] += time.perf_counter() - t
                if _trigger and _acc[0] % 200 == 0:
                    _dump_steptime()

        setattr(cls, meth, timed)


def _on_import(targets: dict, apply) -> None:
    """Calls ``apply(module, targets[name])`` right after each module of ``targets`` is first
    imported (an import hook: these modules load after this file runs)."""
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in targets:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                apply(module, targets[name])

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())


if _STEP_DIR and not _DIR:
    import atexit

    atexit.register(lambda: _totals and _dump_steptime())
    _on_import(_STEP_TARGETS, _time_methods)

if _DIR:
    _on_import(_TARGETS, lambda module, target: _patch(module, *target))
