"""`kvslots serve`: the vLLM command builder (every flag, checked with vLLM's own argument parser
and config classes when vLLM is importable), the process-group supervisor (with stand-in
servers), and one end-to-end run of vLLM's server on CPU with a tiny random model."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

import kvslots
from kvslots import cli
from kvslots.serve import (
    DEFAULT_EVENTS_ENDPOINT,
    VLLM_SERVER_MODULE,
    VLLM_SHORT_OPTIONS,
    ServeError,
    plan_from_argv,
    scan_vllm_args,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
PKG_ROOT = str(Path(kvslots.__file__).resolve().parent.parent)  # the dir holding kvslots/

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
TINY_EAGLE = dict(TINY_LLAMA, num_hidden_layers=1)


@pytest.fixture(autouse=True)
def _cpu_reservation_already_set(monkeypatch):
    """These tests check the plan as the user's flags make it: with VLLM_CPU_NUM_OF_RESERVED_CPU
    set, kvslots serve adds nothing for vLLM's CPU core reservation (see
    tests/test_connector_cpu_cores.py for what it adds otherwise)."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def write_dir(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def speculator(tmp_path: Path, verifier: str, k: int = 3) -> str:
    return write_dir(tmp_path / "speculator", {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 1000,
        "target_hidden_size": 64,
        "transformer_layer_config": dict(TINY_EAGLE),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    })


@pytest.fixture
def target(tmp_path) -> str:
    return write_dir(tmp_path / "target", TINY_LLAMA)


@pytest.fixture
def draft(tmp_path) -> str:
    return write_dir(tmp_path / "eagle-draft", TINY_EAGLE)


def yaml_file(tmp_path: Path, text: str, name: str = "engine.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def flag(argv: list[str], name: str) -> str | None:
    """The value after the last ``name`` in argv (None when absent)."""
    idx = [i for i, a in enumerate(argv) if a == name]
    return argv[idx[-1] + 1] if idx else None


def json_flag(argv: list[str], name: str):
    v = flag(argv, name)
    return None if v is None else json.loads(v)


def serve_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`kvslots serve ARGV` through the real top-level CLI; (status, stdout, stderr)."""
    try:
        rc = cli.main(["serve", *argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def dry(argv: list[str]) -> list[str]:
    """argv with --dry-run added before any --."""
    if "--" in argv:
        i = argv.index("--")
        return [*argv[:i], "--dry-run", *argv[i:]]
    return [*argv, "--dry-run"]


def error_line(argv: list[str], capsys) -> str:
    rc, out, err = serve_cli(dry(argv), capsys)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvslots serve: error: "), err
    return lines[0]


# =========================================================================== the command builder


def test_defaults(target):
    plan = plan_from_argv([target], python="/py")
    assert plan.argv[:5] == ["/py", "-m", VLLM_SERVER_MODULE, "--model", target]
    a = plan.argv
    assert flag(a, "--host") == "127.0.0.1" and flag(a, "--port") == "8000"
    assert json_flag(a, "--kv-transfer-config") == {
        "kv_connector": "KVSlotsConnector", "kv_connector_module_path": "kvslots.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {}}
    assert json_flag(a, "--kv-events-config") == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://[::ffff:127.0.0.1]:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}
    assert "--speculative-config" not in a
    # Scheduler mode is the default: the kvslots Rust core allocates vLLM's device KV blocks.
    assert flag(a, "--scheduler-cls") == "kvslots.vllm.KVSlotsScheduler"
    assert plan.slot_manager == "kvslots" and plan.scheduler_cls == "kvslots.vllm.KVSlotsScheduler"
    assert plan.env == {} and plan.notes == []
    assert plan.events_subscribe_endpoint() == "tcp://127.0.0.1:5557"
    # Every JSON-valued flag appears exactly once.
    for name in ("--kv-transfer-config", "--kv-events-config", "--model", "--host", "--port", "--scheduler-cls"):
        assert a.count(name) == 1


def test_dry_run_prints_a_shell_line_that_round_trips(target, capsys):
    rc, out, err = serve_cli([target, "--dry-run", "--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 2, "prompt_lookup_max": 3}', "--",
                              "--served-model-name", "my model"], capsys)
    assert rc == 0 and err == ""
    line = out.strip()
    assert "\n" not in line
    argv = shlex.split(line)
    assert argv[0] == sys.executable and argv[1:3] == ["-m", VLLM_SERVER_MODULE]
    assert json_flag(argv, "--speculative-config") == {"method": "ngram", "num_speculative_tokens": 2,
                                                        "prompt_lookup_max": 3}
    assert argv[-2:] == ["--served-model-name", "my model"]


def test_speculative_config_passthrough_and_schedule(target, draft):
    spec = {"method": "eagle", "model": draft, "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 1], [17, 64, 0]]}
    plan = plan_from_argv([target, "--speculative-config", json.dumps(spec)])
    assert json_flag(plan.argv, "--speculative-config") == spec == plan.speculative_config


@pytest.mark.parametrize("text, expect", [
    ("{bad", "--speculative-config: invalid JSON"),
    ("[1, 2]", "--speculative-config: must be a JSON object, got list"),
    ('{"method": "eagle", "num_speculative_tokens": 0}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "eagle", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 3], [6, 8, 1]]}',
     "speculative_config.num_speculative_tokens_per_batch_size[1]"),
    ('{"method": "eagle", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]}',
     "speculative_config.num_speculative_tokens_per_batch_size[0]"),
    ('{"method": "eagle", "model": "/nonexistent/draft", "num_speculative_tokens": 3}',
     "speculative_config.model: draft model directory '/nonexistent/draft' does not exist"),
    # Not a local directory and not a Hub id either: a missing path, as for MODEL.
    ('{"method": "eagle", "model": "drafts/eagle/v1", "num_speculative_tokens": 3}',
     "speculative_config.model: draft model directory 'drafts/eagle/v1' does not exist"),
    ('{"method": "eagle", "model": "my draft", "num_speculative_tokens": 3}',
     "speculative_config.model: draft model directory 'my draft' does not exist"),
])
def test_bad_speculative_config(target, capsys, text, expect):
    assert expect in error_line([target, "--speculative-config", text], capsys)


def test_draft_that_is_a_file_or_a_hub_id(target, tmp_path, capsys):
    (tmp_path / "draft.bin").write_text("x")
    spec = {"method": "eagle", "model": str(tmp_path / "draft.bin"), "num_speculative_tokens": 3}
    assert "speculative_config.model: draft model" in error_line(
        [target, "--speculative-config", json.dumps(spec)], capsys)
    assert "is not a directory" in error_line([target, "--speculative-config", json.dumps(spec)], capsys)
    spec["model"] = "org/eagle-draft"  # vLLM looks it up
    assert json_flag(plan_from_argv([target, "--speculative-config", json.dumps(spec)]).argv,
                     "--speculative-config")["model"] == "org/eagle-draft"


def test_model_errors(tmp_path, capsys):
    assert "model directory '/nonexistent/model' does not exist" in error_line(["/nonexistent/model"], capsys)
    assert "does not exist" in error_line([str(tmp_path / "a" / "b")], capsys)
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in error_line([str(tmp_path / "file")], capsys)
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in error_line([str(tmp_path / "empty")], capsys)
    assert "required: MODEL" in error_line([], capsys)


def test_hub_model_id_is_passed_through():
    plan = plan_from_argv(["org/some-model"])
    assert flag(plan.argv, "--model") == "org/some-model"
    assert any("Hugging Face Hub" in n for n in plan.notes)


@pytest.mark.parametrize("argv, expect", [
    (["--bogus"], "unknown option --bogus (vLLM's own arguments go after --)"),
    (["--enforce-eager"], "unknown option --enforce-eager"),
    (["--max-model-len", "1024"], "unknown option --max-model-len"),
    (["extra"], "unexpected argument 'extra'"),
    (["--host-cache"], "unknown option --host-cache"),  # no abbreviations
    (["--host-cache-gb", "0"], "argument --host-cache-gb: must be > 0"),
    (["--host-cache-gb", "x"], "argument --host-cache-gb: 'x' is not a number"),
    (["--port", "70000"], "argument --port: must be in 1..65535"),
])
def test_unknown_flags_and_bad_values(target, capsys, argv, expect):
    assert expect in error_line([target, *argv], capsys)


NO_USER = "~kvslots-no-such-user-x9"
DEEP = "[" * 50_000 + "]" * 50_000
DIGITS = "1" * 5000


@pytest.mark.parametrize("argv, expect", [
    # model references the system cannot look up: missing, not a traceback
    ([f"{NO_USER}/model"], f"model directory '{NO_USER}/model' does not exist"),
    (["a" * 300], "does not exist"),
    (["/tmp/" + "a" * 300 + "/m"], "does not exist"),
    (["org/model\n"], "does not exist"),  # not a Hub id: matched whole
    (["org/m", "--speculative-config", json.dumps({"method": "eagle", "model": f"{NO_USER}/x",
                                                   "num_speculative_tokens": 2})],
     f"speculative_config.model: draft model directory '{NO_USER}/x' does not exist"),
    (["org/m", "--speculative-config", json.dumps({"method": "eagle", "model": "e" * 300,
                                                   "num_speculative_tokens": 2})], "does not exist"),
    (["org/m", "--speculative-config", json.dumps({"method": "eagle", "model": "org/e\n",
                                                   "num_speculative_tokens": 2})], "does not exist"),
    # JSON options: kvslots' strict parser
    (["org/m", "--speculative-config", DEEP], "--speculative-config: nested more than 64 levels deep"),
    (["org/m", "--connector-config", '{"x": ' + DIGITS + "}"], "--connector-config: invalid JSON: an integer"),
    (["org/m", "--connector-config", '{"copy_threads": 2, "copy_threads": 3}'], "duplicate key 'copy_threads'"),
    (["org/m", "--connector-config", '{"host_cache_gb": 1e999}'], "host_cache_gb: must be a finite number"),
    (["org/m", "--connector-config", '{"host_cache_gb": 2e6}'], "host_cache_gb=2000000.0: must be a number of GiB"),
    (["org/m", "--connector-config", '{"pd_host": "\\ud800"}'], "surrogate"),
    (["org/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": NaN}'],
     "prompt_lookup_max: must be a finite number"),
    (["org/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "x": ' + "9" * 30 + "}"],
     "x: integer out of range"),
    (["org/m", "--", "--kv-transfer-config", "{" + '"a":{' * 20_000 + "}" * 20_001],
     "after --: --kv-transfer-config: nested more than 64"),
    (["org/m", "--", "--speculative-config.num_speculative_tokens", DIGITS], "invalid JSON: an integer"),
    (["org/m", "--", "-sc.method", "ngram", "-sc.num_speculative_tokens", "2", "-sc.prompt_lookup_max", "NaN"],
     "prompt_lookup_max: must be a finite number"),
    (["org/m", "--", "-sc.method", "ngram", "-sc.num_speculative_tokens", "2", "-sc.x", DEEP],
     "nested more than 64"),
    (["org/m", "--", "-sc" + ".a" * 100, "1"], "more than 63 dotted keys"),
    (["org/m", "--kv-events-endpoint", "tcp://*:" + "9" * 5000], "--kv-events-endpoint tcp://*:999"),
    (["org/m", "--kv-events-replay-endpoint", "tcp://127.0.0.1:70000"], "the port must be in 0..65535"),
    # merged options cannot be negated (vLLM has no --no-x for them either)
    (["org/m", "--", "--no-speculative-config"], "--no-speculative-config: --speculative-config cannot be negated"),
    (["org/m", "--", "--no-kv-transfer-config"], "cannot be negated; leave it out (kvslots serve --no-connector"),
    (["org/m", "--", "--no_kv_events_config"], "cannot be negated; leave it out (kvslots serve --no-kv-events"),
    # numbers of the flags are finite
    (["org/m", "--host-cache-gb", "inf"], "argument --host-cache-gb: must be a finite number, got inf"),
    (["org/m", "--host-cache-gb", "1e999"], "argument --host-cache-gb: must be a finite number"),
    (["org/m", "--host-cache-gb", "nan"], "argument --host-cache-gb: must be a finite number"),
    (["org/m", "--disk-path", "/tmp/d", "--disk-gb", "inf"], "argument --disk-gb: must be a finite number"),
    (["org/m", "--grace-period", "inf"], "argument --grace-period: must be a finite number"),
    # the speculative config docs/config.md describes
    (["org/m", "--speculative-config", "{}"], "speculative_config.num_speculative_tokens: is required"),
    (["org/m", "--speculative-config", '{"method": "ngram"}'], "speculative_config.num_speculative_tokens: is required"),
    (["org/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": null}'], "is required"),
    (["org/m", "--speculative-config", '{"method": "eagle", "model": 5, "num_speculative_tokens": 2}'],
     "speculative_config.model: must be a local directory or a Hub id (a string), got 5"),
    (["org/m", "--speculative-config", '{"method": ["eagle"], "num_speculative_tokens": 2}'],
     "speculative_config.method: must be a string"),
    (["org/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": "' + "7" * 500 + '"}'],
     "num_speculative_tokens: must be an integer >= 1, got '777"),
])
def test_hostile_arguments_are_one_line(capsys, argv, expect):
    line = error_line(argv, capsys)
    assert expect in line, line
    assert len(line) < 1000  # values are shortened in messages


def test_dotted_values_that_are_not_json_stay_strings():
    plan = plan_from_argv(["org/m", "--", "-sc.method", "ngram", "-sc.num_speculative_tokens", "2",
                           "-sc.revision", "1.0.2", "-sc.prompt_lookup_max", "3"])
    assert plan.speculative_config == {"method": "ngram", "num_speculative_tokens": 2, "revision": "1.0.2",
                                       "prompt_lookup_max": 3}


def test_speculators_checkpoint_whose_verifier_cannot_be_looked_up(tmp_path, capsys):
    for name in (f"{NO_USER}/llama", "v" * 300):
        ckpt = speculator(tmp_path / name[:8], verifier=name)
        assert "speculators_config.verifier.name_or_path: local verifier path" in error_line([ckpt], capsys)


# --------------------------------------------------------------------------- the TRT-LLM YAML

ENGINE_YAML = """\
backend: pytorch
max_batch_size: 8
max_num_tokens: 4096
max_seq_len: 2048
print_iter_log: true
pp_partition: [1, 1]
pipeline_parallel_size: 2
kv_cache_config:
  free_gpu_memory_fraction: 0.85
  enable_block_reuse: true
  host_cache_size: 2147483648
  event_buffer_max_size: 1024
speculative_config:
  decoding_type: Eagle
  max_draft_len: 3
  speculative_model_dir: {draft}
"""


def test_extra_engine_args_converted(tmp_path, target, draft, capsys):
    y = yaml_file(tmp_path, ENGINE_YAML.format(draft=draft))
    plan = plan_from_argv([target, "--extra-engine-args", y])
    a = plan.argv
    assert flag(a, "--max-num-seqs") == "8" and flag(a, "--max-num-batched-tokens") == "4096"
    assert flag(a, "--max-model-len") == "2048" and flag(a, "--gpu-memory-utilization") == "0.85"
    assert "--enable-prefix-caching" in a
    assert json_flag(a, "--speculative-config") == {"method": "eagle", "model": draft, "num_speculative_tokens": 3}
    # host_cache_size -> the connector's host tier
    assert json_flag(a, "--kv-transfer-config")["kv_connector_extra_config"] == {"host_cache_gb": 2.0}
    assert plan.env == {"VLLM_PP_LAYER_PARTITION": "1,1"}
    # Warnings and ignored keys reach stderr; the env assignment leads the printed command.
    rc, out, err = serve_cli([target, "--extra-engine-args", y, "--dry-run"], capsys)
    assert rc == 0
    assert out.startswith("VLLM_PP_LAYER_PARTITION=1,1 ")
    assert shlex.split(out)[1:] == plan.argv
    assert "kvslots serve: warning: kv_cache_config.free_gpu_memory_fraction" in err
    assert "kvslots serve: ignored: backend = pytorch" in err
    assert "kvslots serve: ignored: print_iter_log" in err
    assert serve_cli([target, "--extra-engine-args", y, "--dry-run", "-q"], capsys)[2] == ""


def test_flags_override_the_yaml(tmp_path, target, draft):
    y = yaml_file(tmp_path, ENGINE_YAML.format(draft=draft))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    plan = plan_from_argv([target, "--extra-engine-args", y, "--host-cache-gb", "0.5",
                           "--speculative-config", json.dumps(spec), "--",
                           "--max-model-len", "1024", "--no-enable-prefix-caching", "--max_num_seqs=4"])
    a = plan.argv
    assert json_flag(a, "--speculative-config") == spec
    assert json_flag(a, "--kv-transfer-config")["kv_connector_extra_config"] == {"host_cache_gb": 0.5}
    # The converted values vLLM's arguments override are dropped, so vLLM sees each once.
    assert a.count("--max-model-len") == 1 and flag(a, "--max-model-len") == "1024"
    assert "--enable-prefix-caching" not in a and "--no-enable-prefix-caching" in a
    assert "--max-num-seqs" not in a and "--max_num_seqs=4" in a
    notes = "\n".join(plan.notes)
    assert "--speculative-config replaces the YAML's speculative_config" in notes
    assert "overrides the YAML's kv_cache_config.host_cache_size" in notes
    assert "after --: --max-model-len overrides the YAML's max_seq_len (max_model_len = 2048)" in notes
    assert "after --: --max-num-seqs overrides the YAML's max_batch_size" in notes
    assert "prefix caching is off" in notes


def test_yaml_model_is_overridden_by_model(tmp_path, target):
    y = yaml_file(tmp_path, "model: org/other\nmax_batch_size: 2\n")
    plan = plan_from_argv([target, "--extra-engine-args", y])
    assert flag(plan.argv, "--model") == target and plan.argv.count("--model") == 1
    assert any("overrides the YAML's model org/other" in n for n in plan.notes)


@pytest.mark.parametrize("text, expect", [
    ("speculative_config:\n  decoding_type: Eagle\n  max_draft_len: -1\n  speculative_model_dir: /x\n",
     "speculative_config.max_draft_len"),
    ("kv_cache_config:\n  free_gpu_memory_fraction: 1.5\n", "kv_cache_config.free_gpu_memory_fraction"),
    ("max_batch_size: [1\n", "invalid YAML"),
    ("- a\n- b\n", "the document must be a mapping"),
    ("speculative_config:\n  decoding_type: Medusa2\n", "speculative_config.decoding_type"),
])
def test_bad_yaml(tmp_path, target, capsys, text, expect):
    y = yaml_file(tmp_path, text)
    line = error_line([target, "--extra-engine-args", y], capsys)
    assert y in line and expect in line


def test_missing_yaml(tmp_path, target, capsys):
    line = error_line([target, "--extra-engine-args", str(tmp_path / "nope.yaml")], capsys)
    assert "nope.yaml: no such file" in line


# --------------------------------------------------------------------------- speculators checkpoints


def test_speculators_checkpoint_detected(tmp_path, target):
    ckpt = speculator(tmp_path, verifier=target, k=3)
    plan = plan_from_argv([ckpt])
    assert flag(plan.argv, "--model") == target
    assert json_flag(plan.argv, "--speculative-config") == {"method": "eagle3", "model": ckpt, "num_speculative_tokens": 3}
    assert plan.speculators_checkpoint == ckpt
    assert any("is a speculators checkpoint" in n for n in plan.notes)
    # A relative local verifier is resolved against the checkpoint directory.
    rel = speculator(tmp_path / "rel", verifier="../../target")
    assert flag(plan_from_argv([rel]).argv, "--model") == target
    # --verifier replaces the declared one; --speculative-config is merged over the checkpoint's.
    other = write_dir(tmp_path / "other", TINY_LLAMA)
    plan = plan_from_argv([ckpt, "--verifier", other, "--speculative-config", '{"num_speculative_tokens": 2}'])
    assert flag(plan.argv, "--model") == other
    assert json_flag(plan.argv, "--speculative-config")["num_speculative_tokens"] == 2
    assert any("overrides the checkpoint's num_speculative_tokens" in n for n in plan.notes)
    # The YAML's speculative_config is replaced by the checkpoint's, its other keys kept.
    y = yaml_file(tmp_path, "max_batch_size: 4\nspeculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 1\n")
    plan = plan_from_argv([ckpt, "--extra-engine-args", y])
    assert json_flag(plan.argv, "--speculative-config")["method"] == "eagle3"
    assert flag(plan.argv, "--max-num-seqs") == "4"


def test_speculators_errors(tmp_path, target, capsys):
    ckpt = speculator(tmp_path, verifier=target)
    assert "method 'eagle' conflicts with the speculators checkpoint MODEL" in error_line(
        [ckpt, "--speculative-config", '{"method": "eagle"}', "--dry-run"], capsys)
    # The rule is the converter's (convert-config --verifier without --speculators-dir too).
    assert "verifier: applies to a speculators checkpoint" in error_line([target, "--verifier", target], capsys)
    missing = speculator(tmp_path / "m", verifier="./no-such-verifier")
    assert "speculators_config.verifier.name_or_path" in error_line([missing], capsys)


# --------------------------------------------------------------------------- the slot manager

KV_SCHED = "kvslots.vllm.KVSlotsScheduler"


@pytest.mark.parametrize("argv, manager, cls, note", [
    ([], "kvslots", KV_SCHED, None),
    (["--slot-manager", "kvslots"], "kvslots", KV_SCHED, None),
    (["--slot-manager", "vllm"], "vllm", None, None),
    (["--slot-manager=vllm", "--no-connector"], "vllm", None, None),
    # kvslots' own classes after --, with or without the flag: run as given, not added twice.
    (["--", "--scheduler-cls", "kvslots.vllm.KVSlotsAsyncScheduler"], "kvslots", "kvslots.vllm.KVSlotsAsyncScheduler", None),
    (["--slot-manager", "kvslots", "--", "--scheduler_cls=kvslots.vllm.scheduler.KVSlotsScheduler"], "kvslots",
     "kvslots.vllm.scheduler.KVSlotsScheduler", None),
    # The user's own scheduler class after -- replaces the default scheduler mode (noted) ...
    (["--", "--scheduler-cls", "my_pkg.MyScheduler"], "custom", "my_pkg.MyScheduler",
     "after --: --scheduler-cls my_pkg.MyScheduler replaces kvslots scheduler mode"),
    # ... and goes with --slot-manager vllm silently.
    (["--slot-manager", "vllm", "--", "--scheduler-cls", "my_pkg.MyScheduler"], "vllm", "my_pkg.MyScheduler", None),
])
def test_slot_manager(target, argv, manager, cls, note):
    plan = plan_from_argv([target, *argv])
    a = plan.argv
    assert plan.slot_manager == manager and plan.scheduler_cls == cls
    # Exactly one --scheduler-cls in vLLM's arguments, in whatever form it was given.
    assert [o.value for o in scan_vllm_args(plan.vllm_args) if o.name == "scheduler-cls"] == ([cls] if cls else [])
    if note is None:
        assert not any("scheduler" in n for n in plan.notes), plan.notes
    else:
        assert any(note in n for n in plan.notes), plan.notes
    # The choice does not touch the connector or the events.
    assert json_flag(a, "--kv-events-config")["enable_kv_cache_events"] is True
    assert (plan.kv_transfer_config is None) == ("--no-connector" in argv)


def test_usage_in_the_docs_lists_every_option():
    # docs/serve.md's usage block and the serve.cli docstring, against the parser itself.
    import re

    import kvslots.serve.cli as serve_cli_module

    parser = serve_cli_module.make_parser()
    options = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help", "--quiet")}
    doc = (Path(PKG_ROOT).parent / "docs" / "serve.md").read_text()
    usage = doc[doc.index("```\nkvslots serve MODEL"):]
    usage = usage[:usage.index("```", 4)]
    for text in (usage, serve_cli_module.__doc__):
        found = set(re.findall(r"\[(-[-\w]+)", text)) - {"--"}
        assert found == options, (sorted(options - found), sorted(found - options))


def test_slot_manager_in_help_and_dry_run(target, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--slot-manager {kvslots,vllm}" in out and KV_SCHED in " ".join(out.split())
    assert "--slot-manager vllm keeps vLLM's own" in " ".join(out.split())
    rc, out, err = serve_cli([target, "--dry-run"], capsys)
    assert rc == 0 and shlex.split(out.strip())[-2:] == ["--scheduler-cls", KV_SCHED]
    rc, out, err = serve_cli([target, "--dry-run", "--slot-manager", "vllm"], capsys)
    assert rc == 0 and "--scheduler-cls" not in out


@pytest.mark.parametrize("argv, expect", [
    (["--slot-manager", "vllm", "--", "--scheduler-cls", KV_SCHED],
     f"--slot-manager vllm conflicts with --scheduler-cls {KV_SCHED} after --"),
    (["--slot-manager", "kvslots", "--", "--scheduler-cls", "my_pkg.MyScheduler"],
     "--slot-manager kvslots conflicts with --scheduler-cls my_pkg.MyScheduler after --"),
    (["--slot-manager", "Kvslots"], "argument --slot-manager: invalid choice: 'Kvslots'"),
    (["--slot-manager"], "argument --slot-manager: expected one argument"),
    (["--", "--scheduler-cls"], "after --: --scheduler-cls needs a value"),
    (["--", "--scheduler-cls", " "], "after --: --scheduler-cls is empty"),
])
def test_slot_manager_errors(target, capsys, argv, expect):
    assert expect in error_line([target, *argv], capsys)


# --------------------------------------------------------------------------- the connector


def test_connector_flags(target):
    plan = plan_from_argv([target, "--host-cache-gb", "1.5", "--connector-config", '{"copy_threads": 2, "eagle_block_drop": true}'])
    assert plan.kv_transfer_config["kv_connector_extra_config"] == {"copy_threads": 2, "eagle_block_drop": True,
                                                                    "host_cache_gb": 1.5}
    plan = plan_from_argv([target, "--no-connector"])
    assert "--kv-transfer-config" not in plan.argv and plan.kv_transfer_config is None


def test_connector_config_after_dashes_is_merged(target):
    tail_cfg = {"kv_connector": "KVSlotsConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"copy_threads": 4}, "kv_load_failure_policy": "recompute"}
    plan = plan_from_argv([target, "--host-cache-gb", "2", "--", "--kv-transfer-config", json.dumps(tail_cfg),
                           "--kv-transfer-config.kv_connector_extra_config.events_topic", "host"])
    a = plan.argv
    assert a.count("--kv-transfer-config") == 1
    assert json_flag(a, "--kv-transfer-config") == {
        "kv_connector": "KVSlotsConnector", "kv_connector_module_path": "kvslots.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_cache_gb": 2.0, "copy_threads": 4, "events_topic": "host"}}
    # --no-connector: the user's own connector goes through as given.
    own = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    plan = plan_from_argv([target, "--no-connector", "--", "--kv-transfer-config", json.dumps(own)])
    assert json_flag(plan.argv, "--kv-transfer-config") == own and plan.argv.count("--kv-transfer-config") == 1


@pytest.mark.parametrize("argv, expect", [
    (["--connector-config", '{"host_cache_mb": 1}'], "unknown key(s) 'host_cache_mb'"),
    (["--connector-config", '{"copy_threads": 0}'], "kv_connector_extra_config.copy_threads=0: must be an integer in [1, 1024]"),
    (["--connector-config", "[]"], "--connector-config: must be a JSON object"),
    (["--host-cache-gb", "1", "--connector-config", '{"host_cache_gb": 2}'],
     "--host-cache-gb 1 conflicts with --connector-config host_cache_gb 2"),
    (["--no-connector", "--host-cache-gb", "1"], "--host-cache-gb configures the KVSlotsConnector, which --no-connector"),
    (["--", "--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
     "uses connector 'LMCacheConnectorV1'; kvslots serve runs KVSlotsConnector (add --no-connector"),
    (["--host-cache-gb", "1", "--", "--kv-transfer-config.kv_connector_extra_config.host_cache_gb", "3"],
     "sets host_cache_gb=3, conflicting with host_cache_gb=1.0 from the kvslots serve flags"),
    (["--", "--kv-transfer-config", "{"], "after --: --kv-transfer-config: invalid JSON"),
])
def test_connector_errors(target, capsys, argv, expect):
    assert expect in error_line([target, *argv], capsys)


def test_host_cache_hint_of_zero_keeps_the_default(tmp_path, target):
    y = yaml_file(tmp_path, "kv_cache_config:\n  host_cache_size: 0\n")
    plan = plan_from_argv([target, "--extra-engine-args", y])
    assert plan.kv_transfer_config["kv_connector_extra_config"] == {}
    assert any("host_cache_size is 0" in n for n in plan.notes)


# --------------------------------------------------------------------------- KV events


def test_events_flags(target):
    plan = plan_from_argv([target, "--kv-events-endpoint", "tcp://*:6000", "--kv-events-topic", "kv"])
    assert plan.kv_events_config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
                                     "topic": "kv", "replay_endpoint": "tcp://127.0.0.1:6001"}
    assert plan.events_subscribe_endpoint() == "tcp://127.0.0.1:6000"
    plan = plan_from_argv([target, "--kv-events-replay-endpoint", "tcp://*:7000"])
    assert plan.kv_events_config["replay_endpoint"] == "tcp://*:7000"
    assert plan.kv_events_config["endpoint"] == DEFAULT_EVENTS_ENDPOINT
    plan = plan_from_argv([target, "--kv-events-replay-endpoint", "none"])
    assert "replay_endpoint" not in plan.kv_events_config
    plan = plan_from_argv([target, "--kv-events-endpoint", "ipc:///tmp/kv.sock"])
    assert "replay_endpoint" not in plan.kv_events_config  # no port to derive it from
    assert plan.events_subscribe_endpoint() == "ipc:///tmp/kv.sock"
    plan = plan_from_argv([target, "--no-kv-events"])
    assert "--kv-events-config" not in plan.argv and plan.events_subscribe_endpoint() is None


@pytest.mark.parametrize("spec, eagle", [
    (None, False),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, False),
    ({"method": "eagle3", "num_speculative_tokens": 3}, True),
    ({"method": "mtp", "num_speculative_tokens": 1}, True),
    ({"method": "eagle", "num_speculative_tokens": 3, "disable_eagle_block_drop": True}, False),
])
def test_indexer_worker_line_follows_the_events_and_the_drafter(target, draft, spec, eagle):
    from kvslots.indexer import WorkerSpec

    argv = [target, "--kv-events-endpoint", "tcp://*:6000", "--kv-events-topic", "kv"]
    if spec is not None:
        spec = {**spec, "model": draft} if spec["method"] != "ngram" else spec
        argv += ["--speculative-config", json.dumps(spec)]
    plan = plan_from_argv(argv)
    line = plan.indexer_worker("w0")
    got = WorkerSpec.parse(line)  # what `kvslots indexer --worker` makes of it
    assert (got.name, got.endpoint, got.replay, got.topic, got.eagle) == (
        "w0", "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001", "kv", eagle)
    plan = plan_from_argv([target, "--kv-events-replay-endpoint", "tcp://*:7000"])
    assert plan.indexer_worker() == "NAME=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:7000"
    assert plan_from_argv([target, "--no-kv-events"]).indexer_worker() is None


def test_replay_port_clears_the_data_parallel_ranks(tmp_path, target):
    # vLLM offsets both ports by the data-parallel rank: the replay port must clear them all.
    assert plan_from_argv([target, "--", "-dp", "2"]).kv_events_config["replay_endpoint"] == "tcp://127.0.0.1:5559"
    assert plan_from_argv([target, "--", "--data-parallel-size=4"]).kv_events_config["replay_endpoint"] == "tcp://127.0.0.1:5561"
    y = yaml_file(tmp_path, "tensor_parallel_size: 2\nenable_attention_dp: true\n")
    assert plan_from_argv([target, "--extra-engine-args", y]).kv_events_config["replay_endpoint"] == "tcp://127.0.0.1:5559"


def test_connecting_endpoint_is_reported(target):
    plan = plan_from_argv([target, "--kv-events-endpoint", "tcp://127.0.0.1:6000"])
    assert plan.kv_events_config["endpoint"] == "tcp://127.0.0.1:6000"  # explicit: kept as given
    assert any("connects to tcp://127.0.0.1:6000" in n and "tcp://[::ffff:127.0.0.1]:6000" in n for n in plan.notes)
    assert plan.events_subscribe_endpoint() is None


def test_events_config_after_dashes_is_merged(target):
    plan = plan_from_argv([target, "--kv-events-topic", "kv", "--", "--kv-events-config.buffer_steps", "50",
                           "--kv-events-config", '{"hwm": 10}'])
    assert plan.argv.count("--kv-events-config") == 1
    cfg = json_flag(plan.argv, "--kv-events-config")
    assert cfg["buffer_steps"] == 50 and cfg["hwm"] == 10 and cfg["topic"] == "kv"
    assert cfg["endpoint"] == DEFAULT_EVENTS_ENDPOINT
    plan = plan_from_argv([target, "--no-kv-events", "--", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert json_flag(plan.argv, "--kv-events-config") == {"enable_kv_cache_events": True}


@pytest.mark.parametrize("argv, expect", [
    (["--no-kv-events", "--kv-events-endpoint", "tcp://*:1"], "--kv-events-endpoint configures the KV events, which --no-kv-events"),
    (["--kv-events-endpoint", "localhost:5557"], "must be a ZMQ endpoint"),
    (["--kv-events-topic", "a", "--", "--kv-events-config.topic", "b"],
     'sets topic="b", conflicting with --kv-events-topic a'),
])
def test_events_errors(target, capsys, argv, expect):
    assert expect in error_line([target, *argv], capsys)


# --------------------------------------------------------------------------- host, port, tail


def test_host_and_port(target, capsys):
    plan = plan_from_argv([target, "--host", "0.0.0.0", "--port", "9000"])
    assert flag(plan.argv, "--host") == "0.0.0.0" and flag(plan.argv, "--port") == "9000"
    plan = plan_from_argv([target, "--", "--port", "9001"])
    assert plan.argv.count("--port") == 1 and flag(plan.argv, "--port") == "9001" and plan.port == 9001
    plan = plan_from_argv([target, "--port", "9001", "--", "--port=9001"])  # the same value twice: fine
    assert plan.argv.count("--port") == 0 and "--port=9001" in plan.argv
    assert "--port 9000 conflicts with --port 9001 after --" in error_line(
        [target, "--port", "9000", "--dry-run", "--", "--port", "9001"], capsys)
    assert "--host 1.2.3.4 conflicts" in error_line([target, "--host", "1.2.3.4", "--", "--host", "::"], capsys)
    assert "after --: --model conflicts with MODEL" in error_line([target, "--", "--model", target], capsys)
    assert "--speculative-config is given both before and after --" in error_line(
        [target, "--speculative-config", "{}", "--dry-run", "--", "-sc", "{}"], capsys)


def test_speculative_config_after_dashes(target, draft):
    plan = plan_from_argv([target, "--", "-sc.method", "eagle", "--speculative-config.model", draft,
                           "--speculative_config.num_speculative_tokens", "2", "--enforce-eager"])
    assert json_flag(plan.argv, "--speculative-config") == {"method": "eagle", "model": draft, "num_speculative_tokens": 2}
    assert plan.tail == ["--enforce-eager"]


def test_scan_vllm_args():
    opts = scan_vllm_args(["--max_model_len", "1024", "--enforce-eager", "-tp=2", "-O3", "--no-enable-prefix-caching",
                           "--kv-events-config.topic", "x", "--speculative-config.foo+", "a,b", "--port=8001",
                           "--temperature", "-1.5", "-sc", "{}"])
    assert [(o.name, o.keys, o.negated, o.value) for o in opts] == [
        ("max-model-len", [], False, None), ("enforce-eager", [], False, None),
        ("tensor-parallel-size", [], False, None), ("optimization-level", [], False, None),
        ("enable-prefix-caching", [], True, None), ("kv-events-config", ["topic"], False, "x"),
        ("speculative-config", ["foo"], False, "a,b"), ("port", [], False, "8001"),
        ("temperature", [], False, None), ("speculative-config", [], False, "{}"),
    ]
    assert opts[6].append
    with pytest.raises(ServeError, match="--port needs a value"):
        scan_vllm_args(["--port"])


def test_list_append_form(target):
    plan = plan_from_argv([target, "--", "--speculative-config.method", "ngram", "-sc.num_speculative_tokens", "2",
                           "--speculative-config.synthetic_acceptance_rates+", "0.5,0.7"])
    assert plan.speculative_config == {"method": "ngram", "num_speculative_tokens": 2,
                                       "synthetic_acceptance_rates": ["0.5", "0.7"]}  # vLLM reads floats
    with pytest.raises(kvslots.ConfigError, match="speculative_config.extra: unexpected keyword argument"):  # vLLM has none
        plan_from_argv([target, "--", "--speculative-config.method", "ngram", "-sc.num_speculative_tokens", "2",
                        "--speculative-config.extra+", "a,b"])
    with pytest.raises(ServeError, match="unknown key"):  # merged extra keys are checked by the connector
        plan_from_argv([target, "--", "--kv-transfer-config.kv_connector_extra_config.x+", "a,b"])


# =========================================================================== against vLLM


@pytest.fixture(scope="module")
def vllm_parser():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not importable in this environment: the checks with vLLM's argument parser and "
                    "config classes and the end-to-end server run need it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvslots.vllm.compat import cli_args_module

    return cli_args_module().make_arg_parser(FlexibleArgumentParser())


def vllm_parse(parser, plan):
    from kvslots.vllm.compat import cli_args_module

    ns = parser.parse_args(plan.vllm_args)
    cli_args_module().validate_parsed_serve_args(ns)
    return ns


def test_short_option_table_matches_vllm(vllm_parser):
    theirs = {}
    for action in vllm_parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        for o in action.option_strings:
            if not o.startswith("--") and o != "-h":
                theirs[o] = longs[0][2:]
        for o in action.option_strings:  # every --no-X is the negation of an --X
            if o.startswith("--no-"):
                assert "--" + o[5:] in action.option_strings, o
    assert theirs == VLLM_SHORT_OPTIONS
    # Our own JSON-valued options are vLLM's names.
    dests = {a.dest for a in vllm_parser._actions}
    assert {"speculative_config", "kv_transfer_config", "kv_events_config", "host", "port", "model",
            "data_parallel_size"} <= dests


def test_vllm_parses_the_commands(vllm_parser, tmp_path, target, draft):
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.distributed.kv_events import ZmqEventPublisher
    from vllm.engine.arg_utils import AsyncEngineArgs

    from kvslots.config.connector import ConnectorConfig

    y = yaml_file(tmp_path, ENGINE_YAML.format(draft=draft))
    ckpt = speculator(tmp_path, verifier=target)
    cases = [
        [target],
        [target, "--port", "8123", "--host", "0.0.0.0", "--host-cache-gb", "0.25", "--speculative-config",
         json.dumps({"method": "eagle", "model": draft, "num_speculative_tokens": 3,
                     "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 1]]}),
         "--", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--dtype", "float32"],
        [target, "--extra-engine-args", y, "--connector-config", '{"copy_threads": 2}',
         "--kv-events-endpoint", "tcp://*:6100", "--kv-events-topic", "kv", "--", "--max-model-len", "512"],
        [ckpt, "--speculative-config", '{"num_speculative_tokens": 2}', "--kv-events-replay-endpoint", "none"],
        [target, "--no-connector", "--no-kv-events", "--slot-manager", "vllm", "--", "-tp", "1"],
        [target, "--", "--scheduler-cls", "kvslots.vllm.KVSlotsAsyncScheduler"],
        [target, "--", "--kv-transfer-config.kv_connector_extra_config.copy_threads", "3",
         "--kv-events-config.buffer_steps", "7", "-sc.method", "ngram", "-sc.num_speculative_tokens", "2",
         "--port=8200"],
    ]
    for argv in cases:
        plan = plan_from_argv(argv)
        ns = vllm_parse(vllm_parser, plan)
        assert ns.model == plan.model and ns.port == plan.port and ns.host == plan.host
        assert ns.speculative_config == plan.speculative_config
        assert ns.scheduler_cls == plan.scheduler_cls
        if plan.kv_transfer_config is None:
            assert ns.kv_transfer_config is None
        else:
            kt = ns.kv_transfer_config
            assert isinstance(kt, KVTransferConfig)
            for key, value in plan.kv_transfer_config.items():
                assert getattr(kt, key) == value, key
            assert kt.is_kv_transfer_instance and kt.is_kv_producer and kt.is_kv_consumer
            ConnectorConfig.from_extra_config(kt.kv_connector_extra_config)  # the connector accepts it
        if plan.kv_events_config is None:
            assert ns.kv_events_config is None
        else:
            ke = ns.kv_events_config
            assert isinstance(ke, KVEventsConfig)
            for key, value in plan.kv_events_config.items():
                assert getattr(ke, key) == value, key
            assert ke.enable_kv_cache_events and ke.publisher == "zmq"
            assert ZmqEventPublisher._is_bind_endpoint(ke.endpoint)  # the publisher binds; subscribers connect
        ea = AsyncEngineArgs.from_cli_args(ns)
        assert ea.kv_transfer_config == ns.kv_transfer_config and ea.kv_events_config == ns.kv_events_config
        if "--extra-engine-args" in argv:  # the converted YAML, with the value after -- winning
            assert (ea.max_num_seqs, ea.max_model_len, ea.pipeline_parallel_size) == (8, 512, 2)
            assert ea.gpu_memory_utilization == 0.85 and ea.enable_prefix_caching is True


def test_default_endpoint_binds_loopback_with_vllms_publisher(vllm_parser):
    """vLLM's own ZmqEventPublisher binds our default endpoint form on 127.0.0.1 only, and a
    subscriber connecting to 127.0.0.1 decodes its batches."""
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from kvslots.events import decode_batch

    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert pub._pub.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
        sub.connect(f"tcp://127.0.0.1:{port}")
        batch = None
        for _ in range(50):  # PUB drops what it sends before the subscription arrives
            pub.publish(KVEventBatch(ts=1.0, events=[BlockStored([7], None, list(range(4)), 4, None, "GPU", None)]))
            if sub.poll(100):
                batch = decode_batch(sub.recv_multipart()[2])
                break
        assert batch is not None and batch.events[0].block_hashes == [7]
    finally:
        sub.close(0)
        pub.shutdown()


def test_vllm_builds_the_engine_config(vllm_parser, models):
    """The end-to-end command's arguments build vLLM's full engine config (SpeculativeConfig
    against the real target and EAGLE head, KV transfer and events configs)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    plan = plan_from_argv(e2e_argv(models, port=8000, events_port=5557))
    cfg = AsyncEngineArgs.from_cli_args(vllm_parse(vllm_parser, plan)).create_engine_config()
    assert cfg.speculative_config.method == "eagle" and cfg.speculative_config.num_speculative_tokens == 3
    assert cfg.kv_transfer_config.kv_connector == "KVSlotsConnector"
    assert cfg.kv_events_config.enable_kv_cache_events and cfg.cache_config.enable_prefix_caching
    assert cfg.cache_config.block_size == 32 and cfg.model_config.max_model_len == 1024
    # Scheduler mode by default; vLLM's CPU platform turns async scheduling off, and the class
    # picks its variant from that.
    from kvslots.vllm import KVSlotsScheduler

    assert cfg.scheduler_config.get_scheduler_cls() is KVSlotsScheduler
    assert cfg.scheduler_config.async_scheduling is False
    plan = plan_from_argv(e2e_argv(models, 8000, 5557, "--slot-manager", "vllm"))
    cfg = AsyncEngineArgs.from_cli_args(vllm_parse(vllm_parser, plan)).create_engine_config()
    from vllm.v1.core.sched.scheduler import Scheduler

    assert cfg.scheduler_config.get_scheduler_cls() is Scheduler


# =========================================================================== the supervisor

FAKE_SERVER = r"""
import os, signal, subprocess, sys, time
mode, ready = sys.argv[1], sys.argv[2]
kids = []
# A helper in the server's process group that ignores SIGINT and SIGTERM (needs SIGKILL).
kids.append(subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]))
# A helper that left the group (its own session) and ignores SIGINT: only SIGTERM sent to the
# supervisor's re-parented children reaches it.
kids.append(subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"], start_new_session=True))
if mode == "ignore-int":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
elif mode == "exit-3":
    signal.signal(signal.SIGINT, lambda *a: sys.exit(3))
time.sleep(0.3)
with open(ready + ".tmp", "w") as f:
    f.write(" ".join(str(k.pid) for k in kids))
os.rename(ready + ".tmp", ready)
if mode == "exit-5":
    time.sleep(1)
    sys.exit(5)
time.sleep(600)
"""


def proc_table() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, ppid, pgid) for every process (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            out[int(name)] = (fields[0], int(fields[1]), int(fields[2]))
    return out


def descendants(pid: int) -> list[int]:
    table = proc_table()
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (_, ppid, _) in table.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def gone(pids) -> bool:
    table = proc_table()
    return all(pid not in table or table[pid][0] == "Z" for pid in pids)


def group_members(pgid: int) -> list[int]:
    return [pid for pid, (state, _, g) in proc_table().items() if g == pgid and state != "Z"]


def run_supervisor(tmp_path: Path, mode: str, grace: float = 1.0):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    ready = tmp_path / f"ready-{mode}"
    code = (f"import sys; from kvslots.serve import supervise; "
            f"sys.exit(supervise([sys.executable, {str(fake)!r}, {mode!r}, {str(ready)!r}], grace={grace}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    sup = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.time() + 60
    while not ready.exists():
        assert sup.poll() is None, sup.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    helpers = [int(p) for p in ready.read_text().split()]
    procs = descendants(sup.pid)
    server = next(p for p in procs if proc_table()[p][1] == sup.pid)
    assert set(helpers) <= set(procs)
    return sup, server, helpers, procs


def test_supervisor_forwards_sigint_and_cleans_up(tmp_path):
    sup, server, helpers, everything = run_supervisor(tmp_path, "exit-3")
    t0 = time.time()
    sup.send_signal(signal.SIGINT)
    rc = sup.wait(timeout=30)
    err = sup.stderr.read()
    assert rc == 3, err  # the server's status
    assert time.time() - t0 < 10
    assert gone(everything) and group_members(server) == [], err
    assert "SIGINT to process group" in err and "SIGKILL" in err


def test_supervisor_escalates_when_sigint_is_ignored(tmp_path):
    sup, server, helpers, everything = run_supervisor(tmp_path, "ignore-int")
    sup.send_signal(signal.SIGINT)
    rc = sup.wait(timeout=30)
    err = sup.stderr.read()
    assert rc == 128 + signal.SIGTERM, err  # killed by the SIGTERM that followed after the grace period
    assert "still running after 1 s: SIGTERM" in err
    assert gone(everything) and group_members(server) == []


def test_supervisor_sigterm_and_exit_status(tmp_path):
    sup, server, helpers, everything = run_supervisor(tmp_path, "ignore-int")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 128 + signal.SIGTERM
    assert gone(everything)
    # A server that exits by itself: its status, and its leftovers are stopped too.
    sup, server, helpers, everything = run_supervisor(tmp_path, "exit-5")
    assert sup.wait(timeout=30) == 5
    assert gone(everything) and group_members(server) == []


# =========================================================================== end to end


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not importable in this environment: the end-to-end server run needs it")
    from kvslots._dev.tiny import build_tiny_models

    return build_tiny_models(str(tmp_path_factory.mktemp("tiny-serve")))


def e2e_argv(models: dict, port: int, events_port: int, *flags: str) -> list[str]:
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3}
    return [models["target"], "--speculative-config", json.dumps(spec), "--port", str(port),
            "--kv-events-endpoint", f"tcp://[::ffff:127.0.0.1]:{events_port}", "--host-cache-gb", "0.25",
            *flags, "--", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--dtype", "float32"]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def test_serve_end_to_end(models, tmp_path):
    """kvslots serve starts vLLM on CPU in scheduler mode with the connector, EAGLE and KV events; the server
    answers, device- and host-tier events arrive on the (loopback-bound) publisher and replay,
    and Ctrl-C stops everything."""
    import zmq

    from kvslots.events import MEDIUM_CPU, MEDIUM_GPU, BlockStored, decode_batch
    from kvslots._dev.tiny import WORDS

    port, events_port = free_port(), free_port()
    argv = e2e_argv(models, port, events_port)
    # Unbuffered, at vLLM's default level (other test modules lower it in this process): the log
    # lines asserted below must be in the file when the server is up.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join(p for p in [PKG_ROOT, os.environ.get("PYTHONPATH")] if p))
    log = open(tmp_path / "serve.log", "w+")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    def tail() -> str:
        log.flush()
        return (tmp_path / "serve.log").read_text()[-6000:]

    t_start = time.time()
    serve = subprocess.Popen([sys.executable, "-m", "kvslots", "serve", *argv], env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            assert serve.poll() is None, f"kvslots serve exited with {serve.returncode}:\n{tail()}"
            assert time.time() - t_start < 300, f"no /health after 300 s:\n{tail()}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        t_ready = time.time()
        # Connected once the publisher is bound (it is by /health): a TCP connect retried to an
        # unbound loopback port in the ephemeral range can connect to itself and take the port.
        # The replay check below covers anything published before the subscription arrived.
        sub.connect(f"tcp://127.0.0.1:{events_port}")
        time.sleep(0.5)
        cmd_line = (tmp_path / "serve.log").read_text().splitlines()[0]
        assert shlex.split(cmd_line)[1:3] == ["-m", VLLM_SERVER_MODULE]
        # Scheduler mode by default: vLLM loaded kvslots' scheduler class (and says so).
        assert flag(shlex.split(cmd_line), "--scheduler-cls") == "kvslots.vllm.KVSlotsScheduler"
        # The engine core says so (its line may come a little after /health).
        want = ("Using custom scheduler class kvslots.vllm.KVSlotsScheduler",)
        deadline = time.time() + 30
        def said() -> bool:
            log.flush()
            text = (tmp_path / "serve.log").read_text()
            return all(w in text for w in want)
        while not said() and time.time() < deadline:
            time.sleep(0.5)
        assert said(), tail()

        prompt = " ".join(WORDS * 3)  # > 3 blocks of 32 tokens
        for _ in range(2):  # the repeat hits the device prefix cache; its steps complete the host stores
            out = post(base + "/v1/completions", {"model": models["target"], "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0})
            assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
            assert out["usage"]["prompt_tokens"] >= 96
        t_served = time.time()

        stored: dict[str, int] = {}
        seqs = []
        deadline = time.time() + 60
        while not (stored.get(MEDIUM_GPU) and stored.get(MEDIUM_CPU)) and time.time() < deadline:
            if sub.poll(500):
                topic, seq, payload = sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                for ev in decode_batch(payload).events:
                    if isinstance(ev, BlockStored):
                        stored[ev.medium] = stored.get(ev.medium, 0) + len(ev.block_hashes)
        assert stored.get(MEDIUM_GPU, 0) >= 3, (stored, tail())   # vLLM's device tier
        assert stored.get(MEDIUM_CPU, 0) >= 3, (stored, tail())   # the connector's host tier
        assert seqs == sorted(seqs)

        # The default replay endpoint (loopback, events port + 1) serves everything from seq 0.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{events_port + 1}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(10_000):
            _, _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append(decode_batch(payload))
        dealer.close(0)
        assert len(replayed) >= len(seqs) and replayed[0].events

        # Ctrl-C: everything stops within 60 s, with the server's status.
        table = proc_table()
        pids = set(descendants(serve.pid))
        groups = {table[p][2] for p in pids if p in table} | {serve.pid}
        assert len(pids) >= 2 and len(groups) == 2  # kvslots serve's group and vLLM's own
        t0 = time.time()
        serve.send_signal(signal.SIGINT)
        rc = serve.wait(timeout=60)
        stop_s = time.time() - t0
        assert rc == 0, tail()
        assert gone(sorted(pids)), tail()
        for g in groups:
            assert group_members(g) == [], (g, tail())
        print(f"\nkvslots serve e2e: ready {t_ready - t_start:.1f} s, two completions {t_served - t_ready:.1f} s, "
              f"events {stored}, stopped in {stop_s:.1f} s")
    finally:
        sub.close(0)
        if serve.poll() is None:
            # An assertion before the Ctrl-C check: vLLM runs in its own process group, so
            # collect its processes too or they outlive the test.
            pids |= set(descendants(serve.pid))
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
