"""A child forked while ``kvslots convert-config -o FILE`` writes FILE (a multiprocessing worker of
a program that writes with kvslots.cli.write_file) and then ended by a SIGTERM (Process.terminate)
leaves the parent's temporary file alone: it inherited write_file's handler and its list of
temporary files in progress, removed the parent's, and the parent's write failed ('cannot write:
No such file or directory'). The reviewer's r13_fork.py."""

from __future__ import annotations

import os
import subprocess
import sys

from process_support import default_signals

YAML = "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n"

# As the temporary file is written, the command forks a child, which says it is running and
# waits; the parent ends it with a SIGTERM, reaps it and then writes on.
CHILD = """
import os, signal, sys
from kvslots import cli
real = cli._write_all
def forked_then_write(fd, data):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # never waits for good
        os.write(w, b"r")
        while True:
            signal.pause()
    assert os.read(r, 1) == b"r"
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    return real(fd, data)
cli._write_all = forked_then_write
sys.argv = ["kvslots", "convert-config", sys.argv[1], "-q", "-o", sys.argv[2]]
sys.exit(cli.main())
"""


def test_a_forked_child_ended_by_sigterm_leaves_the_parents_file(tmp_path):
    src = tmp_path / "e.yaml"
    src.write_text(YAML)
    dest = tmp_path / "flags.txt"
    dest.write_text("old\n")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dest)], stdin=subprocess.DEVNULL,
                          preexec_fn=default_signals,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == "child -15\n", (proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert dest.read_text().startswith("--speculative-config ")
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]
