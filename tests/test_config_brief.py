"""A value quoted in a message (:func:`kvslots.config.loader.brief`, the one home of that rule)
costs what its first 60 characters cost, whatever the value: a list nested 100,000 deep given
where a path or a number belongs was a RecursionError from ``repr`` (not a kvslots error) out of
every public config call that names a wrong value, and a list of 10**8 items a 300 MB ``repr``
cut to 60 characters."""

from __future__ import annotations

import pytest

from kvslots.config import loader
from kvslots.config.loader import brief, dump_json
from kvslots.config.schedule import DynamicSDSchedule
from kvslots.config.speculative import classify_model, resolve_speculative_config
from kvslots.config.speculators import load_speculators_checkpoint
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import KVSlotsError
from kvslots.serve.cli import plan_from_argv


def nested(depth: int) -> list:
    outer = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


DEEP = nested(100_000)
SCHEDULE = DynamicSDSchedule.parse([[1, 4, 3], [5, 8, 1]], 3)


@pytest.mark.parametrize("call", [
    lambda v: convert_trtllm_config({}, model=v),
    lambda v: convert_trtllm_config({}, speculators_dir=v),
    lambda v: load_speculators_checkpoint(v),
    lambda v: DynamicSDSchedule.parse([[1, 4, 3]], v),
    lambda v: DynamicSDSchedule.from_draft_len_schedule(v, 3),
    lambda v: SCHEDULE.k_for_batch_size(v),
    lambda v: SCHEDULE.dense(v),
    lambda v: classify_model(v),
    lambda v: resolve_speculative_config(v),
    lambda v: loader.read_config_text("x.yaml", max_bytes=v),
    lambda v: plan_from_argv(v),
], ids=["convert-model", "convert-speculators-dir", "speculators", "schedule-nst", "draft-len-schedule",
        "k-for-batch-size", "dense", "classify-model", "resolve-speculative-config", "read-max-bytes",
        "serve-plan-argv"])
def test_a_deeply_nested_wrong_value_is_a_kvslots_error(call):
    with pytest.raises(KVSlotsError):
        call(DEEP)


class CountsRepr:
    calls = 0

    def __repr__(self) -> str:
        CountsRepr.calls += 1
        return "c"


def test_brief_reads_no_more_of_a_value_than_it_shows():
    CountsRepr.calls = 0
    assert brief([CountsRepr()] * 100_000) == ("[" + ", ".join(["c"] * 30))[:57] + "..."
    assert CountsRepr.calls <= 60
    assert brief(DEEP) == "[" * 57 + "..."
    assert brief({"k": [CountsRepr()] * 100_000}).startswith("{'k': [c, c")


@pytest.mark.parametrize("value", [
    None, True, -5, 2**63, 1.5, float("nan"), "", "x" * 59, "x" * 200, "it's", 'say "hi"', "\n\x00é",
    [1, "a", None], (1,), (), {"b": 1, "a": [2, {"c": ()}]}, {}, [[[]]], list(range(100)),
    {str(i): i for i in range(40)}, b"bytes",
])
def test_brief_is_repr_cut_to_the_limit(value):
    text = repr(value)
    for limit in (60, 80, 20):
        assert brief(value, limit) == (text if len(text) <= limit else text[: limit - 3] + "...")


def test_brief_of_what_repr_cannot_write_names_its_type():
    class Raises:
        def __repr__(self):
            raise RuntimeError("no")

    assert brief(Raises()) == "<Raises>"
    assert brief(10**5000) == "<int of 16610 bits>"


def test_dump_json_of_a_mapping_that_cannot_be_read_is_a_config_error():
    class BadItems(dict):
        def items(self):
            raise RuntimeError("no")

    with pytest.raises(KVSlotsError, match="reading it raised RuntimeError"):
        dump_json(BadItems(a=1))


JSON_VALUES = [
    None, True, False, -5, 2**63, 1.5, "", "x" * 59, "x" * 200, "it's", 'say "hi"', "\n\x00é",
    [1, "a", None], [], {"b": 1, "a": [2, {"c": [True]}]}, {}, [[[]]], list(range(100)),
    {str(i): i for i in range(40)}, {"method": "eagle3", "num_speculative_tokens": 3},
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_brief_plain_is_the_value_as_written_cut_to_the_limit(value):
    # plain=True: what vllm_args.brief and trtllm.result._short wrote (a str as it is, the rest
    # JSON), now from the one home with brief's bounded cost.
    import json

    text = value if isinstance(value, str) else json.dumps(value)
    for limit in (60, 80, 20):
        assert brief(value, limit, plain=True) == (text if len(text) <= limit else text[: limit - 3] + "...")


def test_brief_plain_reads_no_more_of_a_value_than_it_shows():
    CountsRepr.calls = 0
    assert brief({"k": [CountsRepr()] * 100_000}, plain=True).startswith('{"k": [c, c')
    assert CountsRepr.calls <= 60
    assert brief(DEEP, plain=True) == "[" * 57 + "..."
    assert brief(("a",) * 10**6, 20, plain=True) == '["a", "a", "a", "...'
    assert brief(float("nan"), plain=True) == "nan"


def test_conversion_notes_quote_an_ignored_value_briefly():
    from kvslots.config.trtllm.result import ConversionResult, IgnoredKey

    # json.dumps of the whole value: RecursionError out of notes(), and a 10**6-item list written
    # whole before it was cut.
    r = ConversionResult({}, ignored=[IgnoredKey("deep", DEEP, "r"), IgnoredKey("big", [0] * 10**6, "r", False),
                                      IgnoredKey("flag", True, "r", False), IgnoredKey("backend", "pytorch", "r")])
    assert r.notes() == ["ignored: deep = " + "[" * 57 + "... (r)", "unknown: big = [" + "0, " * 18 + "0,... (r)",
                         "unknown: flag = true (r)", "ignored: backend = pytorch (r)"]
