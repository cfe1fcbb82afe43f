"""A configuration document's text is bounded with YAML aliases expanded, and the lines kvslots
writes about bad input are bounded whatever the input quotes.

The loader counted an alias as the nodes it names but not the text: one 1 MB string named by
1,000 aliases (a 1 MB file) was 1 GB once a note on stderr wrote the value out (10 s, 2.3 GB
for ``kvslots convert-config``; 300 GB for a 4 MB file). And PyYAML quotes a tag or an alias
name whole in its message: a 4 MB tag was a 4 MB error line."""

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


LONG = 4 * 1024 * 1024 - 100


@pytest.mark.parametrize("text, says", [
    ("a: !<" + "t" * LONG + "> 1\n", "could not determine a constructor for the tag"),
    ("a: !" + "t" * LONG + " 1\n", "could not determine a constructor for the tag"),
    ("a: *" + "n" * LONG + "\n", "found undefined alias"),
    ("a: &" + "n" * MB + " [*" + "n" * MB + "]\n", "inside the node it names"),
], ids=["verbatim-tag", "local-tag", "undefined-alias", "alias-inside-its-node"])
def test_yaml_messages_quote_a_long_name_cut(text, says):
    with pytest.raises(ConfigError) as e:
        parse_yaml(text, "e.yaml")
    message = str(e.value)
    assert says in message and len(message) < 400, len(message)
    assert message.endswith(("at line 1 column 4", "at line 1")), message[-80:]


def test_an_error_line_quoting_a_long_value_is_cut_in_the_middle(tmp_path, capsys):
    # A speculators checkpoint whose verifier is a 1 MB name: the error quoted it twice (2 MB).
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}],
                               "verifier": {"name_or_path": "v/" * (MB // 2)}}}))
    engine = tmp_path / "e.yaml"
    engine.write_text("max_batch_size: 8\n")
    capsys.readouterr()
    assert cli.main(["convert-config", "--speculators-dir", str(ckpt), str(engine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= cli.MAX_LINE_CHARS + 1, len(err)
    assert err.startswith("kvslots convert-config: error: ") and "local verifier path 'v/v/" in err
    # The path is quoted briefly (2752071: at most 200 characters), so the line needs no cut and
    # keeps its hint; the cut in the middle is for lines still too long (the test below).
    assert len(err) < 1000 and err.rstrip().endswith("(verifier=... / --verifier)"), len(err)


def test_an_argument_error_quoting_a_long_value_is_one_bounded_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m", "--pd-port", "9" * MB])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and len(err) <= cli.MAX_LINE_CHARS + 1, len(err)
    assert err.startswith("kvslots serve: error: argument --pd-port:")


def test_one_line_leaves_a_short_line_as_it_was():
    assert cli.one_line("a\nb") == "a\\nb"
    line = "x" * cli.MAX_LINE_CHARS
    assert cli.one_line(line) is line
