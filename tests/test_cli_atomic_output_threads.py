"""A SIGTERM to the kvslots program while several threads write with kvslots.cli.write_file leaves
no temporary file: the handler removed the files in a copy of its list while other threads, free to
run while os.unlink waited, went on making new ones, which were left (the reviewer's r12_threads.py:
13 of 60 SIGTERMs left one). Now the handler holds the lock under which a file is noted and made:
a thread that comes to make one after it waits and makes none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from process_support import default_signals

# The main thread's write is ended by a SIGTERM; as its handler removes the main thread's file,
# another thread is let start a write and given a second to make its file (it then waits for good).
CHILD = r"""
import os, signal, sys, threading
from kvslots import cli
getattr(cli, "handle_ending_signals", lambda: None)()  # as the kvslots program does
d = sys.argv[1]
go, made = threading.Event(), threading.Event()
real_unlink = os.unlink
def unlink(path, *a, **k):
    if threading.current_thread() is threading.main_thread() and not go.is_set():
        go.set()
        made.wait(1)
    return real_unlink(path, *a, **k)
real_write_all = cli._write_all
def write_all(fd, data):
    if threading.current_thread() is threading.main_thread():
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs as this returns
    else:
        made.set()
        threading.Event().wait()
    return real_write_all(fd, data)
def other():
    go.wait()
    cli.write_file(os.path.join(d, "other.txt"), "y")
threading.Thread(target=other, daemon=True).start()
os.unlink, cli._write_all = unlink, write_all
cli.write_file(os.path.join(d, "main.txt"), "x")
print("not ended", flush=True)
"""


def test_a_sigterm_as_another_thread_starts_a_write_leaves_no_temporary_file(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.DEVNULL,
                          preexec_fn=default_signals,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr)
    assert os.listdir(tmp_path) == []
