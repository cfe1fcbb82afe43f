"""Engine processes side by side: each test-runner script (engine_run.py, sched_engine_run.py)
runs with one JSON argument and prints one ``RESULT <json>`` line.

vLLM's CPU backend binds its worker's OpenMP threads to core 0 unless told otherwise, so two
engines started plainly would share one core; each process started here gets a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``), round robin over the cores this process may use. On one core
they simply share it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

_CORES = sorted(os.sched_getaffinity(0))
_next_core = itertools.cycle(_CORES)


def own_core_env(**extra: str) -> dict[str, str]:
    """The environment for the next engine process: this one's, bound to the next core."""
    env = dict(os.environ, **extra)
    if len(_CORES) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(next(_next_core))
    return env


class EngineProcess:
    """A runner script started now; :meth:`result` waits for its RESULT line."""

    def __init__(self, script: str, spec: dict, timeout: float = 1200, **env: str):
        env = own_core_env(**env)
        self._timeout = timeout
        self._result: dict | list | None = None
        self._proc = subprocess.Popen([sys.executable, script, json.dumps(spec)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)

    def result(self):
        if self._result is None:
            try:
                out, err = self._proc.communicate(timeout=self._timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                out, err = self._proc.communicate()
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert self._proc.returncode == 0 and lines, f"engine run failed:\n{out[-3000:]}\n{err[-6000:]}"
            self._result = json.loads(lines[-1][len("RESULT "):])
        return self._result


def run_side_by_side(script: str, specs: list[dict], timeout: float = 1200) -> list:
    """The results of ``specs``, as many running at once as there are cores."""
    results: list = []
    for i in range(0, len(specs), len(_CORES)):
        procs = [EngineProcess(script, spec, timeout) for spec in specs[i:i + len(_CORES)]]
        results += [p.result() for p in procs]
    return results
