""":func:`kvslots.config.loader.check_values` refuses a value past its node limit before it makes
an entry per item: a config.json holding a list of 1.9M numbers (3.8 MB, within the file limit)
took 4.2 s and 360 MB to refuse in ``kvslots serve MODEL`` (read twice), a mapping of 10**6 keys
given in code copied every pair first."""

from __future__ import annotations

import tracemalloc

import pytest

from kvslots.config.loader import MAX_NODES, check_values, load_json
from kvslots.errors import ConfigError


def _peak(call) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=f"more than {MAX_NODES} values; not a configuration file"):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("value", [
    {"x": [1] * 1_000_000},
    {f"k{i}": 1 for i in range(1_000_000)},
    [[0] * 60_000, [0] * 1_000_000],  # the first walked, the second past what is left
], ids=["list", "mapping", "second-list"])
def test_a_value_past_the_node_limit_is_refused_before_its_items_are_walked(value):
    assert _peak(lambda: check_values(value)) < 20 * 2**20  # ~150 MB when an entry was made per item


def test_a_config_json_past_the_node_limit_costs_its_parse_only(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"architectures": ["LlamaForCausalLM"], "x": [' + ",".join(["1"] * 1_000_000) + "]}")
    assert _peak(lambda: load_json(f)) < 40 * 2**20  # the text and the parsed list, ~17 MB
    f.write_text('{"x": [' + ",".join(["1"] * (MAX_NODES - 2)) + "]}")  # at the limit: read
    assert len(load_json(f)["x"]) == MAX_NODES - 2
