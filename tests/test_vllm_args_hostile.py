"""The helpers that write vLLM's command line (kvslots.config.vllm_args, exported in its
``__all__``) take only what they can write: a wrong type is an ArgumentTypeError, a value JSON
has no text for a ConfigError, at once (``check_exec_strings(range(10**12))`` read on without
end, a non-str key was an AttributeError, NaN was written as ``NaN``, which vLLM's JSON parser
refuses once started)."""

from __future__ import annotations

import time

import pytest

from kvslots.config.vllm_args import check_exec_strings, engine_flag, flag_name, to_json
from kvslots.errors import ArgumentTypeError, ConfigError


class Text(str):
    def replace(self, *a):  # a subclass's own methods must not run
        raise RuntimeError("ran")


@pytest.mark.parametrize("argv", [range(10**12), (str(i) for i in range(10**12)), None, "ab", [b"x"], ["a", 1],
                                  [Text("a")]])
def test_check_exec_strings_refuses_what_is_no_list_of_str_at_once(argv) -> None:
    t = time.monotonic()
    with pytest.raises(ArgumentTypeError, match="argv"):
        check_exec_strings(argv)
    assert time.monotonic() - t < 1.0


@pytest.mark.parametrize("env", [["A=1"], {"A": 1}, {1: "a"}, {"A": b"1"}])
def test_check_exec_strings_refuses_an_env_that_is_no_mapping_of_str(env) -> None:
    with pytest.raises(ArgumentTypeError, match="env"):
        check_exec_strings(["vllm"], env)


def test_check_exec_strings_still_takes_a_good_command() -> None:
    check_exec_strings(("vllm", "serve", "--port", "8000"), {"VLLM_X": "1"})
    with pytest.raises(ConfigError, match="NUL"):
        check_exec_strings(["vllm", "a\0b"])


@pytest.mark.parametrize("key", [None, 5, b"max_model_len", ["k"], Text("max_model_len")])
def test_a_flag_name_is_a_str(key) -> None:
    with pytest.raises(ArgumentTypeError, match="name must be a str"):
        engine_flag(key, 1)
    with pytest.raises(ArgumentTypeError):
        flag_name(key)


@pytest.mark.parametrize("value", [{"a": float("nan")}, {"a": float("inf")}, {"a": object()}, {(1, 2): 3}])
def test_a_value_json_has_no_text_for_is_a_config_error(value) -> None:
    with pytest.raises(ConfigError, match="no JSON"):
        engine_flag("speculative_config", value)
    with pytest.raises(ConfigError):
        to_json(value)


def test_deep_nesting_is_a_config_error() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError):
        to_json({"a": deep})


def test_good_values_are_written_as_before() -> None:
    assert engine_flag("max_model_len", 4096) == ["--max-model-len", "4096"]
    assert engine_flag("enforce_eager", False) == ["--no-enforce-eager"]
    assert engine_flag("speculative_config", {"k": 1.5}) == ["--speculative-config", '{"k":1.5}']
    assert engine_flag("tokenizer", "-x") == ["--tokenizer=-x"]
