"""SIGSTOP that has taken effect: ``kill()`` returns before the target's threads have stopped,
and on a busy machine a stopped peer's thread could still serve one more request after it."""

from __future__ import annotations

import os
import signal
import time


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """Stops ``pid`` and returns once every one of its threads is in the stopped state."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
                    states.append(f.read().rpartition(")")[2].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {timeout:g} s after SIGSTOP: thread states {states}")
        time.sleep(0.005)
