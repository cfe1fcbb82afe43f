"""A program that imports kvslots and writes a file with kvslots.cli.write_file (build_tiny_models'
marker, a test run) keeps its signals: the first write gave SIGTERM and SIGHUP a Python-level
handler for good, so signal.getsignal returned ours (libraries that chain to a previous handler
called it) and a SIGTERM waited for the main thread to return to Python (after a 3 s C call: 2.88 s,
before: at once; the reviewer's r15_latency.py). Only the kvslots program sets that handler
(test_cli_atomic_output_signals.py: its cleanup on a SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from process_support import default_signals

# Writes a file, then runs a long C call (hashlib's PBKDF2, tens of seconds) in the main thread.
CHILD = r"""
import hashlib, os, signal, sys
from kvslots import cli
ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
before = [signal.getsignal(s) for s in ENDING]
cli.write_file(os.path.join(sys.argv[1], "marker"), "ok\n")
print("same" if [signal.getsignal(s) for s in ENDING] == before else "changed", flush=True)
hashlib.pbkdf2_hmac("sha256", b"x", b"y", 100_000_000)
print("C call returned", flush=True)
"""


def test_a_library_write_changes_no_handler_and_a_sigterm_ends_a_c_call_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.DEVNULL,
                            preexec_fn=default_signals,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        # The default action ends it within the C call (with the handler it ran on for many seconds).
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()
    assert line == "same\n", proc.stderr.read()
    assert proc.returncode == -signal.SIGTERM
    assert os.listdir(tmp_path) == ["marker"]
