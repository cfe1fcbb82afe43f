"""Engine processes side by side: each test-runner script (engine_run.py, sched_engine_run.py)
runs with one JSON argument and prints one ``RESULT <json>`` line.

vLLM's CPU backend binds its worker's OpenMP threads to core 0 unless told otherwise, so two
engines started plainly would share one core; each process started here gets a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``), round robin over the cores this process may use. On one core
they simply share it.

Each run is forked from a parent that has imported vLLM already (tests/engine_zygote.py, one per
script and environment): the import is 14 s of CPU per process. The same holds for the runs
tests drive over stdin and stdout (:class:`InteractiveRun`, the P/D engines), through two FIFOs.
``KVSLOTS_TEST_NO_ZYGOTE=1`` starts every run as a plain ``python SCRIPT ARG`` instead.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

_CORES = sorted(os.sched_getaffinity(0))
_next_core = itertools.cycle(_CORES)


def own_core_env(**extra: str) -> dict[str, str]:
    """The environment for the next engine process: this one's, bound to the next core."""
    env = dict(os.environ, **extra)
    if len(_CORES) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(next(_next_core))
    return env


# Read per run, after the fork (vLLM reads the binding when the worker starts; pytest names the
# current test): runs differing only here share a parent.
_RUNTIME_ENV = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "PYTEST_CURRENT_TEST"})


class _Zygote:
    """One engine_zygote.py process for ``script`` and one environment (less ``_RUNTIME_ENV``)."""

    def __init__(self, script: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "engine_zygote.py"),
                                       script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        self._next = 0
        self._answers: dict[int, dict] = {}
        self._changed = threading.Condition(self._lock)
        self._ready = threading.Event()
        self._dead = False  # the parent exited: every run still waiting fails
        threading.Thread(target=self._read, daemon=True, name="engine-zygote-reader").start()

    def _read(self) -> None:
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "READY":
                self._ready.set()
                continue
            msg = json.loads(line)
            with self._lock:
                self._answers.setdefault(msg["id"], {}).update(msg)
                self._changed.notify_all()
        with self._lock:
            self._dead = True
            self._changed.notify_all()
        self._ready.set()

    def _write(self, msg: dict) -> None:
        self._proc.stdin.write((json.dumps(msg) + "\n").encode())
        self._proc.stdin.flush()

    def spawn(self, args: list[str], env: dict[str, str], out: str | None = None, err: str | None = None,
              stdin: str | None = None) -> "_ZygoteRun":
        """A run; its stdout and stderr go to ``out`` and ``err`` (temporary files when not
        given, read and removed by ``communicate``), its stdin comes from ``stdin`` (a FIFO) or
        /dev/null."""
        self._ready.wait(600)
        paths = []
        for given, suffix in ((out, ".out"), (err, ".err")):
            if given is None:
                f = tempfile.NamedTemporaryFile(prefix="engine-run-", suffix=suffix, delete=False)
                f.close()
                given = f.name
            paths.append(given)
        req = {"args": args, "env": env, "out": paths[0], "err": paths[1], **({"in": stdin} if stdin else {})}
        with self._lock:
            rid = self._next
            self._next += 1
            self._write({"id": rid, **req})
        return _ZygoteRun(self, rid, paths[0], paths[1])

    def wait(self, rid: int, key: str, timeout: float | None) -> dict:
        with self._lock:
            ok = self._changed.wait_for(lambda: key in self._answers.get(rid, {}) or self._dead, timeout)
            if not ok or key not in self._answers.get(rid, {}):
                raise TimeoutError(f"engine run {rid}: no {key!r} (parent gone: {self._dead})")
            return self._answers[rid]

    def answer(self, rid: int) -> dict:
        with self._lock:
            return dict(self._answers.get(rid, {}))

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(30)
        except Exception:  # noqa: BLE001 - at exit: make sure it goes
            self._proc.kill()


class _ZygoteRun:
    def __init__(self, zygote: _Zygote, rid: int, out: str, err: str) -> None:
        self._z, self._rid, self._out, self._err = zygote, rid, out, err
        self.returncode: int | None = None

    def communicate(self, timeout: float) -> tuple[str, str]:
        try:
            msg = self._z.wait(self._rid, "rc", timeout)
        except TimeoutError:
            self.kill()
            msg = self._z.wait(self._rid, "rc", 60)
        self.returncode = msg["rc"]
        texts: list[str] = []
        for path in (self._out, self._err):
            with open(path, errors="replace") as f:
                texts.append(f.read())
            os.unlink(path)
        return texts[0], texts[1]

    # What subprocess.Popen gives, for a run driven over its stdin / stdout (InteractiveRun).
    # The child is this process's own user's: it is signalled directly, not through the parent.
    @property
    def pid(self) -> int:
        return self._z.wait(self._rid, "pid", 600)["pid"]

    def poll(self) -> int | None:
        self.returncode = self._z.answer(self._rid).get("rc")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            self.returncode = self._z.wait(self._rid, "rc", timeout)["rc"]
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"engine run {self._rid}", timeout or 0) from None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_ZYGOTES: dict[tuple, _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


@atexit.register
def _close_zygotes() -> None:
    for z in _ZYGOTES.values():
        z.close()


def _zygote_for(script: str, env: dict[str, str]) -> _Zygote | None:
    if os.environ.get("KVSLOTS_TEST_NO_ZYGOTE"):
        return None
    key = (os.path.abspath(script), frozenset((k, v) for k, v in env.items() if k not in _RUNTIME_ENV))
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            _ZYGOTES[key] = _Zygote(script, {k: v for k, v in env.items() if k not in _RUNTIME_ENV})
        return _ZYGOTES[key]


class EngineProcess:
    """A runner script started now; :meth:`result` waits for its RESULT line."""

    def __init__(self, script: str, spec: dict, timeout: float = 1200, **env: str):
        env = own_core_env(**env)
        self._timeout = timeout
        self._result: dict | list | None = None
        zygote = _zygote_for(script, env)
        if zygote is not None:
            self._proc = zygote.spawn([json.dumps(spec)], env)
        else:
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


class InteractiveRun:
    """A runner script driven over its stdin and stdout (one line per command and answer), with
    what tests use of ``subprocess.Popen``: ``stdin``, ``stdout``, ``pid``, ``poll``, ``wait``,
    ``kill``; stderr goes to ``err_path``. Forked from the script's zygote where there is one,
    its stdin and stdout are then two FIFOs."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], err_path: str):
        zygote = _zygote_for(script, env)
        self._fifos: str | None = None
        self._stdout = None
        if zygote is None:
            with open(err_path, "w") as err:
                self._proc = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            self.stdin, self._stdout = self._proc.stdin, self._proc.stdout
            return
        self._fifos = tempfile.mkdtemp(prefix="engine-fifo-")
        fin, self._fout = os.path.join(self._fifos, "in"), os.path.join(self._fifos, "out")
        os.mkfifo(fin)
        os.mkfifo(self._fout)
        self._proc = zygote.spawn(args, env, out=self._fout, err=err_path, stdin=fin)
        self.stdin = self._open_writer(fin)

    def _open_writer(self, path: str):
        """The FIFO's write end, once the child has opened its read end (its first step)."""
        deadline = time.monotonic() + 600
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:  # ENXIO: no reader yet
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"engine run never opened its stdin (rc {self._proc.poll()})") from e
                time.sleep(0.01)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w")

    @property
    def stdout(self):
        if self._stdout is None:  # blocks until the child has opened its end
            self._stdout = open(self._fout)
        return self._stdout

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        rc = self._proc.wait(timeout)
        if self._fifos is not None:
            shutil.rmtree(self._fifos, ignore_errors=True)
        return rc

    def kill(self) -> None:
        self._proc.kill()


def run_side_by_side(script: str, specs: list[dict], timeout: float = 1200) -> list:
    """The results of ``specs``, as many running at once as there are cores."""
    results: list = []
    for i in range(0, len(specs), len(_CORES)):
        procs = [EngineProcess(script, spec, timeout) for spec in specs[i:i + len(_CORES)]]
        results += [p.result() for p in procs]
    return results
