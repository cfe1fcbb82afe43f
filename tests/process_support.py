"""Test support shared by several files: a guarded uvicorn server on a free port, and a call
run in a forked child."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any


def serve_guarded(app: Any, log_level: str = "error", **options: Any) -> tuple[int, Any, threading.Thread]:
    """``app`` served by uvicorn on 127.0.0.1 with kvslots' HTTP guard (``options`` go to
    ``httpguard.uvicorn_options``), started: its port, the server (set ``should_exit`` to stop
    it) and its thread."""
    import uvicorn

    from kvslots.indexer import httpguard
    from ports import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, lifespan="off",
                                           **httpguard.uvicorn_options(**options)))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return port, server, t


def in_child(body: Any) -> Any:
    """body() in a forked child killed after 3 s: what it returned (JSON) or raised
    ``[type name, message]``, or how it died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            signal.alarm(3)
            try:
                out = body()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = [type(e).__name__, str(e)]
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)} (hung)"
    return json.loads(data)


def default_signals() -> None:
    """A ``preexec_fn``: the child starts with SIGINT and SIGHUP at their default actions, as a
    program started from a shell does. A suite started in the background (``cmd &``, ``nohup``)
    has them ignored, and exec keeps an ignored signal ignored: a child Python then takes no
    Ctrl-C (no KeyboardInterrupt handler is installed) and survives a SIGHUP."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
