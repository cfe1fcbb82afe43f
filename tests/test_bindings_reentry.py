"""Python code an argument runs in the middle of a call (a value's ``__index__`` or
``__float__``, an array's ``__del__``) that changes the argument or calls the same object again.
Each case was once a pyo3 ``PanicException`` (a ``BaseException``, not a kvslots error), a read
without end, or a deadlock; now the call succeeds or raises a kvslots error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvslots import _core
from kvslots.errors import InvalidArgumentError


def test_score_blocks_reads_a_dict_its_values_grow_as_it_was():
    """A holder value whose ``__index__`` added keys to its block's dict made pyo3's dict
    iterator panic ("dictionary changed size during iteration"). The dict's items are taken
    first: the call scores what the dict held when it was called."""
    index = _core.PrefixIndex()
    block: dict = {}

    class Grows:
        def __index__(self):
            block[f"w{len(block)}"] = 1
            return 1

    block["a"] = Grows()
    assert index.score_blocks([block]) == index.score_blocks([{"a": 1}])
    assert len(block) == 2  # its __index__ did run


def test_tier_weights_a_weight_that_grows_the_dict_is_read_as_the_dict_was():
    """Same for the constructor's ``tier_weights``: an int subclass's ``__float__`` adding a
    tier made the constructor panic. The weights are those the dict held when it was called."""
    weights: dict = {}

    class Weight(int):
        def __float__(self):
            weights["CPU"] = 9.0
            return 3.0

    weights["GPU"] = Weight(3)
    got = dict(_core.PrefixIndex(tier_weights=weights).tier_weights)
    default = dict(_core.PrefixIndex().tier_weights)
    assert got == {**default, "GPU": 3.0}


def test_token_ids_a_list_growing_under_its_read_stops_at_max_iter_items():
    """``token_ids`` of the prefix index (``lookup``, ``chain_keys``, ``score_blocks``) read a
    list to its current end, with no bound: an item's ``__index__`` appending more items made a
    read without end (and memory without bound). Now it stops after ``MAX_ITER_ITEMS`` items,
    as every integer sequence argument does. (Here it would end after 20 * 2**20 items.)"""
    index = _core.PrefixIndex()
    batch = 1 << 20
    tokens: list = []
    calls = []

    class Grows:
        def __index__(self):
            calls.append(1)
            if len(calls) < 20:
                tokens.extend([1] * batch)
                tokens.append(Grows())
            return 1

    tokens.append(Grows())
    assert _core.MAX_ITER_ITEMS < 20 * batch
    with pytest.raises(InvalidArgumentError, match=r"token_ids gives more than \d+ items"):
        index.chain_keys(tokens, 16)
    assert len(calls) <= _core.MAX_ITER_ITEMS // batch + 1
    del tokens[:]


_DEL_CALLS_THE_STORE = textwrap.dedent(
    """
    import os, sys, tempfile
    import numpy as np
    from kvslots import _core

    store = _core.DiskStore(os.path.join(tempfile.mkdtemp(), "f"), num_slots=4, block_size=2,
                            num_layers=1, bytes_per_block=16, dtype="uint8", fingerprint=1)
    store.submit(0, np.arange(16, dtype=np.uint8), 11, [1, 2])
    store.flush()
    assert store.take_done() == [(0, True)]
    inner = []

    class Rows(np.ndarray):
        def __del__(self):  # a second read, queued while the first one's array is let go
            inner.append(store.read_rows_async([0], [11], np.zeros((1, 16), np.uint8), [0]))

    out = np.zeros((1, 16), np.uint8).view(Rows)
    first = store.read_rows_async([0], [11], out, [0])
    del out  # the store's reference is now the last one
    assert store.wait_reads(10.0)
    done = store.take_reads()
    assert done == [(first, [], None)], done
    assert len(inner) == 1
    assert store.wait_reads(10.0)
    assert store.take_reads() == [(inner[0], [], None)]
    print("ok")
    """
)


def test_an_array_whose_del_calls_the_disk_store_again_does_not_deadlock(tmp_path):
    """``take_reads`` let go of the arrays it kept for finished reads while it held the store's
    lock: an array's ``__del__`` calling the store (here queueing another read) waited on that
    lock for ever. Run in a child process: it hung on the old code."""
    r = subprocess.run([sys.executable, "-c", _DEL_CALLS_THE_STORE], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr[-2000:]
