"""K (num_speculative_tokens) is at most MAX_NUM_SPECULATIVE_TOKENS (128: vLLM's rejection sampler
verifies at most 128 draft tokens per request in a step) wherever kvslots reads it: an
--speculative-config, a speculators checkpoint and its override, a TRT-LLM max_draft_len or
num_nextn_predict_layers. It was bounded only at 64 bits: 129 passed vLLM's own config check
(> 0) and met the sampler's assert only in the engine."""

from __future__ import annotations

import json

import pytest

from kvslots import cli
from kvslots.config.speculative import MAX_NUM_SPECULATIVE_TOKENS, resolve_speculative_config
from kvslots.config.speculators import load_speculators_checkpoint
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import ConfigError


def test_the_bound_is_vllms_rejection_sampler_limit():
    rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    assert MAX_NUM_SPECULATIVE_TOKENS == rs.MAX_SPEC_LEN == 128


@pytest.mark.parametrize("k", [129, 1000, 2**63 - 1])
def test_speculative_config_k_is_bounded(k):
    with pytest.raises(ConfigError, match="must be <= 128") as ei:
        resolve_speculative_config(None, {"method": "ngram", "num_speculative_tokens": k})
    assert ei.value.field == "speculative_config.num_speculative_tokens"
    assert resolve_speculative_config(None, {"method": "ngram", "num_speculative_tokens": 128}) is not None


def _checkpoint(tmp_path, k: int):
    (tmp_path / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": k}], "verifier": {"name_or_path": "org/t"}}}))
    return tmp_path


def test_speculators_checkpoint_k_and_its_override_are_bounded(tmp_path):
    with pytest.raises(ConfigError, match="must be <= 128") as ei:
        load_speculators_checkpoint(_checkpoint(tmp_path, 129))
    assert ei.value.field == "speculators_config.proposal_methods[0].speculative_tokens"
    d = _checkpoint(tmp_path, 3)
    with pytest.raises(ConfigError, match=r"must be <= 128") as ei:
        load_speculators_checkpoint(d, num_speculative_tokens=129)
    assert ei.value.field == "num_speculative_tokens"
    assert load_speculators_checkpoint(d, num_speculative_tokens=128).speculative_config["num_speculative_tokens"] == 128
    assert load_speculators_checkpoint(_checkpoint(tmp_path, 128)).speculative_config["num_speculative_tokens"] == 128


@pytest.mark.parametrize("spec, field", [
    ({"decoding_type": "NGram", "max_draft_len": 129}, "speculative_config.max_draft_len"),
    ({"decoding_type": "MTP", "max_draft_len": 500}, "speculative_config.max_draft_len"),
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 129}, "speculative_config.num_nextn_predict_layers"),
    ({"decoding_type": "SA", "max_draft_len": 2**40}, "speculative_config.max_draft_len"),
])
def test_trtllm_draft_length_is_bounded(spec, field):
    with pytest.raises(ConfigError, match="must be <= 128") as ei:
        convert_trtllm_config({"speculative_config": spec})
    assert ei.value.field == field
    ok = {**spec, **{k: 128 for k in ("max_draft_len", "num_nextn_predict_layers") if k in spec}}
    assert convert_trtllm_config({"speculative_config": ok}).engine_args["speculative_config"]["num_speculative_tokens"] == 128


@pytest.mark.parametrize("argv", [
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 129}'],
    ["--", "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "1000"],
])
def test_serve_refuses_k_past_the_bound_in_one_line(capsys, argv):
    capsys.readouterr()
    code = cli.main(["serve", "org/target", "--dry-run", "-q", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "num_speculative_tokens" in err and "<= 128" in err, err
