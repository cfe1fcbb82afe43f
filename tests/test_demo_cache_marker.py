"""``kvslots demo`` (kvslots._dev.tiny.build_tiny_models) marks a finished build with a
``.complete`` file holding the models' dimensions. It was written in place: a write cut short (a
full disk; here ``ulimit -f``) left a partial marker, and every later run refused the cache as
"holds models of other dimensions" until it was removed by hand. Now the marker is written whole
or not at all (kvslots.cli.write_file), so the next run builds again."""

from __future__ import annotations

import os
import resource

from kvslots._dev import tiny
from process_support import in_child


def test_a_marker_cut_short_is_not_left_to_refuse_the_next_run(tmp_path, monkeypatch):
    for name in ("build_target", "build_eagle", "build_eagle3"):  # only the marker is written
        monkeypatch.setattr(tiny, name, lambda *a, **k: None)
    root = tmp_path / "models"
    root.mkdir()

    def cut_short():  # in a forked child: the limit is its own
        resource.setrlimit(resource.RLIMIT_FSIZE, (20, 20))
        tiny.build_tiny_models(str(root))

    out = in_child(cut_short)
    assert out[0] == "ConfigError" and "File too large" in out[1], out
    assert os.listdir(root) == []  # neither a partial marker nor a temporary file
    tiny.build_tiny_models(str(root))  # the next run builds (it was refused: other dimensions)
    assert (root / ".complete").read_text().startswith("{")
    tiny.build_tiny_models(str(root))  # and a finished build is reused
