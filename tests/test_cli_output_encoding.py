"""A command whose output holds a character stdout's encoding has not (PYTHONIOENCODING=ascii,
or a C locale with Python's UTF-8 coercion off) is one line and exit status 2: a non-ASCII
tokenizer path in a YAML was a UnicodeEncodeError traceback, exit status 1, from
``convert-config`` and ``serve --dry-run``; and --help or --version that cannot be written (a full
disk) is the same line, where it was exit status 0 with nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

YAML = "tokenizer: /tok\u00e8\n"


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"},
                                 {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": ""}],
                         ids=["ioencoding", "c-locale"])
@pytest.mark.parametrize("command", [["convert-config", "{f}", "-q"], ["serve", "--dry-run", "-q", "org/m",
                                                                       "--extra-engine-args", "{f}"]],
                         ids=["convert-config", "serve"])
def test_output_stdout_cannot_encode_is_one_line_exit_2(tmp_path, env, command):
    f = tmp_path / "e.yaml"
    f.write_text(YAML, encoding="utf-8")
    argv = [a.replace("{f}", str(f)) for a in command]
    proc = subprocess.run([sys.executable, "-m", "kvslots", *argv], capture_output=True, timeout=120,
                          env={**os.environ, **env}, cwd=tmp_path)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "cannot write the output: stdout's encoding" in err and "PYTHONIOENCODING=utf-8" in err, err
    assert proc.stdout == b""


def test_an_encoding_that_has_the_character_still_writes_it(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(YAML, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(f), "-q"], capture_output=True,
                          timeout=120, env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert proc.returncode == 0 and proc.stdout == "--tokenizer '/tok\u00e8'\n".encode("latin-1"), proc


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["serve", "--help"], ["convert-config", "--help"]])
def test_help_that_cannot_be_written_is_one_line_exit_2(argv):
    # argparse drops what writing --help or --version raises: exit status 0, nothing written.
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvslots", *argv], stdout=full, stderr=subprocess.PIPE,
                              timeout=120, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.endswith("error: cannot write the output: No space left on device\n"), proc.stderr
    ok = subprocess.run([sys.executable, "-m", "kvslots", *argv], capture_output=True, timeout=120, text=True)
    assert ok.returncode == 0 and ok.stdout and ok.stderr == ""
