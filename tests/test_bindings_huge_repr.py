"""A huge argument of the wrong type is named in its error by a bounded repr
(``kvslots.errors.short_repr``). The extension made the argument's whole repr and then cut it
to 80 characters: 10**8 bytes passed as a request id cost 760 MB and 1.4 s, a list of 10**7
lists 3.3 s."""

from __future__ import annotations

import time

import pytest

import kvslots
from kvslots import _core
from kvslots.errors import ArgumentTypeError


@pytest.mark.parametrize("arg", [bytes(10**8), [[1]] * 10**7], ids=["bytes", "lists"])
def test_a_huge_argument_of_the_wrong_type_is_named_at_once(arg):
    m = kvslots.SlotManager(8, 4)
    t = time.perf_counter()
    with pytest.raises(ArgumentTypeError, match=r"request_id must be a str, got (bytes b'\\x00|list \[\[1\], \[1\])") as e:
        m.slot_id(arg)
    assert time.perf_counter() - t < 0.5  # 1.4 s and 3.3 s on the old code
    assert len(str(e.value)) < 200
    with pytest.raises(ArgumentTypeError):
        _core.PrefixIndex().lookup([1, 2, 3, 4], 4, lora_name=arg)


def test_short_repr():
    from kvslots.errors import short_repr

    class Raises:
        def __repr__(self):
            raise ValueError("no")

    nested: list = []
    for _ in range(10_000):
        nested = [nested]
    assert short_repr(b"ab") == "b'ab'"
    assert short_repr([1, 2, 3]) == "[1, 2, 3]"
    assert short_repr(list(range(100))) == "[0, 1, 2, 3, 4, 5, ...]"
    assert short_repr(nested) == "[[[[...]]]]"
    assert short_repr(Raises()).startswith("<Raises instance at")
    assert short_repr([Raises()]).startswith("[<Raises instance at")
    for big in (b"x" * 10**6, bytearray(10**6), "y" * 10**6, 7**10_000):
        assert len(short_repr(big)) <= 80


def test_the_reference_model_names_a_huge_argument_as_the_extension_does():
    """The pure-Python reference made the whole repr too (and kept it: a message of 400 MB)."""
    from kvslots.slots.reference import ReferenceSlotManager

    said = []
    for make in (kvslots.SlotManager, ReferenceSlotManager):
        m = make(8, 4)
        t = time.perf_counter()
        with pytest.raises(ArgumentTypeError, match="match_prefix must be a bool, got bytes b'") as e:
            m.create("a", [1, 2], match_prefix=bytes(10**8))
        assert time.perf_counter() - t < 0.5
        assert len(m) == 0
        said.append(str(e.value))
    assert said[0] == said[1]
