"""``kvslots demo``'s arguments are checked before anything is built (tests/test_demo.py runs
the demo itself): a --cache-dir no file name can be written as was found out by building the
models in it."""

from __future__ import annotations

import os
import time

import pytest

from kvslots import cli


@pytest.mark.parametrize("name, problem", [
    ("models-\udcff", "must be valid Unicode (no lone surrogates)"),  # argv's form of a non-UTF-8 byte
    ("models\0x", "must not contain a NUL character"),
], ids=["not-utf-8", "nul"])
def test_a_cache_dir_no_model_can_be_written_to_is_one_line_exit_2_at_once(tmp_path, capsys, name, problem):
    cache = os.path.join(str(tmp_path), name)
    capsys.readouterr()
    start = time.monotonic()
    assert cli.main(["demo", "--cache-dir", cache]) == 2
    out, err = capsys.readouterr()
    # The old code wrote the target model into the non-UTF-8 name, then failed on the tokenizer.
    assert out == "" and err.count("\n") == 1 and err.startswith("kvslots demo: error: --cache-dir "), err
    assert problem in err and os.listdir(tmp_path) == [] and time.monotonic() - start < 5
