"""Running the vLLM server as a supervised child: the leader of its own process group, signals
forwarded and escalated, and every process it started stopped before we return."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ServeError
from .plan import PROG
from .tail import check_argv

DEFAULT_GRACE_S = 15.0


# Two things the standard library cannot do, through Linux's prctl(2) (the os module has no prctl):
# * PR_SET_CHILD_SUBREAPER, on us: a descendant of the server that leaves its process group (a
#   new session, as some launchers start their workers) and is orphaned is re-parented to us
#   instead of to init, so we can still signal it and wait for it after the server exits. Process
#   groups, os.waitpid and psutil cannot find it once its parent has exited (it is init's child
#   then, like any other process); without a subreaper it outlives kvslots serve unseen.
# * PR_SET_PDEATHSIG, in the child between fork and exec: the kernel sends the server SIGTERM when
#   kvslots serve dies without stopping it (SIGKILL, the OOM killer), when no code of ours runs.
# The PyPI wrappers are not maintained (python-prctl: last release 1.8.1 in 2020, a C extension
# that needs the libcap headers to build; pyprctl: 0.1.3 in 2021, itself a ctypes wrapper), so
# libc's prctl is called through ctypes: these calls, constants from <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl() -> Callable[..., int] | None:
    """libc's prctl(2); None off Linux or without a C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _own_children() -> list[int]:
    """Our live child processes (Linux /proc; empty elsewhere)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _reap(except_pid: int | None = None) -> bool:
    """Reaps exited children other than ``except_pid``; True if some child is still ours."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        if info is None:
            return True
        if info.si_pid == except_pid:
            return True
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            pass


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def supervise(argv: Sequence[str], *, env: dict[str, str] | None = None, grace: float = DEFAULT_GRACE_S,
              log: Callable[[str], None] | None = None, restore_signals: bool = True) -> int:
    """Runs ``argv`` as the leader of a new process group and returns its exit status (128 + N
    when a signal N killed it).

    SIGINT/SIGTERM/SIGHUP sent to us are forwarded to the whole group (SIGHUP as SIGTERM). After
    a SIGINT the group gets SIGTERM once ``grace`` seconds pass, and SIGKILL ``grace`` seconds
    later; after a SIGTERM, SIGKILL after ``grace``; another signal skips to the next step. Once
    the leader has exited, what is left of the group (and every orphaned descendant, re-parented
    to us on Linux) gets ``grace`` seconds, then SIGTERM, then SIGKILL; we return when none is left.

    The caller's handlers are put back on return; with ``restore_signals=False`` (a command that
    exits with the status next, as ``kvslots serve`` does) SIGINT, SIGTERM and SIGHUP are ignored
    from then on instead, so that one arriving after the server exited cannot end the process by
    that signal or with a KeyboardInterrupt traceback: the exit status stays the server's.
    """
    # Checked before any signal handler changes: Popen's ValueError (a NUL), TypeError (an int)
    # or an IndexError (no program) otherwise, and a NaN grace escalated at once.
    check_argv(argv, "argv")
    if not argv:
        raise ServeError("argv is empty: no program to run")
    if env is not None:
        if not isinstance(env, Mapping):
            raise ServeError(f"env must be a mapping of str to str, got {type(env).__name__}")
        check_argv(list(env) + list(env.values()), "env")
        if any(not k or "=" in k for k in env):
            raise ServeError(f"env: {sorted(k for k in env if not k or '=' in k)[0]!r} is not a variable name")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (math.isfinite(grace) and grace > 0):
        raise ServeError(f"grace {grace!r} must be a finite number of seconds > 0")
    if not isinstance(restore_signals, bool):
        raise ServeError(f"restore_signals must be a bool, got {type(restore_signals).__name__}")
    if threading.current_thread() is not threading.main_thread():
        # Python installs signal handlers only there: signal.signal's ValueError otherwise.
        raise ServeError("supervise must be called from the main thread (it handles SIGINT, SIGTERM and SIGHUP)")
    say = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr, flush=True))
    pending: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        pending.append(signum)

    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {s: signal.signal(s, on_signal) for s in handled}
    prctl = _prctl()
    # Orphaned descendants of the server are re-parented to us, so we can wait for every one of
    # them (not only the group leader).
    was_subreaper = ctypes.c_int(0)
    if prctl is not None and prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was_subreaper), 0, 0, 0) != 0:
        was_subreaper.value = 1  # unknown: leave the flag as we found it
    subreaper = prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

    def child_setup() -> None:  # in the child between fork and exec: libc was loaded before the fork
        if prctl is not None:  # SIGTERM to the server if kvslots serve dies without stopping it
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    try:
        try:
            proc = subprocess.Popen(list(argv), env=env, start_new_session=True, preexec_fn=child_setup)
        except OSError as e:
            say(f"error: cannot start {argv[0]}: {e}")
            return 127
        pgid = proc.pid
        steps = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
        step = -1  # index in steps of the last signal sent by us
        deadline = float("inf")
        while proc.poll() is None:
            if pending:
                sig = pending.pop(0)
                if step < 0:
                    step = 0 if sig == signal.SIGINT else 1
                    say(f"stopping vLLM: {_signame(steps[step])} to process group {pgid} "
                        f"(again to force)")
                else:
                    step = min(step + 1, 2)
                    say(f"{_signame(steps[step])} to process group {pgid}")
                _signal_group(pgid, steps[step])
                deadline = time.monotonic() + grace
            elif step >= 0 and step < 2 and time.monotonic() > deadline:
                step += 1
                say(f"vLLM still running after {grace:g} s: {_signame(steps[step])} to process group {pgid}")
                _signal_group(pgid, steps[step])
                deadline = time.monotonic() + grace
            if subreaper:
                _reap(except_pid=proc.pid)
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.returncode
        _wait_for_rest(pgid, grace if step < 1 else min(grace, 5.0), subreaper, say, pending)
        if step >= 0 or rc != 0:
            say(f"vLLM exited with status {rc if rc >= 0 else _signame(-rc)}")
        return rc if rc >= 0 else 128 - rc
    finally:
        for s, h in previous.items():
            # SIG_IGN, not our handler left in place: it holds only while Python runs bytecode,
            # and the process is about to finalize.
            signal.signal(s, h if restore_signals else signal.SIG_IGN)
        # A process-wide flag: a caller that runs on (a test runner, an app) must not go on
        # adopting orphans it never reaps, which then stay zombies.
        if subreaper and not was_subreaper.value and prctl is not None:
            prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _wait_for_rest(pgid: int, grace: float, subreaper: bool, say: Callable[[str], None],
                   pending: list[int] | None = None) -> None:
    """Waits ``grace`` seconds for what is left of the group (and our re-parented orphans), then
    SIGTERM, ``grace`` more, then SIGKILL. A signal sent to us meanwhile (``pending``, filled by
    supervise's handler) moves to the next step at once: Ctrl-C here was recorded and ignored,
    so a leftover that ignores SIGINT and SIGTERM held kvslots serve for the whole grace period
    (with --grace-period 1e300, for good) however often Ctrl-C was pressed."""

    def left() -> bool:
        children = _reap() if subreaper else False
        return _group_alive(pgid) or children

    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            say(f"processes of group {pgid} still running: {_signame(sig)}")
            _signal_group(pgid, sig)
            for pid in _own_children():
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        end = time.monotonic() + (grace if sig != signal.SIGKILL else 10.0)
        while time.monotonic() < end:
            if not left():
                return
            if pending and sig != signal.SIGKILL:
                pending.clear()
                break
            time.sleep(0.05)
    if left():
        say(f"warning: processes of group {pgid} survived SIGKILL")


__all__ = ["DEFAULT_GRACE_S", "supervise"]
