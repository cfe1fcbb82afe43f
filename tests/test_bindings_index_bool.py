"""An integer argument given as an object whose ``__index__`` returns a bool is refused, as a
bool is: Python's PyNumber_Index copies what ``__index__`` returns into an exact int (with only
a DeprecationWarning), so ``True`` was read as 1 and ``False`` as 0."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvslots import _core
from kvslots.errors import ArgumentTypeError


class IndexBool:
    def __init__(self, v: bool) -> None:
        self.v = v

    def __index__(self):
        return self.v


class IndexStr:
    def __index__(self):
        return "3"


class OddInt(int):
    """An int subclass: read by value; its own __index__ is not consulted (as operator.index)."""

    def __index__(self):
        return 99


CALLS = {
    "HostCache(num_blocks)": lambda v: _core.HostCache(v, 16),
    "SlotManager(block_size)": lambda v: _core.SlotManager(8, v),
    "block_hash(tokens[i])": lambda v: _core.block_hash(0, [1, v, 3]),
    "PrefixIndex.chain_keys(block_size)": lambda v: _core.PrefixIndex(capacity=10).chain_keys([1, 2, 3, 4], v),
    "BlockRegion(num_blocks)": lambda v: _core.BlockRegion(np.zeros(64, np.uint8), block_bytes=8, num_blocks=v),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("value", [True, False])
def test_an_index_returning_a_bool_is_refused(call, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ArgumentTypeError, match="must be an int"):
            CALLS[call](IndexBool(value))


@pytest.mark.parametrize("call", CALLS)
def test_integers_by_index_still_read(call):
    """Controls (pass before and after): numpy integers, an __index__ returning an int, an int
    subclass read by its value; an __index__ returning a str is an ArgumentTypeError."""
    for v in (np.int64(4), IndexBool(4), OddInt(4)):
        CALLS[call](v)
    with pytest.raises(ArgumentTypeError):
        CALLS[call](IndexStr())
    assert _core.block_hash(0, [1, OddInt(2), 3]) == _core.block_hash(0, [1, 2, 3])
    assert _core.block_hash(0, [1, IndexBool(2), 3]) == _core.block_hash(0, [1, 2, 3])


@pytest.mark.parametrize("value", [True, False])
def test_the_reference_model_refuses_an_index_returning_a_bool_too(value):
    # docs/design.md: the argument rules are mirrored by the reference model.
    from kvslots.slots.reference import ReferenceSlotManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ArgumentTypeError, match="must be an int"):
            ReferenceSlotManager(IndexBool(value), 16)
        with pytest.raises(ArgumentTypeError, match="must be an int"):
            _core.SlotManager(IndexBool(value), 16)
    assert ReferenceSlotManager(IndexBool(4), 16) is not None  # an __index__ returning an int reads
