"""``kvslots convert-config FILE -o PATH`` where PATH is FILE (however spelled, or a link to it) is
one line and exit status 2, the YAML untouched: it was overwritten with the flags made from it."""

from __future__ import annotations

import os

import pytest

from kvslots import cli

YAML = "max_batch_size: 8\n"


@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_output_over_the_input_is_refused(tmp_path, capsys, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "e.yaml"
    f.write_text(YAML)
    src = str(f)
    if spelling == "link":
        os.symlink(f, tmp_path / "link.yaml")
        src = "link.yaml"
    out = {"same": str(f), "dot": "./e.yaml", "link": "e.yaml"}[spelling]
    capsys.readouterr()
    assert cli.main(["convert-config", src, "-o", out]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "-o/--output: is the input file" in err, err
    assert f.read_text() == YAML


def test_output_elsewhere_is_written(tmp_path, capsys):
    f = tmp_path / "e.yaml"
    f.write_text(YAML)
    assert cli.main(["convert-config", str(f), "-q", "-o", str(tmp_path / "flags.txt")]) == 0
    assert (tmp_path / "flags.txt").read_text() == "--max-num-seqs 8\n"
    assert cli.main(["convert-config", str(f), "-q", "-o", os.devnull]) == 0
