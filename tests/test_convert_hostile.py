"""`kvslots convert-config` against draft model references that certainly name nothing: the
TRT-LLM YAML's draft (speculative_model_dir / speculative_model / pytorch_weights_path) follows
kvslots.config.speculative's model-reference rule -- a local directory or a Hub id; a path that
looks local and does not exist (or is a file) is one ConfigError line, exit status 2."""

from __future__ import annotations

import json

import pytest
import yaml

from kvslots import cli
from kvslots.config.loader import MAX_ENGINE_NODES
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import ConfigError

NO_USER = "~kvslots-no-such-user-x9"


def yaml_file(tmp_path, spec: dict) -> str:
    f = tmp_path / "engine.yaml"
    f.write_text(yaml.safe_dump({"speculative_config": spec}))
    return str(f)


def spec(dtype: str, key: str, model: str) -> dict:
    return {"decoding_type": dtype, "max_draft_len": 3, key: model}


@pytest.mark.parametrize("key", ["speculative_model_dir", "speculative_model", "pytorch_weights_path"])
@pytest.mark.parametrize("dtype", ["Eagle", "Eagle3", "MTP", "Draft_Target", "PARD", "DFlash", "DSpark"])
@pytest.mark.parametrize("model", ["/nonexistent/draft", "./no-such-draft", "../no-such-draft",
                                   f"{NO_USER}/draft", "~/kvslots-no-such-draft-x9", "a/b/c", "org/..",
                                   "/tmp/" + "d" * 300 + "/x", "my draft"])
def test_missing_local_draft_is_one_line_exit_2(tmp_path, capsys, monkeypatch, key, dtype, model):
    monkeypatch.chdir(tmp_path)
    path = yaml_file(tmp_path, spec(dtype, key, model))
    with pytest.raises(ConfigError) as ei:
        convert_trtllm_config(path)
    assert ei.value.field == f"speculative_config.{key}" and "does not exist" in str(ei.value)
    capsys.readouterr()
    code = cli.main(["convert-config", path])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvslots convert-config: error: ")
    assert f"speculative_config.{key}: draft model directory" in err and "Traceback" not in err


@pytest.mark.parametrize("dtype", ["Eagle3", "Draft_Target", "MTP"])
def test_a_file_is_not_a_draft_directory(tmp_path, capsys, dtype):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    path = yaml_file(tmp_path, spec(dtype, "speculative_model_dir", str(f)))
    assert cli.main(["convert-config", path]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["org/draft", "draft", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"])
def test_hub_ids_and_local_directories_are_accepted(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)  # nothing named so here: a Hub id, which vLLM looks up itself
    r = convert_trtllm_config(yaml_file(tmp_path, spec("Eagle3", "speculative_model_dir", model)))
    assert r.speculative_config["model"] == model
    (tmp_path / "local").mkdir()
    for name in ("./local", str(tmp_path / "local"), "local/"):
        r = convert_trtllm_config(yaml_file(tmp_path, spec("Draft_Target", "speculative_model_dir", name)))
        assert r.speculative_config["model"] == name


def test_an_unused_draft_is_not_checked(tmp_path):
    # n-gram lookup ignores the draft; a speculators checkpoint replaces it.
    r = convert_trtllm_config(yaml_file(tmp_path, spec("NGram", "speculative_model_dir", "/nonexistent/d")))
    assert r.speculative_config["method"] == "ngram"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 2}],
                               "verifier": {"name_or_path": "org/target"}}}))
    r = convert_trtllm_config(yaml_file(tmp_path, spec("Eagle3", "speculative_model_dir", "/nonexistent/d")),
                              speculators_dir=str(ckpt))
    assert r.speculative_config["model"] == str(ckpt.resolve())


# An empty model reference is Path("."), the working directory: it must name nothing, even where
# the working directory holds a model or a speculators checkpoint.

SPECULATORS = {"speculators_model_type": "eagle3", "transformer_layer_config": {},
               "speculators_config": {"proposal_methods": [{"speculative_tokens": 2}],
                                      "verifier": {"name_or_path": "org/target"}}}


@pytest.fixture
def cwd_is_a_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SPECULATORS))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_an_empty_reference_names_nothing(cwd_is_a_checkpoint):
    from kvslots.config.speculative import classify_model, read_model_config, resolve_speculative_config
    from kvslots.config.speculators import load_speculators_checkpoint

    assert classify_model("").kind == "missing" and classify_model(".").kind == "dir"
    with pytest.raises(ConfigError, match="draft model directory '' does not exist") as ei:
        resolve_speculative_config(None, {"method": "eagle3", "model": "", "num_speculative_tokens": 2})
    assert ei.value.field == "speculative_config.model"
    with pytest.raises(ConfigError, match="'' is not a directory"):
        read_model_config("")
    with pytest.raises(ConfigError, match="'' is not a directory"):
        load_speculators_checkpoint("")
    with pytest.raises(ConfigError, match="does not exist"):
        load_speculators_checkpoint(".", verifier="")


@pytest.mark.parametrize("argv, problem", [
    (["--speculators-dir", ""], "speculators checkpoint '' is not a directory"),
    (["--speculators-dir", ".", "--verifier", ""], "does not exist"),
])
def test_convert_config_empty_references_are_one_line_exit_2(cwd_is_a_checkpoint, capsys, argv, problem):
    f = cwd_is_a_checkpoint / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and problem in err, err


def test_serve_empty_draft_model_is_one_line_exit_2(cwd_is_a_checkpoint, capsys):
    capsys.readouterr()
    spec = json.dumps({"method": "eagle3", "model": "", "num_speculative_tokens": 2})
    assert cli.main(["serve", "org/target", "--speculative-config", spec, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == \
        "kvslots serve: error: speculative_config.model: draft model directory '' does not exist", err


@pytest.mark.parametrize("raised, problem", [
    (ImportError("no module named vllm"), "cannot check: vLLM is not importable (no module named vllm)"),
    (ConfigError("vLLM parsed x as 1 but the engine args say 2", "x"), "vLLM check failed: x: vLLM parsed"),
    (ValueError("bad value\nsecond line"), "vLLM rejected the arguments: ValueError: bad value"),
    (RuntimeError(""), "vLLM rejected the arguments: RuntimeError: "),
])
def test_a_failed_check_is_one_line_exit_2(tmp_path, capsys, monkeypatch, raised, problem):
    from kvslots.config import cli as config_cli

    def check(result):
        raise raised

    monkeypatch.setattr(config_cli, "check_with_vllm", check)
    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "--check", "-q"]) == 2  # was 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvslots convert-config: error: "), err
    assert problem in err, err


@pytest.mark.parametrize("output", ["", "{tmp}", "{tmp}/no/such/dir/x", "/dev/full", "{tmp}/file/x",
                                    "{tmp}/fifo",  # nobody reads it: the open waited without end
                                    "{tmp}/a\0b"])  # open's ValueError
def test_output_it_cannot_write_is_one_line_exit_2(tmp_path, capsys, output):
    import os

    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", output.format(tmp=tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvslots convert-config: error: "), err


@pytest.mark.parametrize("argv, problem", [
    (["{yaml}", "-o", "{tmp}/x\ud800"], "cannot write: a lone surrogate, which no file name holds, in the path"),
    (["{yaml}", "-o", "{tmp}/x\0"], "cannot write: a NUL in the path"),
    (["{tmp}/x\ud800"], "cannot read: a lone surrogate, which no file name holds, in the path"),
])
def test_a_path_no_file_can_have_says_why(tmp_path, capsys, argv, problem):
    # '\ud800' (no byte of a command line) was called "a NUL in the path" for -o, and the codec's
    # own message for the YAML.
    f = tmp_path / "n.yaml"
    f.write_text("max_batch_size: 2\n")
    capsys.readouterr()
    assert cli.main(["convert-config", "-q", *(a.format(tmp=tmp_path, yaml=f) for a in argv)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvslots convert-config: error: "), err
    assert err.rstrip().endswith(problem), err


@pytest.mark.parametrize("key", ["model", "tokenizer", "revision", "tokenizer_revision", "reasoning_parser",
                                 "otlp_traces_endpoint"])
@pytest.mark.parametrize("value", ["a\0b", "\0", "a\ud800", "--"])  # "--": vLLM's parser reads no value
def test_a_string_that_cannot_be_an_argument_is_refused(key, value):
    # A NUL went into the flags (kvslots serve: vLLM not started, a ValueError traceback).
    with pytest.raises(ConfigError) as ei:
        convert_trtllm_config({key: value})
    assert ei.value.field == key, ei.value


def test_a_nul_in_the_yaml_is_one_line_exit_2(tmp_path, capsys):
    f = tmp_path / "r.yaml"
    f.write_text('revision: "a\\0b"\nspeculative_config: {decoding_type: Eagle3, max_draft_len: 2, '
                 'speculative_model_dir: "org/d\\0"}\n')
    for argv in (["convert-config", str(f)], ["serve", "org/target", "-q", "--dry-run", "--extra-engine-args", str(f)]):
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "NUL" in err, err


@pytest.mark.parametrize("model", ["", "a b", "./nope", "../nope", "/nonexistent/target", "a/b/c", f"{NO_USER}/m"])
def test_a_target_model_that_names_nothing_is_refused(tmp_path, capsys, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "--model", model]) == 2  # was converted
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "model: model directory" in err, err
    f.write_text(yaml.safe_dump({"model": model}))
    with pytest.raises(ConfigError, match="model directory|non-empty string") as ei:
        convert_trtllm_config(str(f))
    assert ei.value.field == "model" and ei.value.source == str(f)


def test_target_models_that_may_be_right_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    for model in ("org/target", "gpt2", "./local", str(tmp_path / "local")):
        assert convert_trtllm_config({}, model=model).model == model
    # A YAML model replaced by --model is not read.
    assert convert_trtllm_config({"model": "/nonexistent/m"}, model="org/t").model == "org/t"


def test_output_to_a_pipe_with_a_reader_and_to_a_file(tmp_path, capsys):
    import os

    f = tmp_path / "n.yaml"
    f.write_text("max_batch_size: 4\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader (-o >(cmd)): written as before
    try:
        assert cli.main(["convert-config", str(f), "-q", "-o", str(fifo)]) == 0
        assert os.read(rfd, 4096) == b"--max-num-seqs 4\n"
    finally:
        os.close(rfd)
    out = tmp_path / "out.txt"
    out.write_text("old and longer content\n")
    assert cli.main(["convert-config", str(f), "-q", "-o", str(out)]) == 0
    assert out.read_text() == "--max-num-seqs 4\n"  # truncated, as open(..., "w") did


@pytest.mark.parametrize("value", ["--enforce-eager", "-x", "-", "--y=1", "-inf", "-nan"])
def test_a_string_value_that_looks_like_an_option_stays_the_value(tmp_path, capsys, value):
    # "--tokenizer --enforce-eager": argparse (vLLM's parser) reads the value as an option and
    # vLLM refused the command ("expected one argument") once kvslots serve had started it.
    import argparse

    r = convert_trtllm_config({"tokenizer": value, "max_seq_len": 64})
    args = r.cli_args()
    assert args == [f"--tokenizer={value}", "--max-model-len", "64"], args
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--tokenizer")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    ns = p.parse_args(args)
    assert ns.tokenizer == value and ns.max_model_len == 64 and not ns.enforce_eager
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump({"tokenizer": value}))
    from kvslots.serve import plan_from_argv

    assert f"--tokenizer={value}" in plan_from_argv(["org/target", "--extra-engine-args", str(f)]).argv



def _closed_stdout(argv: list[str], when: str):
    """Runs ``kvslots ARGV`` with file descriptor 1 closed: from the start (``>&-``: Python's
    sys.stdout is None) or once Python has started (a stdout whose writes fail with EBADF)."""
    import subprocess
    import sys

    if when == "at start":
        cmd = ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "kvslots", *argv]
    else:
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.close(1); sys.argv = ['kvslots', *sys.argv[1:]]; "
               "runpy.run_module('kvslots', run_name='__main__')", *argv]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)


@pytest.mark.parametrize("when, why", [("at start", "stdout is closed"), ("later", "Bad file descriptor")])
def test_a_closed_stdout_is_one_line_exit_2_and_output_to_a_file_still_works(tmp_path, when, why):
    # At start: sys.stdout.write on None was an AttributeError traceback (exit 1), and with -o the
    # final flush of a None stdout was one too. Later: EBADF was an OSError traceback.
    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    proc = _closed_stdout(["convert-config", str(f), "-q"], when)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"kvslots convert-config: error: cannot write the output: {why}\n", proc.stderr
    dest = tmp_path / "out.txt"
    proc = _closed_stdout(["convert-config", str(f), "-q", "-o", str(dest)], when)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert dest.read_text().startswith("--speculative-config ")


def test_an_output_file_it_cannot_fill_is_not_left_behind(tmp_path):
    # A write that failed part way (a full disk; here ulimit -f) left the new file behind,
    # truncated ("--max-num-"), and exit status 2 said nothing was written.
    import resource
    import subprocess
    import sys

    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    dest = tmp_path / "out.txt"
    proc = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(f), "-q", "-o", str(dest)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10)))
    assert proc.returncode == 2 and proc.stderr == f"kvslots convert-config: error: {dest}: cannot write: File too large\n", \
        proc.stderr
    assert not dest.exists()
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 0  # and then written whole
    assert dest.read_text().startswith("--speculative-config ")
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 0  # over an existing file
    assert dest.read_text().startswith("--speculative-config ")


@pytest.mark.parametrize("value", [
    "1:" + ":".join(["59"] * 200) + ".5",  # a base-60 float: PyYAML's OverflowError was a traceback
    "!!float " + ":".join(["9"] * 1000),
    "1:" + ":".join(["59"] * 1_300_000),  # a base-60 integer of 3.9 MB: ~10 minutes of PyYAML's arithmetic
], ids=["float-overflow", "tagged-float-overflow", "int-3.9MB"])
def test_a_yaml_base60_number_with_too_many_parts_is_one_line_exit_2_at_once(tmp_path, capsys, value):
    import time

    f = tmp_path / "e.yaml"
    f.write_text(f"gpu_memory_fraction: {value}\n")
    capsys.readouterr()
    start = time.monotonic()
    code = cli.main(["convert-config", str(f)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "has more than 64 ':' parts (a YAML 1.1 base-60 number)" in err and time.monotonic() - start < 10, err
    f.write_text("max_batch_size: 1:30\n")  # YAML 1.1, as TRT-LLM's own reader takes it: 90
    assert convert_trtllm_config(str(f)).engine_args["max_num_seqs"] == 90


def test_a_large_yaml_without_aliases_is_not_called_an_alias_bomb(tmp_path, capsys):
    # 120000 plain keys (1.3 MB, no alias) were refused as "more than 100000 nodes with aliases
    # expanded (an alias bomb?)".
    f = tmp_path / "big.yaml"
    f.write_text("".join(f"k{i}: {i}\n" for i in range(120_000)))
    capsys.readouterr()
    assert cli.main(["convert-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"more than {MAX_ENGINE_NODES} nodes; not a configuration file" in err, err
    assert "alias" not in err
    f.write_text("a: &a [" + ", ".join(["x"] * 1000) + "]\n" + "".join(f"k{i}: *a\n" for i in range(200)))
    assert cli.main(["convert-config", str(f)]) == 2
    assert "nodes with aliases expanded (an alias bomb?)" in capsys.readouterr().err


def test_an_explicit_key_overrides_a_merged_one_however_it_is_spelled():
    # YAML's << merge: an explicit key overrides a merged one. Spelled as an alias of the merged
    # key's own node, it was refused as "duplicate key 'max_batch_size'".
    from kvslots.config.trtllm import parse_trtllm_yaml

    text = ("base: &b {&k max_batch_size: 8, max_num_tokens: 4096}\n"
            "<<: *b\n"
            "*k : 16\n")
    doc = parse_trtllm_yaml(text)
    assert doc["max_batch_size"] == 16 and doc["max_num_tokens"] == 4096
    with pytest.raises(ConfigError, match="duplicate key 'max_batch_size'"):  # given twice explicitly: still refused
        parse_trtllm_yaml(text + "max_batch_size: 32\n")
    with pytest.raises(ConfigError, match="duplicate key 'max_batch_size'"):
        parse_trtllm_yaml("&k max_batch_size: 8\n*k : 16\n")


#: Within the file limits, each makes one string of the vLLM command longer than execve takes
#: (128 KiB): a 200 KB model_kwargs (a 200 KB --hf-overrides), a 9000-entry pp_partition of
#: 19-digit counts (a 180 KB VLLM_PP_LAYER_PARTITION). (A 20000-threshold draft_len_schedule was
#: one too, before engine YAMLs were held to MAX_ENGINE_NODES.)
LONG_JSON = "model_kwargs: {x: " + "d" * 200_000 + "}\n"
LONG_PARTITION = "pp_partition: [" + ",".join([str(2**62)] * 9000) + "]\n"


@pytest.mark.parametrize("yaml_text, what", [
    (LONG_JSON, "argument of --hf-overrides is"),
    (LONG_PARTITION, "environment variable VLLM_PP_LAYER_PARTITION is"),
], ids=["argument", "environment"])
def test_flags_longer_than_execve_takes_are_one_line_exit_2(tmp_path, capsys, yaml_text, what):
    # Printed as a vllm serve command tail that could not be run ('Argument list too long'),
    # while kvslots serve refuses the same command.
    f = tmp_path / "e.yaml"
    f.write_text(yaml_text)
    capsys.readouterr()
    for argv in ([], ["-o", str(tmp_path / "flags.txt")]):
        assert cli.main(["convert-config", str(f), "-q", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"kvslots convert-config: error: the vLLM command's {what} ") and "at most 131072" in err, err
    assert not (tmp_path / "flags.txt").exists()
    if yaml_text is LONG_JSON:  # as JSON or a --config file the value is no argument
        for fmt in ("json", "yaml"):
            assert cli.main(["convert-config", str(f), "-q", "--format", fmt]) == 0
    f.write_text("pp_partition: [" + ",".join(["1"] * 1000) + "]\n")  # long, but within the limit
    assert cli.main(["convert-config", str(f), "-q"]) == 0
