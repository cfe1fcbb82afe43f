"""kvslots.config's public calls with wrong types and values a file could not hold: a kvslots
error (ConfigError, ArgumentTypeError), never a TypeError, AttributeError or ValueError from
inside, and never a NaN, a set or a cycle converted as if it were configuration."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping

import pytest

from kvslots.config import loader
from kvslots.config.schedule import DynamicSDSchedule, apply_lookahead
from kvslots.config.speculative import resolve_speculative_config
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, KVSlotsError


def _cycle() -> dict:
    d: dict = {}
    d["x"] = d
    return d


@pytest.mark.parametrize("doc, field", [
    ({"model_kwargs": {"a": float("nan")}}, "model_kwargs.a"),  # converted into hf_overrides
    ({"model_kwargs": {"a": float("-inf")}}, "model_kwargs.a"),
    ({"model_kwargs": {"a": {1, 2}}}, "model_kwargs.a"),
    ({"model_kwargs": {"a": object()}}, "model_kwargs.a"),
    ({"model_kwargs": {"a": b"bytes"}}, "model_kwargs.a"),
    ({"model_kwargs": _cycle()}, None),
    ({"max_batch_size": 10**30}, "max_batch_size"),  # max_num_seqs=10**30 was converted
    ({"max_num_tokens": -(10**30)}, "max_num_tokens"),
    ({"generation_config": {"k": [float("nan")]}}, None),
])
def test_a_mapping_gets_the_files_value_rules(doc, field):
    with pytest.raises(ConfigError) as ei:
        convert_trtllm_config(doc)
    if field is not None:
        assert ei.value.field == field, ei.value


@pytest.mark.parametrize("base, explicit", [([1], None), ("x", None), (None, "x"), (None, [("a", 1)]), (None, 5)])
def test_resolve_speculative_config_needs_mappings(base, explicit):
    with pytest.raises(ConfigError, match="must be a JSON object"):  # dict() of them: TypeError / ValueError
        resolve_speculative_config(base, explicit)


@pytest.mark.parametrize("text", [5, None, 1.5, memoryview(b"{}"), ["{}"], {"a": 1}])
def test_strict_json_needs_text(text):
    with pytest.raises(ArgumentTypeError):  # .isascii() of it was an AttributeError
        loader.loads_strict_json(text)
    with pytest.raises(ArgumentTypeError):
        loader.parse_json(text)


@pytest.mark.parametrize("path", [5, None, 1.5, ["a"]])
def test_read_config_text_needs_a_path(path):
    with pytest.raises(ArgumentTypeError):  # os.fspath's TypeError
        loader.read_config_text(path)


class _Target:
    def slot_info(self, rid):
        return rid

    def set_lookahead(self, rid, k):
        return 0


@pytest.mark.parametrize("target, ids", [(None, ["a"]), (object(), ["a"]), (_Target(), "ab"), (_Target(), None),
                                         (_Target(), 5), (_Target(), {"a"})])
def test_apply_lookahead_wrong_arguments(target, ids):
    schedule = DynamicSDSchedule.parse([[1, 4, 3], [5, 8, 1]], 3)
    with pytest.raises(ArgumentTypeError):
        apply_lookahead(target, ids, schedule)
    assert apply_lookahead(_Target(), ["a", "b"], schedule).k == 3


@pytest.mark.parametrize("k", [10**30, 2**63, -1, 0, 2.0, "2", True])
def test_speculators_num_speculative_tokens_override_is_bounded(tmp_path, k):
    import json

    from kvslots.config.speculators import load_speculators_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 2}], "verifier": {"name_or_path": "org/t"}}}))
    with pytest.raises(ConfigError) as ei:  # 10**30 went into vLLM's speculative config
        load_speculators_checkpoint(tmp_path, num_speculative_tokens=k)
    assert ei.value.field == "num_speculative_tokens"
    assert load_speculators_checkpoint(tmp_path, num_speculative_tokens=3).speculative_config["num_speculative_tokens"] == 3


def _spec_cycle() -> dict:
    d: dict = {"method": "ngram", "num_speculative_tokens": 2}
    d["x"] = d
    return d


@pytest.mark.parametrize("base, explicit", [
    ({"method": "ngram", "num_speculative_tokens": 2, "x": float("nan")}, None),
    (None, {"method": "ngram", "num_speculative_tokens": 2, "x": {1, 2}}),
    (None, {"method": "ngram", "num_speculative_tokens": 2**64}),
    (None, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": float("inf")}),
    (_spec_cycle(), None),
])
def test_resolve_speculative_config_gets_the_files_value_rules(base, explicit):
    with pytest.raises(ConfigError):  # returned as the speculative config
        resolve_speculative_config(base, explicit)


@pytest.mark.parametrize("method, why", [
    ("ng\0ram", "must not contain a NUL character"),
    ("eagle\udc80", "must be valid Unicode"),
    ("", "must not be empty"),
], ids=["nul", "lone-surrogate", "empty"])
def test_speculative_method_is_checked_as_text(capsys, method, why):
    # Only its type was checked: from Python a NUL or a lone surrogate came back in the config.
    spec = {"method": method, "num_speculative_tokens": 2}
    for base, explicit in ((None, spec), (spec, None)):
        with pytest.raises(ConfigError, match=why) as ei:
            resolve_speculative_config(base, explicit)
        assert ei.value.field == "speculative_config.method"
    if "\udc80" not in method:  # JSON on the command line: its own check refuses a lone surrogate
        from kvslots import cli

        capsys.readouterr()
        code = cli.main(["serve", "org/target", "--dry-run", "-q", "--speculative-config",
                         json.dumps(spec)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "speculative_config.method" in err, err
    assert resolve_speculative_config(None, {"method": "ngram", "num_speculative_tokens": 2})["method"] == "ngram"


def test_a_tilde_reference_with_a_nul_names_nothing():
    from kvslots.config.speculative import check_draft_model, classify_model

    # Expanding ~ with a NUL in the user name was getpwnam's ValueError out of classify_model.
    assert classify_model("~\0/x").kind == "missing"
    with pytest.raises(ConfigError, match="does not exist"):
        check_draft_model("~\0/x", "speculative_config.model")


@pytest.mark.parametrize("base", [5, 1.5, b"/tmp", ["/tmp"]])
def test_classify_model_base_must_be_a_path(base):
    from kvslots.config.speculative import classify_model

    with pytest.raises(ConfigError, match="base must be a directory path"):  # Path(5): TypeError
        classify_model("x", base=base)
    assert classify_model("x", base="/").kind in ("hub", "missing", "dir")


def test_a_path_model_is_converted_as_text_and_yaml_output_errs_as_json_does():
    from pathlib import Path

    r = convert_trtllm_config({"max_batch_size": 4}, model=Path("org/t"))
    assert r.engine_args["model"] == "org/t"  # the Path was kept: to_json refused it
    assert '"model": "org/t"' in r.to_json() and "model: org/t" in r.to_yaml()
    r.engine_args["bogus"] = object()
    with pytest.raises(ConfigError, match="cannot be written as YAML"):  # yaml's RepresenterError
        r.to_yaml()


class _EndlessYAML(io.RawIOBase):
    """A stream of comment lines without end (a pipe that never closes)."""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        b[:] = b"#" * len(b)
        return len(b)


@pytest.mark.parametrize("text", [None, 5, 1.5, ["a: 1"], {"a": 1}, memoryview(b"a: 1"), io.StringIO("a: 1"),
                                  pytest.param(io.BufferedReader(_EndlessYAML()), id="endless-stream")])
def test_parse_yaml_needs_text(text):
    # PyYAML reads a stream to its end: one without end was read for ever (no size limit);
    # None or an int was a ConfigError "invalid YAML: TypeError".
    with pytest.raises(ArgumentTypeError, match="YAML text must be a str or bytes"):
        loader.parse_yaml(text)


def test_parse_yaml_takes_text_as_a_file_holds_it():
    class Text(str):
        pass

    assert loader.parse_yaml(Text("a: 1")) == {"a": 1}  # was "invalid YAML: TypeError"
    assert loader.parse_yaml(b"\xef\xbb\xbfa: 1") == {"a": 1} == loader.parse_yaml(bytearray(b"a: 1"))
    # Bytes are UTF-8, as a file's are (read_config_text): PyYAML took UTF-16 and UTF-32 too.
    for data in ("a: 1\n".encode("utf-16"), "a: 1\n".encode("utf-32"), b"a: \xff\n"):
        with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0x"):
            loader.parse_yaml(data)


@pytest.mark.parametrize("limit, error", [("9", ArgumentTypeError), (1.5, ArgumentTypeError), (None, ArgumentTypeError),
                                          (True, ArgumentTypeError), (-1, InvalidArgumentError)])
def test_node_and_depth_limits_must_be_counts(limit, error):
    # parse_json / check_values: a TypeError from a comparison; parse_yaml: a ConfigError
    # "invalid YAML: TypeError", and -1 "more than -1 nodes ... (an alias bomb?)".
    with pytest.raises(error, match="max_nodes"):
        loader.parse_yaml("a: 1", max_nodes=limit)
    with pytest.raises(error, match="max_nodes"):
        loader.parse_json('{"a": 1}', max_nodes=limit)
    with pytest.raises(error, match="max_nodes"):
        loader.check_values({"a": 1}, max_nodes=limit)
    with pytest.raises(error, match="max_depth"):
        loader.check_values({"a": 1}, max_depth=limit)
    assert loader.parse_yaml("a: 1", max_nodes=3) == {"a": 1} == loader.parse_json('{"a": 1}', max_nodes=3)


class _RaisingItems(Mapping):
    """A Mapping whose reading raises (its __getitem__, so items() and get() fail)."""

    def __getitem__(self, key):
        raise ValueError("boom")

    def __iter__(self):
        return iter(["max_batch_size"])

    def __len__(self):
        return 1


class _RaisingIter(_RaisingItems):
    def __iter__(self):
        raise RuntimeError("boom")


@pytest.mark.parametrize("mapping", [_RaisingItems(), _RaisingIter(), {"kv_cache_config": _RaisingItems()}])
def test_a_mapping_whose_own_methods_raise_is_a_config_error(mapping):
    # The ValueError / RuntimeError came through check_values (a traceback from the API).
    for call in (lambda: convert_trtllm_config(mapping), lambda: loader.check_values(mapping),
                 lambda: resolve_speculative_config(mapping), lambda: resolve_speculative_config({}, mapping)):
        with pytest.raises(ConfigError, match="cannot be read as a mapping"):
            call()
    if not isinstance(mapping, dict):
        with pytest.raises(ConfigError, match="cannot be read as a mapping"):
            DynamicSDSchedule.from_speculative_config(mapping)


class _Int(int):
    def __index__(self):
        raise RuntimeError("index")

    def _raise(self, other):
        raise RuntimeError("compare")

    __lt__ = __le__ = __gt__ = __ge__ = _raise


class _Float(float):
    def _raise(self, other):
        raise RuntimeError("compare")

    __lt__ = __le__ = __gt__ = __ge__ = _raise


class _Key(str):
    """A key whose hash and equality are its identity: two of one text are two keys of a dict."""

    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other


def test_subclasses_of_the_json_types_are_read_as_their_values():
    # int / float subclasses whose comparisons raise were a RuntimeError from check_values and
    # from the converter's range checks; the result holds the exact built-in types.
    doc = {_Key("max_batch_size"): _Int(8), "kv_cache_config": {"free_gpu_memory_fraction": _Float(0.5)}}
    result = convert_trtllm_config(doc)
    assert result.engine_args == {"max_num_seqs": 8, "gpu_memory_utilization": 0.5}
    assert [type(v) for v in result.engine_args.values()] == [int, float]
    spec = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": _Int(3)})
    assert spec == {"method": "ngram", "num_speculative_tokens": 3} and type(spec["num_speculative_tokens"]) is int
    plain = loader.check_values({"a": [_Int(1), _Float(2.5), _Key("x")]})
    assert plain == {"a": [1, 2.5, "x"]} and [type(v) for v in plain["a"]] == [int, float, str]


def test_two_keys_of_one_text_are_a_key_given_twice():
    doc = {_Key("max_batch_size"): 1, _Key("max_batch_size"): 2}
    for call in (lambda: convert_trtllm_config(doc), lambda: loader.check_values(doc)):
        with pytest.raises(ConfigError, match="'max_batch_size': given twice"):
            call()


class _BadPath(os.PathLike):
    def __fspath__(self):
        raise RuntimeError("fspath")


class _IntPath(os.PathLike):
    def __fspath__(self):
        return 5


@pytest.mark.parametrize("path", [_BadPath(), _IntPath()])
def test_a_pathlike_that_names_no_path_is_a_kvslots_error(path):
    # The PathLike's own error (a RuntimeError), or os.fspath's TypeError in convert_trtllm_config.
    from kvslots.config.speculative import classify_model
    from kvslots.config.speculators import load_speculators_checkpoint

    for call in (lambda: convert_trtllm_config(path), lambda: loader.read_config_text(path),
                 lambda: load_speculators_checkpoint(path), lambda: classify_model(path),
                 lambda: convert_trtllm_config({}, model=path)):
        with pytest.raises(KVSlotsError):
            call()
