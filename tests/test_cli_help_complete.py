"""Every option of the kvslots commands kept here (simulate, convert-config, serve, demo) says
in --help what it does, and one with a default says that default: kvslots simulate's
--requests, --block-size, --num-blocks and --seed and kvslots demo's --cache-dir and --seed had
no help at all, and neither command showed a default (nor simulate the bounds its errors
state)."""

from __future__ import annotations

import argparse
import re

import pytest

from kvslots import cli
from kvslots._dev.simulate import _INT_FIELDS, SimConfig

COMMANDS = ["simulate", "convert-config", "serve", "demo"]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(name: str):
    return [a for a in _subparser(name)._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help_and_shows_its_default(name):
    sub = _subparser(name)
    formatter = sub._get_formatter()
    checked = 0
    for action in _options(name):
        assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings[0]}: no help"
        if action.default is None or action.default is False:  # not `in (None, False)`: 0 == False
            continue
        # The option's own help, as printed: another option's "default 4" says nothing of this one.
        text = " ".join(formatter._expand_help(action).split())
        shown = f"{action.default:g}" if isinstance(action.default, float) else str(action.default)
        # "(default 15)", or a choice's own words ending "(default)": "flags: vllm serve arguments (default)"
        assert re.search(rf"\bdefault {re.escape(shown)}\b", text) \
            or re.search(rf"\b{re.escape(shown)}\b[^;]*\(default\)", text), \
            f"{name} {action.option_strings[0]}: default {shown} not in its help: {text!r}"
        checked += 1
    assert checked, name


def test_every_indexer_option_has_help_and_log_level_its_default():
    # Its options default to None (a --config file may set them): each has help, and --log-level's
    # states the default IndexerConfig gives it.
    from kvslots.indexer.config import IndexerConfig

    for action in _options("indexer"):
        assert action.help and action.help != argparse.SUPPRESS, f"indexer {action.option_strings[0]}: no help"
    level = next(a for a in _options("indexer") if "--log-level" in a.option_strings)
    assert f"(default {IndexerConfig().log_level})" in level.help


def test_demo_states_the_host_cache_bounds_it_enforces():
    from kvslots.config.connector import ConnectorConfig
    from kvslots.errors import ConfigError

    gb = next(a for a in _options("demo") if "--host-cache-gb" in a.option_strings)
    assert "> 0 and < 2**20" in gb.help and "one block" in gb.help
    ConnectorConfig(host_cache_gb=2**20 - 1)
    for bad in (0, 2**20):
        with pytest.raises(ConfigError):
            ConnectorConfig(host_cache_gb=bad)


def test_simulate_states_the_bounds_it_enforces():
    text = " ".join(_subparser("simulate").format_help().split())
    shown = {"requests": "[0, 100000]", "batch": "[1, 4096]", "lookahead": "[0, 64]", "block_size": "[1, 4096]",
             "num_blocks": "[1, 2**24]", "seed": "[0, 2**64-1]"}
    bounds = {name: (lo, hi) for name, lo, hi in _INT_FIELDS}
    for name, words in shown.items():
        assert words in text, name
        lo, hi = bounds[name]
        SimConfig(**{name: lo})  # only checked, not run
        SimConfig(**{name: hi})
        with pytest.raises(Exception):
            SimConfig(**{name: hi + 1})
        with pytest.raises(Exception):
            SimConfig(**{name: lo - 1})
