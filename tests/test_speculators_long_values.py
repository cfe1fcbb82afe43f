"""A speculators checkpoint's values are quoted briefly in the warnings and errors of
load_speculators_checkpoint: ``default_proposal_method`` of 3 MB was a 3 MB warning (printed by
kvslots serve, kept in SpeculatorsCheckpoint.warnings and ConversionResult.report()), a
``proposal_type`` of 20,000 nested lists a 180 kB one, and a checkpoint's verifier overridden by
``verifier=`` quoted whatever the file declared."""

from __future__ import annotations

import json

import pytest

from kvslots.config.speculators import load_speculators_checkpoint
from kvslots.errors import ConfigError

LONG = "e" * 3_000_000


def _checkpoint(tmp_path, *, default="eagle", proposal_type="eagle", declared=None, model_type="eagle3"):
    verifier = tmp_path / "verifier"
    verifier.mkdir(exist_ok=True)
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    doc = {"speculators_model_type": model_type, "transformer_layer_config": {"hidden_size": 8},
           "speculators_config": {"proposal_methods": [{"proposal_type": proposal_type, "speculative_tokens": 3}],
                                  "default_proposal_method": default,
                                  "verifier": {"name_or_path": str(verifier) if declared is None else declared}}}
    (draft / "config.json").write_text(json.dumps(doc))
    return draft, verifier


@pytest.mark.parametrize("kw", [dict(default=LONG), dict(proposal_type=[[[[1]]]] * 20_000)], ids=["default", "type"])
def test_a_long_value_is_a_short_warning(tmp_path, kw):
    draft, _ = _checkpoint(tmp_path, **kw)
    ckpt = load_speculators_checkpoint(draft)
    assert len(ckpt.warnings) == 1 and "vLLM uses the first proposal method" in ckpt.warnings[0]
    assert len(ckpt.warnings[0]) < 500, len(ckpt.warnings[0])


def test_an_overridden_long_verifier_is_a_short_warning(tmp_path):
    draft, verifier = _checkpoint(tmp_path, declared=LONG)
    ckpt = load_speculators_checkpoint(draft, verifier=str(verifier))
    assert ckpt.verifier == str(verifier)
    assert len(ckpt.warnings) == 1 and ckpt.warnings[0].startswith(f"verifier {str(verifier)!r} overrides")
    assert len(ckpt.warnings[0]) < 500 + len(str(verifier)), len(ckpt.warnings[0])


@pytest.mark.parametrize("kw, field", [(dict(model_type=LONG), "speculators_model_type"),
                                       (dict(declared=[LONG]), "speculators_config.verifier.name_or_path")])
def test_a_long_value_is_a_short_error(tmp_path, kw, field):
    draft, _ = _checkpoint(tmp_path, **kw)
    with pytest.raises(ConfigError) as e:
        load_speculators_checkpoint(draft)
    assert e.value.field == field
    assert len(str(e.value)) < 500 + len(str(draft)), len(str(e.value))


@pytest.mark.parametrize("declared", ["./" + "a" * 3_000_000, "./" + "/".join(["b" * 200] * 19), "org/" + "x" * 3_000_000],
                         ids=["long-name", "deep", "hub-like"])
def test_a_long_missing_local_verifier_is_a_short_error(tmp_path, declared):
    # The path declared and the one looked for were quoted whole (4,130 characters).
    draft, _ = _checkpoint(tmp_path, declared=declared)
    with pytest.raises(ConfigError) as e:
        load_speculators_checkpoint(draft)
    assert e.value.field == "speculators_config.verifier.name_or_path"
    assert "does not exist" in str(e.value)
    assert len(str(e.value)) < 700 + len(str(draft)), len(str(e.value))  # two paths of at most 200


def test_a_deep_local_verifier_is_a_short_warning(tmp_path):
    # A relative verifier that exists, resolved against the checkpoint: its warning quoted the
    # declared path and the resolved one whole (7,677 characters).
    draft, _ = _checkpoint(tmp_path)
    deep = draft.joinpath(*["c" * 250] * 15)
    deep.mkdir(parents=True)
    doc = json.loads((draft / "config.json").read_text())
    doc["speculators_config"]["verifier"]["name_or_path"] = "./" + str(deep.relative_to(draft))
    (draft / "config.json").write_text(json.dumps(doc))
    ckpt = load_speculators_checkpoint(draft)
    assert ckpt.verifier == str(deep) and ckpt.verifier_is_local
    assert len(ckpt.warnings) == 1 and ckpt.warnings[0].startswith("local verifier './cccc")
    assert len(ckpt.warnings[0]) < 600, len(ckpt.warnings[0])
