"""Speculators-format checkpoints -> vLLM speculative config."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest

from kvslots import ConfigError
from kvslots.config.speculative import classify_model, is_hub_id
from kvslots.config.speculators import is_speculators_checkpoint, load_speculators_checkpoint

VERIFIER_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}

SPECULATOR_CONFIG = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": "0.1.0",
    "draft_vocab_size": 1000,
    "norm_before_residual": True,
    "target_hidden_size": 64,
    "transformer_layer_config": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 1000,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    },
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3},
                             {"proposal_type": "tree", "speculative_tokens": 5}],
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                     "architectures": ["LlamaForCausalLM"]},
    },
}


def write_dir(path: Path, config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (path / "config.json").write_text(text)
    return path


def spec_with(**changes) -> dict:
    cfg = copy.deepcopy(SPECULATOR_CONFIG)
    for dotted, value in changes.items():
        node = cfg
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return cfg


_DELETE = object()


def test_hub_verifier(tmp_path):
    d = write_dir(tmp_path / "spec", SPECULATOR_CONFIG)
    ck = load_speculators_checkpoint(d)
    assert ck.method == "eagle3" and ck.num_speculative_tokens == 3  # the first proposal method
    assert ck.verifier == "meta-llama/Llama-3.1-8B-Instruct" and not ck.verifier_is_local
    assert ck.speculative_config == {"method": "eagle3", "model": str(d.resolve()), "num_speculative_tokens": 3}
    assert ck.path == str(d.resolve())
    assert ck.warnings == []
    assert is_speculators_checkpoint(d)


def test_relative_local_verifier_is_resolved_against_the_checkpoint(tmp_path, monkeypatch):
    write_dir(tmp_path / "models" / "verifier", VERIFIER_CONFIG)
    d = write_dir(tmp_path / "models" / "spec", spec_with(speculators_config__verifier__name_or_path="../verifier"))
    monkeypatch.chdir(tmp_path)  # not where vLLM would look
    ck = load_speculators_checkpoint(d)
    assert ck.verifier_is_local
    assert ck.verifier == str((tmp_path / "models" / "verifier").resolve())
    assert ck.verifier_declared == "../verifier"
    assert any("resolved against the checkpoint directory" in w for w in ck.warnings)
    # A bare directory name next to config.json is local too.
    write_dir(d / "target", VERIFIER_CONFIG)
    d2 = write_dir(tmp_path / "models" / "spec", spec_with(speculators_config__verifier__name_or_path="target"))
    assert load_speculators_checkpoint(d2).verifier == str((d / "target").resolve())


def test_absolute_local_verifier(tmp_path):
    v = write_dir(tmp_path / "verifier", VERIFIER_CONFIG)
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__verifier__name_or_path=str(v)))
    ck = load_speculators_checkpoint(d)
    assert ck.verifier == str(v.resolve()) and ck.verifier_is_local and ck.warnings == []


def test_missing_local_verifier_is_an_error_naming_the_field(tmp_path):
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__verifier__name_or_path="/nonexistent/llama"))
    with pytest.raises(ConfigError) as ei:
        load_speculators_checkpoint(d)
    assert ei.value.field == "speculators_config.verifier.name_or_path"
    assert "does not exist" in str(ei.value) and "config.json" in str(ei.value)
    # ... and an explicit verifier fixes it.
    v = write_dir(tmp_path / "here", VERIFIER_CONFIG)
    ck = load_speculators_checkpoint(d, verifier=v)
    assert ck.verifier == str(v.resolve())
    assert any("overrides" in w for w in ck.warnings)
    ck = load_speculators_checkpoint(d, verifier="org/other-model")
    assert ck.verifier == "org/other-model" and not ck.verifier_is_local
    with pytest.raises(ConfigError) as ei:
        load_speculators_checkpoint(d, verifier="./missing")
    assert ei.value.field == "verifier"


@pytest.mark.parametrize("declared", ["org/sub/model", "models/llama/8b", "my model", "org/..", "x/../y"])
def test_verifier_that_is_neither_local_nor_a_hub_id_is_an_error(tmp_path, declared):
    # Nothing of that name next to the checkpoint, and no Hub id is spelled so: it is a missing
    # local path (the speculators reader once passed these to vLLM as Hub ids).
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__verifier__name_or_path=declared))
    with pytest.raises(ConfigError) as ei:
        load_speculators_checkpoint(d)
    assert ei.value.field == "speculators_config.verifier.name_or_path"
    assert "does not exist" in str(ei.value)


def test_model_references_are_classified_in_one_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = write_dir(tmp_path / "plain", VERIFIER_CONFIG)
    spec = write_dir(tmp_path / "spec", SPECULATOR_CONFIG)
    eagle = write_dir(tmp_path / "eagle", dict(VERIFIER_CONFIG, architectures=["EagleLlamaForCausalLM"]))
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "file").write_text("x")
    ref = classify_model("plain")
    assert (ref.kind, ref.is_local, ref.has_config, ref.path) == ("dir", True, True, str(plain.resolve()))
    assert not ref.is_speculators and ref.draft_method is None
    assert classify_model(spec).is_speculators and classify_model(spec).draft_method[0] == "eagle3"
    assert classify_model(eagle).draft_method[0] == "eagle"
    ref = classify_model("noconfig")
    assert ref.kind == "dir" and not ref.has_config and ref.config is None
    assert classify_model("file").kind == "not_dir"
    assert classify_model("../plain", base=tmp_path / "spec").path == str(plain.resolve())
    for hub in ("meta-llama/Llama-3.1-8B-Instruct", "gpt2", "org/model.v2"):
        assert classify_model(hub).kind == "hub" and is_hub_id(hub)
    for missing in ("/nonexistent/llama", "./x", "../x", "~/nope-x", "a/b/c", "my model", "org/", "x/..", "-x"):
        assert classify_model(missing).kind == "missing" and not is_hub_id(missing), missing


NO_USER = "~kvslots-no-such-user-x9"
LONG = "m" * 300  # a path component past NAME_MAX (255 bytes): stat() fails with ENAMETOOLONG


@pytest.mark.parametrize("name", [f"{NO_USER}/llama", LONG, f"/tmp/{LONG}/x", "a\0b", "org/model\n",
                                  "x" * 97, "caf\u00e9/model"])
def test_references_the_system_cannot_look_up_are_missing(tmp_path, monkeypatch, name):
    # ~ of no user (expanduser: RuntimeError), a component too long (OSError), a NUL, a newline
    # after a Hub id, a Hub part past 96 characters, non-ASCII: none is a Hub id, nothing is there.
    monkeypatch.chdir(tmp_path)
    ref = classify_model(name)
    assert ref.kind == "missing" and not is_hub_id(name), ref
    with pytest.raises(ConfigError, match="is not a directory"):
        load_speculators_checkpoint(name)
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__verifier__name_or_path=name))
    with pytest.raises(ConfigError, match="does not exist") as ei:
        load_speculators_checkpoint(d)
    assert ei.value.field == "speculators_config.verifier.name_or_path"
    with pytest.raises(ConfigError, match="does not exist"):
        load_speculators_checkpoint(write_dir(tmp_path / "spec2", SPECULATOR_CONFIG), verifier=name)


def test_a_config_json_that_is_not_a_regular_file_is_no_config(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / "config.json")  # reading it would block: never opened
    ref = classify_model(str(d))
    assert ref.kind == "dir" and not ref.has_config and ref.config is None
    with pytest.raises(ConfigError, match=r"config.json: not a regular file \(a FIFO\)"):  # not opened
        load_speculators_checkpoint(d)


def test_hub_ids_are_matched_whole():
    assert is_hub_id("org/model") and is_hub_id("o" * 96 + "/" + "m" * 96)
    for name in ("org/model\n", "org/model\nx", "o" * 97 + "/m", "org/" + "m" * 97, "org/m\u00e9", "org/..x"):
        assert not is_hub_id(name), name


@pytest.mark.parametrize("name", [5, None, 1.5, ["a"], b"org/model"])
def test_a_reference_that_is_not_a_string_is_a_config_error(tmp_path, name):
    with pytest.raises(ConfigError, match="must be a path or a Hub id"):
        classify_model(name)
    with pytest.raises(ConfigError, match="must be a path or a Hub id"):
        load_speculators_checkpoint(name)
    if name is not None:
        with pytest.raises(ConfigError, match="verifier must be a path or a Hub id"):
            load_speculators_checkpoint(write_dir(tmp_path / "spec", SPECULATOR_CONFIG), verifier=name)


@pytest.mark.parametrize("config, method", [
    ({"architectures": 5}, None),
    ({"architectures": "EagleLlamaForCausalLM"}, None),  # a string, not a list: no evidence
    ({"architectures": [5, None, {"a": 1}, "EagleLlamaForCausalLM"]}, "eagle"),
    ({"model_type": 5}, None),
    ({"model_type": ["eagle"]}, None),
    ({"speculators_config": {}, "speculators_model_type": ["eagle3"]}, None),
    ({"speculators_config": {}, "speculators_model_type": {"eagle3": 1}}, None),
    ({"speculators_config": {}, "speculators_model_type": "eagle3"}, "eagle3"),
])
def test_draft_method_takes_only_strings_as_evidence(tmp_path, config, method):
    ref = classify_model(str(write_dir(tmp_path / "draft", config)))
    found = ref.draft_method
    assert (found[0] if found else None) == method


def test_verifier_that_is_a_file_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__verifier__name_or_path="../weights.bin"))
    with pytest.raises(ConfigError, match="not a directory"):
        load_speculators_checkpoint(d)


@pytest.mark.parametrize(
    "model_type, method, extra",
    [("eagle3", "eagle3", {}), ("peagle", "eagle3", {"parallel_drafting": True}),
     ("dflash", "dflash", {}), ("dflash2", "dflash", {}), ("dspark", "dspark", {})],
)
def test_methods(tmp_path, model_type, method, extra):
    d = write_dir(tmp_path / "spec", spec_with(speculators_model_type=model_type))
    ck = load_speculators_checkpoint(d)
    assert ck.method == method and ck.speculators_model_type == model_type
    assert ck.speculative_config == {"method": method, "model": str(d.resolve()), "num_speculative_tokens": 3, **extra}


def test_default_proposal_method_mismatch_warns_and_override_k(tmp_path):
    d = write_dir(tmp_path / "spec", spec_with(speculators_config__default_proposal_method="tree"))
    ck = load_speculators_checkpoint(d)
    assert ck.num_speculative_tokens == 3
    assert any("first proposal method" in w for w in ck.warnings)
    ck = load_speculators_checkpoint(d, num_speculative_tokens=2)
    assert ck.num_speculative_tokens == 2 and ck.speculative_config["num_speculative_tokens"] == 2
    with pytest.raises(ConfigError) as ei:
        load_speculators_checkpoint(d, num_speculative_tokens=0)
    assert ei.value.field == "num_speculative_tokens"


@pytest.mark.parametrize(
    "changes, field, fragment",
    [
        ({"speculators_config": _DELETE}, "speculators_config", "not a speculators checkpoint"),
        ({"speculators_config": [1]}, "speculators_config", "must be an object"),
        ({"speculators_model_type": _DELETE}, "speculators_model_type", "non-empty string"),
        ({"speculators_model_type": "medusa"}, "speculators_model_type", "unsupported speculators model type 'medusa'"),
        ({"speculators_model_type": "eagle"}, "speculators_model_type", "unsupported"),
        ({"transformer_layer_config": _DELETE}, "transformer_layer_config", "must be an object"),
        ({"transformer_layer_config": "llama"}, "transformer_layer_config", "must be an object"),
        ({"speculators_config__proposal_methods": _DELETE}, "speculators_config.proposal_methods", "non-empty list"),
        ({"speculators_config__proposal_methods": []}, "speculators_config.proposal_methods", "non-empty list"),
        ({"speculators_config__proposal_methods": {"a": 1}}, "speculators_config.proposal_methods", "non-empty list"),
        ({"speculators_config__proposal_methods": ["greedy"]}, "speculators_config.proposal_methods[0]", "must be an object"),
        ({"speculators_config__proposal_methods": [{"proposal_type": "greedy"}]},
         "speculators_config.proposal_methods[0].speculative_tokens", "must be an integer"),
        ({"speculators_config__proposal_methods": [{"speculative_tokens": "3"}]},
         "speculators_config.proposal_methods[0].speculative_tokens", "must be an integer"),
        ({"speculators_config__proposal_methods": [{"speculative_tokens": True}]},
         "speculators_config.proposal_methods[0].speculative_tokens", "must be an integer"),
        ({"speculators_config__proposal_methods": [{"speculative_tokens": 0}]},
         "speculators_config.proposal_methods[0].speculative_tokens", "must be >= 1"),
        ({"speculators_config__verifier": _DELETE}, "speculators_config.verifier", "must be an object"),
        ({"speculators_config__verifier": "llama"}, "speculators_config.verifier", "must be an object"),
        ({"speculators_config__verifier__name_or_path": _DELETE}, "speculators_config.verifier.name_or_path", "non-empty string"),
        ({"speculators_config__verifier__name_or_path": ""}, "speculators_config.verifier.name_or_path", "non-empty string"),
        ({"speculators_config__verifier__name_or_path": 7}, "speculators_config.verifier.name_or_path", "non-empty string"),
    ],
)
def test_malformed_configs_name_the_field(tmp_path, changes, field, fragment):
    d = write_dir(tmp_path / "spec", spec_with(**changes))
    with pytest.raises(ConfigError) as ei:
        load_speculators_checkpoint(d)
    assert ei.value.field == field, str(ei.value)
    assert fragment in str(ei.value)
    assert ei.value.source == str(d / "config.json")


def test_bad_directories(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        load_speculators_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_speculators_checkpoint(tmp_path / "empty")
    d = write_dir(tmp_path / "badjson", "{not json")
    with pytest.raises(ConfigError, match="invalid JSON: .* line 1"):
        load_speculators_checkpoint(d)
    d = write_dir(tmp_path / "list", "[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_speculators_checkpoint(d)
    assert not is_speculators_checkpoint(tmp_path / "list")
    assert not is_speculators_checkpoint(write_dir(tmp_path / "plain", VERIFIER_CONFIG))
    assert not is_speculators_checkpoint(tmp_path / "missing")


# ------------------------------------------------------------------ with vLLM

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def vllm():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not importable in this environment; the speculators checks against vLLM need it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm as v
        from vllm.engine.arg_utils import EngineArgs  # noqa: F401 - the slow import, once
    except ImportError as e:
        pytest.skip(f"vLLM is not importable ({e}); the speculators checks against vLLM need it")
    return v


def test_vllm_rejects_relative_verifier_but_our_config_builds(vllm, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    write_dir(tmp_path / "models" / "verifier", VERIFIER_CONFIG)
    d = write_dir(tmp_path / "models" / "spec", spec_with(speculators_config__verifier__name_or_path="../verifier"))
    # vLLM resolves the verifier against its working directory and rejects it ...
    with pytest.raises(Exception, match="(?i)invalid repository id or local directory"):
        EngineArgs(model=str(d), skip_tokenizer_init=True, max_model_len=256).create_engine_config()
    # ... while the converted configuration builds, SpeculativeConfig included.
    ck = load_speculators_checkpoint(d)
    cfg = EngineArgs(model=ck.verifier, skip_tokenizer_init=True, max_model_len=256,
                     speculative_config=ck.speculative_config).create_engine_config()
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.speculative_config.num_speculative_tokens == 3
    assert cfg.speculative_config.model == str(d.resolve())
    assert cfg.model_config.model == ck.verifier


def test_vllm_agrees_on_hub_verifier_config(vllm, tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    for model_type in ("eagle3", "peagle", "dflash2"):
        cfg = spec_with(speculators_model_type=model_type)
        d = write_dir(tmp_path / model_type, cfg)
        ours = load_speculators_checkpoint(d).speculative_config
        theirs = SpeculatorsConfig.extract_vllm_speculative_config(cfg)
        assert {k: v for k, v in ours.items() if k != "model"} == theirs
