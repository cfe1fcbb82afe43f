"""kvslots simulate --help states each integer's bounds as SimConfig's errors state them: it
had its own copy of the formatting (_args._bound), which differed for a bound of 2**20 or more
that is neither 2**n nor 2**n-1 (3 * 2**20 was '2**21' in the help, 3145728 in the error)."""

from __future__ import annotations

import argparse
import re

import pytest

from kvslots import _args
from kvslots._dev import simulate
from kvslots.errors import InvalidArgumentError


@pytest.mark.parametrize("hi", [4096, 2**24, 2**24 - 1, 3 << 20, 2**64 - 1])
def test_the_help_and_the_error_state_the_same_bound(monkeypatch, hi):
    fields = tuple((n, lo, hi if n == "num_blocks" else h) for n, lo, h in simulate._INT_FIELDS)
    monkeypatch.setattr(simulate, "_INT_FIELDS", fields)
    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["simulate"]
    action = next(a for a in sub._actions if "--num-blocks" in a.option_strings)
    stated = re.search(r"\[[^]]*\]", action.help).group(0)
    with pytest.raises(InvalidArgumentError) as e:
        _args.integer(hi + 1, "--num-blocks", 1, hi)
    assert f"must be in {stated}," in str(e.value)
