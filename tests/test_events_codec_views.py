"""The codec's bytes arguments given as memoryviews, released or not, and as huge bytes."""

import time

import numpy as np
import pytest

from kvslots.errors import ArgumentTypeError, InvalidArgumentError
from kvslots.events import KVEventBatch, decode_batch, encode_batch, external_block_hash


def _released(data=b"\x93\x00\x90\x00"):
    mv = memoryview(data)
    mv.release()
    return mv


def test_a_released_memoryview_is_a_kvslots_error():
    """decode_batch and external_block_hash of a released memoryview raised the builtin
    ValueError (decode_batch's from its own message: len() of the view raised again in the
    handler). Now InvalidArgumentError naming it."""
    with pytest.raises(InvalidArgumentError, match="released memoryview"):
        decode_batch(_released())
    with pytest.raises(InvalidArgumentError, match="released memoryview"):
        external_block_hash(_released(b"12345678"))


def test_views_and_bytes_still_decode_and_hash_alike():
    payload = encode_batch(KVEventBatch(ts=1.0, events=[]))
    assert decode_batch(memoryview(payload)) == decode_batch(bytearray(payload)) == decode_batch(payload)
    h = bytes(range(1, 33))
    want = int.from_bytes(h, "big") & (2**64 - 1)
    assert external_block_hash(h) == external_block_hash(bytearray(h)) == external_block_hash(memoryview(h)) == want
    assert external_block_hash(b"\x01\x02") == 0x0102 and external_block_hash(b"") == 0
    with pytest.raises(ArgumentTypeError):
        decode_batch(memoryview(np.arange(16, dtype=np.uint8))[::2])


def test_a_huge_hash_is_read_by_its_last_8_bytes():
    """external_block_hash read a 100 MB bytes whole into an int (0.2 s) to keep its low 64
    bits; now its last 8 bytes."""
    big = b"\x01" * 10**8 + b"\x00\x00\x00\x00\x00\x00\x00\x07"
    t = time.perf_counter()
    assert external_block_hash(big) == 7
    assert time.perf_counter() - t < 0.05
