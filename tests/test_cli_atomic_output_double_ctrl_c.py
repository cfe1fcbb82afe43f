"""Two Ctrl-Cs in a row during kvslots.cli.write_file: the first part way through the write, the
second as the cleanup of the first starts. The second's KeyboardInterrupt skipped the cleanup: the
``.kvslots-*.tmp`` and its descriptor were left (the reviewer's r18_double_ctrl_c.py). Now the
cleanup runs again after it."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from kvslots import cli


def test_a_second_ctrl_c_as_the_cleanup_starts_still_cleans_up(tmp_path, monkeypatch):
    dest = tmp_path / "flags.txt"
    dest.write_text("old\n")

    def first(fd, data):
        raise KeyboardInterrupt

    def hook(frame, event, arg):  # the second Ctrl-C's handler, run as Python would run it
        if event == "call" and frame.f_code.co_name == "_remove_temporary":
            sys.setprofile(None)
            signal.default_int_handler(signal.SIGINT, frame)

    monkeypatch.setattr(cli, "_write_all", first)
    fds = set(os.listdir("/proc/self/fd"))
    sys.setprofile(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            cli.write_file(str(dest), "new\n")
    finally:
        sys.setprofile(None)
    assert os.listdir(tmp_path) == ["flags.txt"]
    assert dest.read_text() == "old\n"
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert not any(path.startswith(str(tmp_path)) for path in cli._LIVE)
