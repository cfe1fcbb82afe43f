"""What a huge argument costs the core: a message quotes a long request id by its start and
length (an id of 10**8 characters made a message of that size), and a host tier of 2**31
blocks costs nothing until its blocks are used (its successor table was filled: 8 GiB)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

import kvslots
from kvslots import _core
from kvslots.errors import KVSlotsError
from kvslots.slots.reference import SHOWN_ID_CHARS, ReferenceSlotManager

LONG = "r7" * 50_000  # 100,000 characters, digits in it


def _calls(m, rid: str):
    """One call per error kind that names the request."""
    return [
        lambda: m.slot_info(rid),  # unknown
        lambda: (m.create(rid, [1, 2, 3]), m.create(rid, [1])),  # duplicate
        lambda: m.rollback(rid, 99),  # invalid rollback
        lambda: m.reserve(rid, 10**6),  # out of blocks
        lambda: m.commit(rid, [2**40]),  # invalid argument for the request
    ]


@pytest.mark.parametrize("make", [lambda: kvslots.SlotManager(8, 4), lambda: ReferenceSlotManager(8, 4)],
                         ids=["core", "reference"])
def test_a_long_request_id_is_quoted_by_its_start_and_length(make) -> None:
    m = make()
    kinds = set()
    for call in _calls(m, LONG):
        with pytest.raises(KVSlotsError) as info:
            call()
        msg = str(info.value)
        kinds.add(type(info.value).__name__)
        assert len(msg) < 400, msg[:200]
        assert f"{LONG[:SHOWN_ID_CHARS]}" in msg and f"... ({len(LONG)} characters)" in msg, msg
        if getattr(info.value, "request_id", None) is not None:
            assert info.value.request_id == LONG  # the exception still carries the whole id
    assert len(kinds) == 5, kinds


@pytest.mark.parametrize("rid", ["a" * SHOWN_ID_CHARS, "é" * SHOWN_ID_CHARS, "x" * (SHOWN_ID_CHARS + 1)])
def test_core_and_reference_quote_an_id_at_the_same_length(rid: str) -> None:
    msgs = []
    for m in (kvslots.SlotManager(8, 4), ReferenceSlotManager(8, 4)):
        with pytest.raises(KVSlotsError) as info:
            m.slot_info(rid)
        msgs.append(str(info.value))
    core, ref = msgs
    assert re.sub(r"[\"']", "", core) == re.sub(r"[\"']", "", ref)
    assert (len(rid) > SHOWN_ID_CHARS) == ("characters)" in core)


def test_a_host_tier_of_2_31_blocks_costs_nothing_until_used() -> None:
    code = textwrap.dedent(
        """
        import resource
        from kvslots._core import HostCache
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        c = HostCache(2**31 - 2, 16)
        rows = c.begin_store_run(1, [5, 6], None, [0] * 32)
        c.complete_step(1)
        assert c.successor(5) is None and c.match_prefix([5, 6]) == 2, rows
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 256, f"{out.stdout} MB resident for an unused host tier"


def _error_classes() -> list[type]:
    import kvslots.errors as errors

    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.KVSlotsError)]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_keeps_a_bounded_message(cls) -> None:
    import pickle

    from kvslots.errors import MAX_MESSAGE_CHARS

    long = "start " + "v" * 10**6 + " end"
    kwargs = {"version": "0.1"} if cls.__name__ == "UnsupportedVLLMVersionError" else {}
    e = cls(long, **kwargs)
    for err in (e, pickle.loads(pickle.dumps(e))):
        text = str(err)
        assert len(text) < MAX_MESSAGE_CHARS + 100, len(text)
        assert text.startswith("start vvv") and text.endswith("vvv end") and "characters cut" in text
    short = "a short message"
    assert str(cls(short, **kwargs)) == short


@pytest.mark.parametrize("value", [10**5000, -(10**5000), 2**200], ids=["huge", "huge_negative", "2**200"])
def test_an_int_out_of_range_is_named_by_its_size(value: int) -> None:
    from kvslots._args import integer
    from kvslots.errors import InvalidArgumentError
    from kvslots.vllm.cpu_cores import reservation_warning

    with pytest.raises(InvalidArgumentError, match=r"got (an|a negative) int of \d+ bits") as info:
        integer(value, "n", 0, 10)
    assert len(str(info.value)) < 100
    with pytest.raises(InvalidArgumentError):  # a public caller (its ValueError came out)
        reservation_warning(value)


def test_a_long_text_argument_is_quoted_bounded() -> None:
    from kvslots._args import integer, text
    from kvslots.errors import ArgumentTypeError, InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as info:
        text("\ud800" * 10**6, "name")
    assert len(str(info.value)) < 200
    with pytest.raises(ArgumentTypeError) as info:
        integer([list(range(10))] * 10**6, "n")
    assert len(str(info.value)) < 200
