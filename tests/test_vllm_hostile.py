"""Hostile input to kvslots.vllm's entry points that do not need vLLM's engine: version strings
(kvslots.vllm.compat). Each ends in success or a kvslots exception."""

from __future__ import annotations

import pytest

from kvslots.errors import KVSlotsError
from kvslots.vllm.compat import UnsupportedVLLMVersionError, features_for, parse_series


class _ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("junk", [
    "9" * 5000 + ".32",          # was int()'s ValueError (over its 4300-digit limit)
    "0." + "3" * 5000,
    "0" * 100_000 + ".32",
    "\uff10.\uff13\uff12",       # full-width digits: were read as 0.32
    "\u0660.\u0663\u0662",       # Arabic-Indic digits: the same
    "-0.32", "0..32", "1e5.2", _ReprRaises(), float("nan"), ["0.32"],
])
def test_odd_version_strings_are_kvslots_errors(junk):
    with pytest.raises(UnsupportedVLLMVersionError) as ei:
        parse_series(junk)
    assert isinstance(ei.value, KVSlotsError)
    assert len(str(ei.value)) < 300  # the version is shortened in the message


@pytest.mark.parametrize("version, series", [
    ("0.32.0", (0, 32)), (" v0.33.1rc1.dev3+g1", (0, 33)), ("000.032", (0, 32)), ("0.32-", (0, 32)),
])
def test_plain_versions_still_parse(version, series):
    assert parse_series(version) == series


def test_unsupported_long_version_message_is_short():
    with pytest.raises(UnsupportedVLLMVersionError, match="0.99") as ei:
        features_for("0.99." + "x" * 10_000)
    assert len(str(ei.value)) < 300
