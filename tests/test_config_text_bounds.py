"""A configuration document's text is bounded with YAML aliases expanded.

The loader counted an alias as the nodes it names but not the text: one 1 MB string named by
1,000 aliases (a 1 MB file) was 1 GB once a note on stderr wrote the value out (10 s, 2.3 GB
for ``kvslots convert-config``; 300 GB for a 4 MB file)."""

from __future__ import annotations

import json
import time

import pytest

from kvslots import cli
from kvslots.config.loader import MAX_BYTES, MAX_TEXT_CHARS, check_values, parse_json, parse_yaml
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import ConfigError

MB = 1_000_000
TOO_MUCH = "characters of keys and strings"


def string_bomb(aliases: int, size: int = MB) -> str:
    return f"a: &a {'x' * size}\nb: [{', '.join(['*a'] * aliases)}]\n"


def test_aliases_of_a_long_string_are_refused_by_their_text():
    with pytest.raises(ConfigError, match=TOO_MUCH) as e:
        parse_yaml(string_bomb(8), "e.yaml")
    assert e.value.source == "e.yaml" and e.value.field.startswith("b[")
    # A few repeats of short text, as anchors are meant to be used, still read.
    doc = parse_yaml("a: &a {model: m, n: 1}\nb: *a\nc: [*a, *a]\n")
    assert doc["c"] == [{"model": "m", "n": 1}] * 2


def test_aliases_of_a_mapping_count_its_keys():
    keys = ", ".join(f"k{i:0900d}: 1" for i in range(100))  # 90 KB of keys, 201 nodes
    text = f"a: &a {{{keys}}}\nb: [{', '.join(['*a'] * 60)}]\n"  # 5.4 MB of keys, 12,000 nodes
    with pytest.raises(ConfigError, match=TOO_MUCH):
        parse_yaml(text)


def test_a_value_given_more_than_once_in_code_counts_each_time():
    s = "y" * MB
    with pytest.raises(ConfigError, match=TOO_MUCH):
        check_values({"a": [s] * 8})
    assert check_values({"a": [s] * 4}) == {"a": [s] * 4}


@pytest.mark.parametrize("parse", [parse_yaml, parse_json])
def test_a_file_as_large_as_may_be_read_is_not_too_much_text(parse):
    # Without aliases a document holds no more text than its file's bytes: the limit refuses none.
    assert MAX_TEXT_CHARS >= MAX_BYTES
    text = json.dumps({"k" * 1000: "v" * (MAX_BYTES - 1100)})
    assert len(text.encode()) <= MAX_BYTES
    assert len(parse(text)["k" * 1000]) == MAX_BYTES - 1100


def test_convert_config_refuses_a_string_alias_bomb_at_once(tmp_path, capsys):
    f = tmp_path / "bomb.yaml"
    f.write_text(string_bomb(50))  # 50 MB once written out; the old code wrote it into a note
    capsys.readouterr()
    start = time.monotonic()
    code = cli.main(["convert-config", str(f)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err[:300]
    assert TOO_MUCH in err and time.monotonic() - start < 5
    with pytest.raises(ConfigError, match=TOO_MUCH):
        convert_trtllm_config(str(f))
