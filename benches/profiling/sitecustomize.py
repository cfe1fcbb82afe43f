"""Profiling hook for benches/bench_served.py --profile (put this directory on PYTHONPATH).

When KVSLOTS_PROFILE_DIR is set, vLLM's engine core busy loop and its workers' busy loops run
under cProfile in whichever process runs them (the engine core process and the worker process of
the OpenAI server on CPU), and the stats are written to KVSLOTS_PROFILE_DIR/<what>.<pid>.prof
every 200 calls of the loop body and at exit (each dump replaces the last one atomically).
Nothing happens otherwise."""

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


if _DIR:
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _TARGETS:
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
                _patch(module, *_TARGETS[name])

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())
