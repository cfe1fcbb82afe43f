"""vLLM's ``--config FILE`` after ``--`` in ``kvslots serve``: vLLM reads the file's options
before every other argument, so kvslots serve reads it first, under its file rules, and refuses
the options it manages there. It was passed on unread: a speculative config with K = 999 (past
the bound of 128 every other way of giving K is held to), a FIFO (vLLM would block reading it)
or an empty file (vLLM's None.items() once started) all made a plan."""

from __future__ import annotations

import os
import re

import pytest

from kvslots import cli
from kvslots.errors import KVSlotsError
from kvslots.serve.cli import plan_from_argv


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    return str(d)


def plan(model, *tail):
    return plan_from_argv([model, "--slot-manager", "vllm", "--no-kv-events", "--", *tail])


MANAGED = [
    ("speculative_config:\n  method: ngram\n  num_speculative_tokens: 999\n", "speculative_config"),
    ("speculative-config.num_speculative_tokens: 999\n", "speculative-config.num_speculative_tokens"),
    ("kv_transfer_config: {kv_connector: OtherConnector, kv_role: kv_both}\n", "kv_transfer_config"),
    ("kv-events-config: {enable_kv_cache_events: true}\n", "kv-events-config"),
    ("scheduler_cls: x.Y\n", "scheduler_cls"),
    ("port: 8001\n", "port"),
    ("model: other\n", "model"),
    ("data_parallel_size: 4\n", "data_parallel_size"),
    ("tensor_parallel_size: 100000\n", "tensor_parallel_size"),
    ("no_enable_prefix_caching: true\n", "no_enable_prefix_caching"),
]


@pytest.mark.parametrize("text, key", MANAGED, ids=[key for _, key in MANAGED])
def test_a_config_file_may_not_set_what_kvslots_serve_manages(tmp_path, model, text, key):
    f = tmp_path / "vllm.yaml"
    f.write_text(text)
    for tail in (["--config", str(f)], [f"--config={f}"]):
        with pytest.raises(KVSlotsError, match=f"sets '{key}', which kvslots serve reads and checks"):
            plan(model, *tail)


def test_a_config_file_is_read_under_the_file_rules(tmp_path, model):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    listed = tmp_path / "list.yaml"
    listed.write_text("- max_num_seqs\n")
    dup = tmp_path / "dup.yaml"
    dup.write_text("max_num_seqs: 1\nmax_num_seqs: 2\n")
    for path, problem in [(fifo, "not a regular file (a FIFO)"), (empty, "got an empty file"),
                          (listed, "must be a mapping of vLLM options, got list"), (dup, "duplicate key"),
                          ("/dev/zero", "not a regular file"), (tmp_path / "none.yaml", "no such file")]:
        with pytest.raises(KVSlotsError, match=re.escape(problem)):
            plan(model, "--config", str(path))
    with pytest.raises(KVSlotsError, match="more than once"):
        plan(model, "--config", str(dup), "--config", str(dup))


def test_a_config_file_of_other_options_is_passed_to_vllm(tmp_path, model, capsys):
    f = tmp_path / "vllm.yaml"
    f.write_text("max_num_seqs: 4\nenforce_eager: true\n")
    assert plan(model, "--config", str(f)).argv[-2:] == ["--config", str(f)]
    capsys.readouterr()
    assert cli.main(["serve", model, "--dry-run", "--", "--config", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "after --: --config:" in err and "no such file" in err, err
