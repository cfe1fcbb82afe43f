"""``from_raw``'s error for a malformed event tuple names the tuple by a bounded repr. It was the
whole repr: a tuple of deeply nested token ids raised RecursionError (a builtin error, not a
kvslots one) while its EventDecodeError was being made, and one holding 10**7 bad tokens took
4 s and ~100 MB to print before the message cut it to 80 characters."""

from __future__ import annotations

import time

import pytest

from kvslots.errors import EventDecodeError
from kvslots.events import from_raw


def test_deeply_nested_token_ids_are_an_event_decode_error():
    nested = None
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(EventDecodeError, match=r"malformed event tuple \('BlockStored', \[1\], None, \[\[\[\.\.\.\]\]\], 1, "
                       r"None\): token_ids\[0\] must be an int, got list"):
        from_raw(("BlockStored", [1], None, nested, 1, None), None)


def test_a_huge_malformed_tuple_is_named_at_once():
    tokens = [0.5] * 10**7
    t = time.perf_counter()
    with pytest.raises(EventDecodeError, match=r"\[0\.5, 0\.5, 0\.5, 0\.5, 0\.5, 0\.5, \.\.\.\].*token_ids\[0\] must be an int, "
                       r"got float 0\.5"):
        from_raw(("BlockStored", [1], None, tokens, 1, None), None)
    assert time.perf_counter() - t < 0.5  # 4 s on the old code


def test_an_item_whose_repr_raises_is_still_named():
    class Odd:
        def __repr__(self):
            raise ValueError("no repr")

    with pytest.raises(EventDecodeError, match="block_size must be an int, got Odd <Odd"):
        from_raw(("BlockStored", [1], None, [1], Odd(), None), None)
