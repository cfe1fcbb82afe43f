"""A pre-imported parent for the engine runner scripts (engine_run.py, sched_engine_run.py, ...):
``from vllm import LLM`` costs about 14 s of CPU per process here, more than most engine runs
themselves. This process runs a script's module-level code (its environment settings), imports
vLLM once, then forks one child per run; each child calls the script's ``main()`` as a fresh
``python SCRIPT ARG`` would, with its own environment, stdout and stderr files.

    python engine_zygote.py SCRIPT

Protocol, one JSON object per line: requests on stdin, ``{"id", "args", "env", "out", "err"}``
and optionally ``"in"`` (a run; ``in`` and ``out`` may be FIFOs, for a run driven over them);
answers on stdout, ``{"id", "pid"}`` once forked and
``{"id", "rc"}`` when the child exits (rc as subprocess gives it). ``READY`` comes first. EOF on
stdin ends it. Single-threaded on purpose: a fork copies only the calling thread.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys


_PROTO = 1  # the answers' pipe; main() moves it off fd 1 so that stray prints cannot mix in


def _send(msg: dict | str) -> None:
    os.write(_PROTO, ((msg if isinstance(msg, str) else json.dumps(msg)) + "\n").encode())


def _child(script: str, req: dict) -> None:
    """In the forked child: the run's environment and files, the script's main(), exit."""
    import atexit
    import threading
    import traceback

    rc = 0
    try:
        os.close(_PROTO)
        os.environ.clear()
        os.environ.update(req["env"])
        # A FIFO for an interactive run (it blocks until the test opens its end), else nothing.
        fd = os.open(req.get("in") or os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for path, target in ((req["out"], 1), (req["err"], 2)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = [script, *req["args"]]
        try:
            # The module-level code again, against this run's environment (the settings it makes
            # there); the imports it repeats are the parent's, already done.
            runpy.run_path(script, run_name="__zygote__")["main"]()
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as a failed run, as the interpreter would
            traceback.print_exc()
            rc = 1
        # What an interpreter does at exit: join non-daemon threads, run the atexit hooks.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def main() -> None:
    global _PROTO
    _PROTO = os.dup(1)
    os.dup2(2, 1)
    script = os.path.abspath(sys.argv[1])
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` has it
    # The script's module-level code (environment defaults read when vLLM is imported), not main().
    runpy.run_path(script, run_name="__zygote__")
    from vllm import LLM, SamplingParams  # noqa: F401 - the import every run would pay for

    _send("READY")
    children: dict[int, int] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(script, req)
                children[pid] = req["id"]
                _send({"id": req["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                _send({"id": rid, "rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
