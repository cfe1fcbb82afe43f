"""``DiskWorker``'s directory: a wrong type, a NUL, a lone surrogate or a path that cannot be a
directory is a kvslots error before anything is made (it was TypeError, ValueError or
FileExistsError, and a lone surrogate made the directory before the store refused the path)."""

from __future__ import annotations

import os

import pytest

from kvslots.errors import ArgumentTypeError, DiskTierError, InvalidArgumentError
from kvslots.vllm.connector.disk import DiskLayout, DiskWorker

LAYOUT = DiskLayout(num_layers=1, bytes_per_block=64, dtype="float32", fingerprint=1)


def worker(directory):
    return DiskWorker(directory=directory, num_slots=4, block_size=4, layout=LAYOUT, queue_len=4)


def test_a_directory_of_the_wrong_type_or_text_is_refused_before_anything_is_made(tmp_path):
    with pytest.raises(ArgumentTypeError, match="directory"):
        worker(5)
    with pytest.raises(ArgumentTypeError, match="directory"):
        worker(b"/tmp")
    with pytest.raises(InvalidArgumentError, match="NUL"):
        worker(str(tmp_path / "a\0b"))
    with pytest.raises(InvalidArgumentError, match="Unicode"):
        worker(str(tmp_path) + "/\udc80x")
    assert os.listdir(tmp_path) == [], "nothing made"


def test_a_path_that_cannot_be_a_directory_is_a_disk_tier_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="cannot make the directory"):
        worker(str(tmp_path / "file"))
    with pytest.raises(DiskTierError, match="cannot make the directory"):
        worker(str(tmp_path / "file" / "below"))
    w = worker(tmp_path / "fine")  # a path object as well as a str
    assert w.store.opened == "created" and w.path == str(tmp_path / "fine" / "kvslots-disk-tier.kvs")
    w.close()
