"""``kvslots convert-config -o FILE`` killed by a signal part way through its write leaves no
temporary file (kvslots.cli.write_file): a SIGTERM or a SIGHUP ended the process with its
``.kvslots-*.tmp`` beside FILE, never removed. Now the temporary file is removed and the process
then ends as the signal would have (killed by it; a Ctrl-C is still exit status 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from process_support import default_signals

from kvslots import cli

YAML = "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n"
OLD = b"--max-num-seqs 1\n"

# The child's write of the output blocks (a slow disk) once it has begun, after saying so.
CHILD = """
import os, sys, time
from kvslots import cli
real = os.write
def slow(fd, data):
    if fd > 2:
        real(fd, bytes(data)[:5])
        print("writing", flush=True)
        time.sleep(60)
    return real(fd, data)
os.write = slow
sys.argv = ["kvslots", "convert-config", sys.argv[1], "-q", "-o", sys.argv[2]]
sys.exit(cli.main())  # as the program: main() with no arguments owns the process's signals
"""


@pytest.mark.parametrize("signum, status", [
    (signal.SIGTERM, -signal.SIGTERM),
    (signal.SIGHUP, -signal.SIGHUP),
    (signal.SIGINT, 130),
])
def test_a_signal_part_way_leaves_the_old_file_and_no_temporary(tmp_path, signum, status):
    f = tmp_path / "e.yaml"
    f.write_text(YAML)
    dest = tmp_path / "flags.txt"
    dest.write_bytes(OLD)
    before = sorted(os.listdir(tmp_path))
    # A new session: a shell's Ctrl-C or hang-up never reaches it, and SIGINT is not ignored in it.
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(f), str(dest)], stdin=subprocess.DEVNULL,
                            preexec_fn=default_signals,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "writing\n", proc.stderr.read()
        assert len(os.listdir(tmp_path)) == len(before) + 1  # the temporary file, part written
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == status, err
    if signum == signal.SIGINT:
        assert err == "kvslots convert-config: interrupted\n", err
    else:
        assert err == "", err
    assert dest.read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == before


def test_a_programs_own_handler_is_called_and_kept(tmp_path, monkeypatch):
    # A program's own SIGTERM handler still decides (here: it raises), and the cleanup runs.
    # A library call (this test process: kvslots does not own it) sets no handler; in the kvslots
    # program, signals with the default action get write_file's handler for good (putting the
    # default back could lose a signal: test_cli_atomic_output_signal_points.py).
    dest = tmp_path / "out.txt"
    dest.write_bytes(OLD)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    calls = []

    class Stop(Exception):
        pass

    def own(signum, frame):
        calls.append(signum)
        raise Stop

    signal.signal(signal.SIGTERM, own)
    real = os.write

    def write(fd, data):
        if fd > 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(fd, data)

    try:
        monkeypatch.setattr(os, "write", write)
        with pytest.raises(Stop):
            cli.write_file(str(dest), "new text\n")
        monkeypatch.undo()
        assert calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before[signal.SIGTERM])
    expected = before
    assert {s: signal.getsignal(s) for s in before} == expected
    assert dest.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["out.txt"]
    cli.write_file(str(dest), "new text\n")  # and an ordinary write still replaces it
    assert dest.read_bytes() == b"new text\n"
    assert {s: signal.getsignal(s) for s in before} == expected


# A signal taken by another thread (any thread not holding it may take one sent to the process):
# its Python handler runs in the main thread at the next chance, here just after the temporary
# file is made, before write_file had noted it as its own (it was left behind).
CHILD_THREAD = """
import os, signal, sys, threading, time
from kvslots import cli
cli.handle_ending_signals()
other = threading.Thread(target=time.sleep, args=(60,), daemon=True)
other.start()
real = os.open
def made(path, flags, *rest):
    fd = real(path, flags, *rest)
    if ".kvslots-" in path:
        signal.pthread_kill(other.ident, signal.SIGTERM)
        time.sleep(0.5)  # the handler runs as this returns
    return fd
os.open = made
cli.write_file(sys.argv[1], "new text\\n")
print("not ended", flush=True)
"""


def test_a_signal_taken_by_another_thread_as_the_file_is_made(tmp_path):
    dest = tmp_path / "flags.txt"
    dest.write_bytes(OLD)
    proc = subprocess.run([sys.executable, "-c", CHILD_THREAD, str(dest)], stdin=subprocess.DEVNULL,
                          preexec_fn=default_signals,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr)
    assert dest.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["flags.txt"]
