"""Hostile configuration files through the real CLI (`kvslots convert-config`, `kvslots indexer
--config`, `kvslots convert-config --speculators-dir`): the only outcomes are success, or one line
on stderr naming the file and the problem and exit status 2 -- never a traceback, never a hang.
The limits and rules are kvslots.config.loader's."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvslots import cli
from kvslots.config import loader
from kvslots.config.trtllm import convert_trtllm_config
from kvslots.errors import ConfigError, KVSlotsError, ServeError
from kvslots.indexer.config import IndexerConfig, build_config

ALIAS_BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9 if prev else ['lol'] * 9)}]\n"
    for prev, name in zip([None, *"abcdefgh"], "abcdefghi")
)
assert len(ALIAS_BOMB.encode()) < 400  # ~342 bytes; 9**9 "lol"s expanded

PREFIX = {"convert-config": "kvslots convert-config: error: ", "indexer": "kvslots indexer: "}


def argv_for(command: str, path: str) -> list[str]:
    if command == "convert-config":
        return ["convert-config", path, "--format", "json"]
    return ["indexer", "--config", path]


@pytest.fixture
def no_server(monkeypatch):
    """`kvslots indexer` with a good config would serve forever: uvicorn.run returns at once,
    and nothing is bound (the address check would fail where the config's port is taken)."""
    import uvicorn

    from kvslots.indexer import cli as indexer_cli

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(indexer_cli, "check_listen", lambda host, port: None)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    capsys.readouterr()
    start = time.perf_counter()
    code = cli.main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    return code, out, err, elapsed


def shown(path: str) -> str:
    """The file name as the error line shows it (control characters escaped)."""
    return cli.one_line(path)


def assert_one_line(command: str, path: str, code: int, out: str, err: str, problem: str | None = None) -> None:
    assert code == 2, (code, out, err)
    assert out == "", out
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"{PREFIX[command]}{shown(path)}: "), err
    if problem is not None:
        assert problem in err, err


# --------------------------------------------------------------------------- the hostile files
# name -> (content for convert-config, content for the indexer, a fragment of the problem).
# bytes are written as they are.

DEEP_FLOW = "[" * 3000 + "]" * 3000
DEEP_BLOCK = "".join(" " * i + "a:\n" for i in range(500))
GARBAGE = bytes(random.Random(0).randrange(256) for _ in range(4096))

BAD_CONTENT: dict[str, tuple[str | bytes, str | bytes, str]] = {
    "wrong_type": ("max_batch_size: [1, 2]\n", "port: [1, 2]\n", "must be an integer"),
    "wrong_type_str": ("max_batch_size: eight\n", "port: eighty\n", "must be an integer"),
    "wrong_type_mapping": ("kv_cache_config: 3\n", "tier_weights: 3\n", "mapping"),
    "wrong_type_workers": ("speculative_config: [1]\n", "workers: {a: 1}\n", "must be a"),
    "worker_not_mapping": ("max_num_tokens: {a: 1}\n", "workers: [1]\n", "must be"),
    "negative": ("max_batch_size: -4\n", "port: -1\n", "-"),
    "negative_timeout": ("max_num_tokens: -1\n", "replay_timeout: -1\n", "-1"),
    "huge_int": (f"max_batch_size: {2**70}\n", f"port: {2**70}\n", "integer out of range"),
    "huge_int_digits": ("max_batch_size: " + "9" * 5000 + "\n", "port: " + "9" * 5000 + "\n", "too many digits"),
    "huge_float": ("max_batch_size: 1.0e+999\n", "replay_timeout: 1.0e+999\n", "must be a finite number, got inf"),
    "nan": ("kv_cache_config:\n  free_gpu_memory_fraction: .nan\n", "tier_weights: {CPU: .nan}\n",
            "must be a finite number, got nan"),
    "inf": ("max_batch_size: .inf\n", "replay_timeout: .inf\n", "must be a finite number, got inf"),
    "neg_inf": ("x: [1, -.inf]\n", "tier_weights: {GPU: -.inf}\n", "must be a finite number, got -inf"),
    "nan_key": (".nan: 1\n", ".nan: 1\n", "must be a finite number"),
    "duplicate": ("max_batch_size: 8\nmax_batch_size: 16\n", "port: 1\nport: 2\n", "duplicate key"),
    "duplicate_nested": ("kv_cache_config:\n  enable_block_reuse: true\n  enable_block_reuse: false\n",
                         "workers:\n  - {name: a, name: b, endpoint: 'tcp://h:1'}\n", "duplicate key"),
    "unhashable_list_key": ("? [1, 2]\n: x\n", "? [1, 2]\n: x\n", "a list as a mapping key"),
    "unhashable_map_key": ("? {a: 1}\n: x\n", "{{a: 1}: 2}\n", "a mapping as a mapping key"),
    "bad_utf8": (b"max_batch_size: \xff\xfe\n", b"port: \xc3\x28\n", "not UTF-8"),
    "garbage": (GARBAGE, GARBAGE, "not UTF-8"),
    "control_chars": ("a: \x00\x01\n", "port: \x07\n", "invalid YAML"),
    "deep_flow": (DEEP_FLOW, DEEP_FLOW, "nested more than"),
    "deep_block": (DEEP_BLOCK, DEEP_BLOCK, "nested more than"),
    "alias_bomb": (ALIAS_BOMB, ALIAS_BOMB, "aliases expanded"),
    "recursive_alias": ("a: &a [1, *a]\n", "workers: &w [*w]\n", "inside the node it names"),
    "undefined_alias": ("a: *nope\n", "port: *nope\n", "invalid YAML"),
    "binary_tag": ("model: !!binary aGVsbG8=\n", "host: !!binary aGVsbG8=\n", "!!binary"),
    "set_tag": ("a: !!set {x, y}\n", "host: !!set {x}\n", "!!set"),
    "python_tag": ("a: !!python/object/apply:os.system [echo hi]\n",
                   "a: !!python/object/apply:os.system [echo hi]\n", "invalid YAML"),
    "two_documents": ("a: 1\n---\nb: 2\n", "port: 1\n---\nport: 2\n", "single document"),
    "syntax": ("max_batch_size: [1, 2\n", "port: [1\n", "invalid YAML"),
    "top_list": ("- max_batch_size: 8\n", "- port: 1\n", "list"),
    "top_scalar": ("just a string\n", "just a string\n", "str"),
    "top_number": ("42\n", "42\n", "int"),
    "long_key": ("? " + "k" * 5000 + "\n: 1\n", "? " + "k" * 5000 + "\n: 1\n", "longer than 1024"),
    "unknown_keys": ("1: 2\n", "colour: red\n", ""),
    "bad_value": ("kv_cache_config:\n  free_gpu_memory_fraction: 1.5\n", "backend: tape\n", ""),
    "bad_worker": ("speculative_config: {decoding_type: Nope}\n",
                   "workers:\n  - {name: 'a b', endpoint: 'http://x'}\n", ""),
    "short_token": ("max_batch_size: true\n", "admin_token: short\n", ""),
    "log_level": ("max_num_tokens: 1.5\n", "log_level: loud\n", ""),
}


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize("command", ["convert-config", "indexer"])
@pytest.mark.parametrize("case", sorted(BAD_CONTENT))
def test_bad_file_is_one_line_exit_2(tmp_path, capsys, command, case):
    convert_text, indexer_text, problem = BAD_CONTENT[case]
    path = write(tmp_path / f"{case}.yaml", convert_text if command == "convert-config" else indexer_text)
    code, out, err, elapsed = run_cli(argv_for(command, path), capsys)
    assert_one_line(command, path, code, out, err, problem or None)
    assert elapsed < 5.0, elapsed


@pytest.mark.parametrize("command", ["convert-config", "indexer"])
def test_not_a_regular_file(tmp_path, capsys, command):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # nobody writes to it: reading it would block forever
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    for path, problem in [(str(fifo), "not a regular file (a FIFO)"),
                          (str(directory), "is a directory"),
                          ("/dev/zero", "not a regular file (a character device)"),
                          (str(tmp_path / "missing.yaml"), "no such file")]:
        code, out, err, elapsed = run_cli(argv_for(command, path), capsys)
        assert_one_line(command, path, code, out, err, problem)
        assert elapsed < 5.0


@pytest.mark.parametrize("command", ["convert-config", "indexer"])
def test_unreadable_and_oversized_files(tmp_path, capsys, monkeypatch, command):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(loader.MAX_BYTES + 1)  # sparse: nothing of it is read
    code, out, err, _ = run_cli(argv_for(command, str(big)), capsys)
    assert_one_line(command, str(big), code, out, err, "larger than 4 MiB")

    secret = tmp_path / "secret.yaml"
    secret.write_text("max_batch_size: 4\n")
    secret.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make the open fail as it would for a user
        real_open = os.open

        def deny(name, *a, **k):
            if os.fspath(name) == str(secret):
                raise PermissionError(13, "Permission denied", str(secret))
            return real_open(name, *a, **k)

        monkeypatch.setattr(os, "open", deny)
    code, out, err, _ = run_cli(argv_for(command, str(secret)), capsys)
    assert_one_line(command, str(secret), code, out, err, "permission denied")


@pytest.mark.parametrize("command", ["convert-config", "indexer"])
def test_control_characters_in_the_file_name_stay_one_line(tmp_path, capsys, command):
    path = write(tmp_path / "bad\nname\x1b[31m.yaml", "- 1\n")
    code, out, err, _ = run_cli(argv_for(command, path), capsys)
    assert_one_line(command, path, code, out, err)
    assert "bad\\nname\\x1b[31m.yaml" in err


@pytest.mark.parametrize("command", ["convert-config", "indexer"])
@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "~\n", "\ufeff# a BOM\n"])
def test_empty_documents_succeed(tmp_path, capsys, no_server, command, text):
    path = write(tmp_path / "empty.yaml", text)
    code, out, err, _ = run_cli(argv_for(command, path), capsys)
    assert code == 0, err
    if command == "convert-config":
        assert json.loads(out) == {} and "empty" in err


def test_good_files_succeed(tmp_path, capsys, no_server):
    path = write(tmp_path / "trt.yaml", "base: &b {enable_block_reuse: true}\nkv_cache_config:\n  <<: *b\n"
                                        "  enable_block_reuse: false\nmax_batch_size: 8\nrevision: 2024-01-01\n")
    code, out, err, _ = run_cli(argv_for("convert-config", path), capsys)
    assert code == 0, err
    args = json.loads(out)
    assert args["max_num_seqs"] == 8 and args["revision"] == "2024-01-01"  # a date stays a string
    path = write(tmp_path / "idx.yaml", "workers:\n  - {name: w0, endpoint: 'tcp://h:1', tier: cpu}\n"
                                        "tier_weights: {cpu: 0.5}\nport: 9000\nreplay_timeout: 1\n")
    code, out, err, _ = run_cli(argv_for("indexer", path), capsys)
    assert code == 0, err


# --------------------------------------------------------------------------- the alias bomb


def test_alias_bomb_fails_fast_and_small(tmp_path, capsys):
    path = write(tmp_path / "bomb.yaml", ALIAS_BOMB)
    tracemalloc.start()
    try:
        for command in ("convert-config", "indexer"):
            code, out, err, elapsed = run_cli(argv_for(command, path), capsys)
            assert_one_line(command, path, code, out, err, "aliases expanded")
            assert elapsed < 1.0, elapsed
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024, peak
    # A few shared aliases are fine.
    doc = loader.parse_yaml("a: &a [1, 2, 3]\nb: *a\nc: *a\n")
    assert doc == {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2, 3]}


# --------------------------------------------------------------------------- subprocesses


def run_kvslots(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvslots", *argv], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_subprocess_alias_bomb_fifo_and_deep_nesting(tmp_path):
    bomb = write(tmp_path / "bomb.yaml", ALIAS_BOMB)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    deep = write(tmp_path / "deep.yaml", DEEP_FLOW)
    unhashable = write(tmp_path / "unhashable.yaml", "? [1, 2]\n: x\n")
    for command, path, problem in [("convert-config", bomb, "aliases expanded"),
                                   ("convert-config", str(fifo), "not a regular file"),
                                   ("convert-config", unhashable, "a list as a mapping key (keys are strings or numbers) at line 1"),
                                   ("indexer", deep, "nested more than 64 levels deep"),
                                   ("indexer", bomb, "aliases expanded")]:
        start = time.monotonic()
        p = run_kvslots(*argv_for(command, path))
        assert time.monotonic() - start < 60
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert p.stdout == "" and "Traceback" not in p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{PREFIX[command]}{path}: ") and problem in lines[0], p.stderr


# --------------------------------------------------------------------------- config.json (speculators)


@pytest.mark.parametrize("content, problem", [
    ('{"speculators_config": {"x": NaN}}', "speculators_config.x: must be a finite number, got nan"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ("[" * 3000 + "]" * 3000, "nested more than"),
    ('{"a": ' + "1" * 5000 + "}", "too many digits"),
    ("[1, 2]", "must be a JSON object"),
    ('{"a": 1', "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
    ('{"a": 1}'.encode("utf-16-le"), "invalid JSON"),  # read as UTF-8 text with NULs in it
    ('{"a": 1}'.encode("utf-32"), "not UTF-8"),
])
def test_speculators_config_json(tmp_path, capsys, content, problem):
    d = tmp_path / "spec"
    d.mkdir()
    cfg = write(d / "config.json", content)
    yaml_path = write(tmp_path / "cfg.yaml", "max_batch_size: 4\n")
    code, out, err, _ = run_cli(["convert-config", yaml_path, "--speculators-dir", str(d)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"kvslots convert-config: error: {cfg}: ") and problem in err, err


# --------------------------------------------------------------------------- the strict JSON parser


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
@pytest.mark.parametrize("open_, close", [("[", "]"), ('{"a":', "}")])
def test_strict_json_depth_limit_holds_at_any_depth(depth, open_, close):
    text = open_ * depth + "1" + close * depth
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        loader.loads_strict_json(text)
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        loader.loads_strict_json(text.encode())
    assert time.perf_counter() - start < 5


def test_strict_json_depth_counts_structure_not_strings():
    assert loader.loads_strict_json("[" * 64 + "]" * 64) is not None
    inside = '["' + "[{" * 500 + '\\"", "x"]'  # brackets in strings (and an escaped quote) are text
    assert loader.loads_strict_json(inside)[1] == "x"
    flat = "[" + "[]," * 10_000 + "[]]"  # many brackets, none deep
    assert len(loader.loads_strict_json(flat)) == 10_001


@pytest.mark.parametrize("text", [b'{"prompt": "\\ud800"}', b'{"\\udc80": 1}', b'["a\\udfff"]',
                                  '{"a": "\ud800"}', b'{"a": "\xed\xa0\x80"}'])
def test_strict_json_refuses_lone_surrogates(text):
    with pytest.raises(ConfigError, match="surrogate|not UTF-8"):
        loader.loads_strict_json(text)


def test_strict_json_keeps_surrogate_pairs_and_escaped_backslashes():
    assert loader.loads_strict_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
    assert loader.loads_strict_json(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}


# --------------------------------------------------------------------------- JSON output


def test_json_output_never_has_bare_nan(tmp_path, capsys):
    path = write(tmp_path / "nan.yaml", "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: .nan\n")
    code, out, err, _ = run_cli(["convert-config", path, "--format", "json"], capsys)
    assert_one_line("convert-config", path, code, out, err, "speculative_config.num_nextn_predict_layers: must be a finite number")
    result = convert_trtllm_config({"max_batch_size": 4})
    result.engine_args["bogus"] = float("nan")  # whatever got in, JSON output refuses it
    with pytest.raises(ConfigError, match="cannot be written as JSON"):
        result.to_json()
    with pytest.raises(ConfigError):
        loader.dump_json({"a": [float("inf")]})
    assert loader.dump_json({"a": 1.5}) == '{"a": 1.5}'


# --------------------------------------------------------------------------- one error home


def test_one_error_handler_in_main(capsys, monkeypatch):
    from kvslots.config import cli as config_cli
    from kvslots.demo import run as demo
    from kvslots.serve import cli as serve_cli

    for module in (config_cli, serve_cli, demo):
        assert "except KVSlotsError" not in inspect.getsource(module), module.__name__

    def boom(*a, **k):
        raise ServeError("first line\nsecond line")

    monkeypatch.setattr(config_cli, "convert_trtllm_config", boom)
    code, out, err, _ = run_cli(["convert-config", "x.yaml"], capsys)
    assert code == 2 and out == "" and err == "kvslots convert-config: error: first line\\nsecond line\n"
    assert issubclass(ConfigError, KVSlotsError)


# --------------------------------------------------------------------------- hypothesis


def _vocabulary() -> list[str]:
    """Key names and values the converter knows, read from its sources."""
    import kvslots.config.trtllm as trtllm

    words: set[str] = set()
    for name in ("engine_keys", "parallel", "kv_cache", "cuda_graphs", "speculative", "keys", "converter"):
        module = __import__(f"{trtllm.__name__}.{name}", fromlist=["_"])
        words.update(re.findall(r'"([A-Za-z][A-Za-z0-9_]{1,40})"', inspect.getsource(module)))
        words.update(m[2:] for m in re.findall(r"\bk_[a-z0-9_]+", inspect.getsource(module)))
    return sorted(words)


VOCAB = _vocabulary()
INDEXER_KEYS = ["workers", "host", "port", "backend", "redis_url", "redis_namespace", "tier_weights",
                "capacity", "block_size", "max_tokens", "admin_token", "replay_timeout", "log_level",
                "name", "endpoint", "replay", "topic", "tier", "GPU", "CPU", "STORAGE"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=70000), st.floats(), st.text(max_size=12),
    st.sampled_from(VOCAB + INDEXER_KEYS + ["tcp://h:1", "ipc:///tmp/x", "auto", "fp8", "Eagle", "MTP",
                                            "memory", "redis", "info", "cpu", "0" * 20]),
)
keys = st.one_of(st.sampled_from(VOCAB + INDEXER_KEYS), st.text(max_size=6), st.integers(-2, 9))
documents = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=5),
                               st.dictionaries(keys, children, max_size=6)),
    max_leaves=30,
)
TOKENS = ["a", "max_batch_size", "kv_cache_config", "speculative_config", "decoding_type", "Eagle", "MTP",
          "max_draft_len", "cuda_graph_config", "batch_sizes", "workers", "port", "tier_weights", "name",
          "endpoint", "tcp://h:1", ": ", ":", "\n", "  ", "    ", "- ", "[", "]", "{", "}", ", ", "&a ", "*a",
          "&b ", "*b", "<<: ", "? ", ".nan", ".inf", "-.inf", "1.0e+999", str(2**64), "-1", "0", "1", "3.5",
          "true", "null", "~", "!!set ", "!!binary ", "!!python/object:x ", "!!int ", "!!float ", "!!str ",
          "!!map ", "!!seq ", "!foo ", "'", '"', "# c", "---\n", "...\n", "|\n", ">\n", "\t", "2024-01-01",
          "%YAML 1.1\n", "\\", "é", "\x00", "\ufeff", "1:30", "0x1F", "0o17", "=", "<<"]
yamlish = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=3)), max_size=40).map("".join)

HYPOTHESIS = settings(max_examples=150, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"bare {name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def _convert_via_cli(capsys, text: str | bytes, fmt: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "doc.yaml", text)
        code, out, err, elapsed = run_cli(["convert-config", path, "--format", fmt], capsys)
    assert elapsed < 10.0
    if code == 0:
        if fmt == "json":
            _strict_json(out)
        return
    assert_one_line("convert-config", path, code, out, err)


def _indexer_config(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "idx.yaml", text)
        try:
            cfg = build_config(argparse.Namespace(config=path))
        except ConfigError as e:
            assert str(e).startswith(f"{path}: "), str(e)
            return
    assert isinstance(cfg, IndexerConfig)


@HYPOTHESIS
@given(text=yamlish, fmt=st.sampled_from(["flags", "json", "yaml"]))
def test_random_yamlish_text_convert_config(capsys, text, fmt):
    _convert_via_cli(capsys, text, fmt)


@HYPOTHESIS
@given(doc=documents, fmt=st.sampled_from(["flags", "json", "yaml"]))
def test_random_documents_convert_config(capsys, doc, fmt):
    _convert_via_cli(capsys, yaml.safe_dump(doc, allow_unicode=True), fmt)


@HYPOTHESIS
@given(doc=st.dictionaries(st.sampled_from(VOCAB), documents, max_size=6), fmt=st.sampled_from(["json", "flags"]))
def test_random_trtllm_shaped_documents_convert_config(capsys, doc, fmt):
    _convert_via_cli(capsys, yaml.safe_dump(doc, allow_unicode=True), fmt)


@HYPOTHESIS
@given(text=st.one_of(yamlish, documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                      st.dictionaries(st.sampled_from(INDEXER_KEYS), documents, max_size=6)
                      .map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                      st.binary(max_size=64)))
def test_random_documents_indexer_config(text):
    _indexer_config(text)


# ---- kvslots demo: its flags and --cache-dir are checked before anything is built or started ----


@pytest.fixture
def demo_starts_nothing(monkeypatch):
    """Building the models or starting the server fails the test: a bad flag is refused first."""
    import kvslots._dev.tiny as tiny
    from kvslots.demo import run as demo

    def started(*a, **k):
        raise AssertionError("the demo started something before refusing its flags")

    monkeypatch.setattr(demo, "subprocess", argparse.Namespace(Popen=started))
    monkeypatch.setattr(tiny, "build_tiny_models", started)


@pytest.mark.parametrize("argv, flag", [
    (["-k", "0"], "-k"), (["-k", "-1"], "-k"), (["-k", "65"], "-k"), (["-k", str(10**30)], "-k"),
    (["--requests", "0"], "--requests"), (["--requests", "-3"], "--requests"), (["--requests", "1001"], "--requests"),
    (["--prefix-len", "-1"], "--prefix-len"), (["--max-tokens", "0"], "--prefix-len"),
    (["--max-tokens", "-5"], "--prefix-len"), (["--prefix-len", "2000"], "--prefix-len"),
    (["--prefix-len", str(10**30)], "--prefix-len"),
    (["--host-cache-gb", "nan"], "--host-cache-gb"), (["--host-cache-gb", "inf"], "--host-cache-gb"),
    (["--host-cache-gb", "0"], "--host-cache-gb"), (["--host-cache-gb", "-1"], "--host-cache-gb"),
    (["--host-cache-gb", "1e7"], "--host-cache-gb"), (["--host-cache-gb", "1e-300"], "--host-cache-gb"),
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"), (["--timeout", "0"], "--timeout"),
    (["--timeout", "-5"], "--timeout"),
])
def test_demo_bad_flag_is_one_line_exit_2_before_anything_starts(capsys, demo_starts_nothing, argv, flag):
    capsys.readouterr()
    code = cli.main(["demo", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith(f"kvslots demo: error: {flag} ") and err.count("\n") == 1, err


def _cache_dirs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".complete").write_text('{"layers": 99}\n')
    (tmp_path / "dir-stamp" / ".complete").mkdir(parents=True)
    (tmp_path / "binary-stamp").mkdir()
    (tmp_path / "binary-stamp" / ".complete").write_bytes(b"\xff\xfe\0")
    return {"a file": str(tmp_path / "file"), "under a file": str(tmp_path / "file" / "sub"),
            "other dimensions": str(tmp_path / "other"), "stamp is a directory": str(tmp_path / "dir-stamp"),
            "stamp not UTF-8": str(tmp_path / "binary-stamp"), "NUL": str(tmp_path / "a\0b"), "empty": ""}


@pytest.mark.parametrize("case", ["a file", "under a file", "other dimensions", "stamp is a directory",
                                  "stamp not UTF-8", "NUL", "empty"])
def test_demo_cache_dir_it_cannot_use_is_one_line_exit_2(tmp_path, capsys, monkeypatch, case):
    from kvslots.demo import run as demo

    def started(*a, **k):
        raise AssertionError("the server was started")

    monkeypatch.setattr(demo, "subprocess", argparse.Namespace(Popen=started))
    monkeypatch.chdir(tmp_path)  # "" built the models in the working directory
    path = _cache_dirs(tmp_path)[case]
    capsys.readouterr()
    code = cli.main(["demo", "--cache-dir", path])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("kvslots demo: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_demo_server_that_fails_mid_workload_is_a_serve_error():
    from kvslots.demo import run as demo

    with socket_closed_port() as port:
        with pytest.raises(ServeError, match=f"GET http://127.0.0.1:{port}/metrics: "):
            demo._http("GET", f"http://127.0.0.1:{port}/metrics", timeout=5)


def socket_closed_port():
    """A context manager giving a local port nothing listens on."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def closed():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield port

    return closed()


def test_demo_defaults_and_edges_pass_the_check():
    from kvslots.demo import run as demo

    parser = cli.build_parser()
    demo.check_args(parser.parse_args(["demo"]))
    demo.check_args(parser.parse_args(["demo", "-k", "64", "--requests", "1", "--prefix-len", "0",
                                       "--max-tokens", "2008", "--host-cache-gb", "0.01", "--timeout", "1"]))


_SERVE_WITHOUT_VLLM = ("import sys\nimport kvslots.serve.cli as sc\n"
                      "sc.supervise = lambda *a, **k: 0\nsc.check_listen = lambda *a: None\n"
                      "from kvslots.cli import main\nsys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize("argv, status, stdout", [
    (["-m", "kvslots", "convert-config", "{good}"], 0, "--max-num-seqs 4\n"),  # notes went to stdout
    (["-m", "kvslots", "convert-config", "{bad}"], 2, ""),  # the error went to stdout
    (["-m", "kvslots", "serve", "org/target", "--dry-run"], 0, "vllm.entrypoints.openai.api_server"),
    (["-c", _SERVE_WITHOUT_VLLM, "serve", "org/target"], 0, "vllm.entrypoints.openai.api_server"),  # exit status 1
])
def test_a_closed_stderr_keeps_stdout_the_output_and_the_status_true(tmp_path, argv, status, stdout):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("max_batch_size: 4\nnot_a_trtllm_key: 1\n")
    bad.write_text("max_batch_size: -1\n")
    cmd = [sys.executable, *[a.format(good=good, bad=bad) for a in argv]]
    proc = subprocess.run(["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", *cmd], stdout=subprocess.PIPE, text=True,
                          timeout=120)
    assert proc.returncode == status, proc.stdout
    if stdout.endswith("\n") or not stdout:
        assert proc.stdout == stdout
    else:  # serve: the vLLM command alone (sys.stderr.flush() failed), no note or KV events line
        assert stdout in proc.stdout and proc.stdout.count("\n") == 1, proc.stdout


@pytest.mark.parametrize("argv", [["convert-config", "{yaml}"], ["simulate", "--requests", "3"],
                                  ["serve", "org/target", "--dry-run", "-q"]])
@pytest.mark.parametrize("sink", ["full", "closed pipe"])
def test_output_that_cannot_be_written_is_one_line_exit_2(tmp_path, argv, sink):
    # /dev/full (ENOSPC) and a reader gone (`| head -1`: EPIPE) were tracebacks, exit status 1.
    f = tmp_path / "n.yaml"
    f.write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    cmd = [sys.executable, "-m", "kvslots", *[a.format(yaml=f) for a in argv]]
    if sink == "full":
        with open("/dev/full", "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    else:
        r, w = os.pipe()
        os.close(r)  # nobody will read: the first write is EPIPE
        try:
            proc = subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(w)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the output" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [
    [],  # the whole help, on stdout
    ["bogus"], ["--nope"], ["convert-config"], ["convert-config", "x.yaml", "--format", "toml"],
    ["indexer", "--port", "x"], ["indexer", "--log-level", "trace"], ["indexer", "--capacity", "1.5"],
    ["indexer", "--max-frame-mb", "1e3"], ["simulate", "--requests", "x"], ["simulate", "--acceptance"], ["proxy", "--prefill", "http://p"],
    ["proxy", "--prefill", "http://p", "--decode", "http://d", "--port", "x"], ["demo", "--method", "x"],
    ["demo", "-k", "x"], ["serve"], ["serve", "org/m", "--port", "x"], ["convert-config", "x.yaml", "--bogus"],
])
def test_argument_errors_are_one_line_exit_2(capsys, argv):
    # argparse printed its usage first: several lines.
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert ei.value.code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("kvslots") and ": error: " in err, err


@pytest.mark.parametrize("value", ["0", "-5", "4097", str(2**80)])
def test_indexer_max_frame_mb_out_of_range_is_one_line_exit_2(capsys, no_server, value):
    code, out, err, _ = run_cli(["indexer", "--max-frame-mb", value], capsys)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("kvslots indexer: ") and "max_frame_mb" in err, err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_strict_json_takes_utf8_only(encoding):
    from kvslots.config.loader import loads_strict_json

    with pytest.raises(ConfigError, match="not UTF-8"):
        loads_strict_json('{"token_ids": [1, 2]}'.encode(encoding))
    assert loads_strict_json('{"token_ids": [1, 2]}'.encode("utf-8")) == {"token_ids": [1, 2]}
    assert loads_strict_json('{"a": "\u00e9"}'.encode("utf-8-sig")) == {"a": "\u00e9"}  # a BOM may be ignored


@pytest.mark.parametrize("argv", [
    ["serve", "org/m", "--dry-run", "--kv-events-replay-endpoint=--"],  # was an AttributeError traceback
    ["serve", "org/m", "--dry-run", "--port=--"], ["serve", "org/m", "--dry-run", "--grace-period=--"],
    ["serve", "org/m", "--dry-run", "--role=--"], ["convert-config", "x.yaml", "--format=--"],
    ["indexer", "--tier-weight=--"], ["indexer", "--port=--"], ["simulate", "-k--"], ["demo", "--method=--"],
])
def test_an_options_value_of_two_dashes_is_judged_as_text(capsys, no_server, demo_starts_nothing, argv):
    # Python < 3.13 dropped a "--" given as an option's own value: the option was [] past its
    # type and choices (--port=-- ran with port [], --format=-- as flags, tracebacks elsewhere).
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "'--'" in err and "Traceback" not in err, err
    args = cli.build_parser().parse_args(["serve", "org/m", "--kv-events-topic=--", "--host", "h"])
    assert args.kv_events_topic == "--" and args.vllm_args == []


@pytest.mark.parametrize("argv, problem", [
    ([""], "an empty path names no directory"),  # the models were built in the working directory
    (["{tmp}/m", "--intermediate", "0"], "Dims.intermediate"),  # 0 was taken as the default
])
def test_tiny_models_refuse_an_empty_root_and_a_zero_size(tmp_path, capsys, monkeypatch, argv, problem):
    from kvslots._dev import tiny

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert tiny.main([a.format(tmp=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and problem in err, err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # nothing built


@pytest.mark.parametrize("argv", [["--layers", "65536"], ["--hidden", "65536", "--heads", "1", "--kv-heads", "1",
                                                          "--intermediate", "65536"]])
def test_tiny_models_too_large_to_build_are_refused_before_building(tmp_path, capsys, monkeypatch, argv):
    # Each size was bounded, not their product: torch was asked for tens of GB of weights.
    from kvslots._dev import tiny

    def built(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(tiny, "build_target", built)
    capsys.readouterr()
    assert tiny.main([str(tmp_path / "m"), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "not a tiny model" in err, err
    assert tiny.REALISTIC.num_params <= tiny.MAX_PARAMS


def test_dump_json_of_a_structure_too_deep_for_the_stack_is_a_config_error():
    import functools

    deep = functools.reduce(lambda inner, _: [inner], range(100_000), [])
    with pytest.raises(ConfigError, match="nested too deep"):  # was json's RecursionError
        loader.dump_json(deep)
    assert loader.dump_json([[[]]]) == "[[[]]]"


@pytest.mark.parametrize("max_bytes", ["4096", None, 1.5, True, -1])
def test_read_config_text_max_bytes_must_be_a_size(tmp_path, max_bytes):
    from kvslots.errors import ArgumentTypeError

    f = write(tmp_path / "a.yaml", "a: 1\n")
    with pytest.raises(ArgumentTypeError, match="max_bytes"):  # "4096" was a TypeError
        loader.read_config_text(f, max_bytes=max_bytes)
    assert loader.read_config_text(f, max_bytes=64) == "a: 1\n"


def test_notes_naming_keys_with_control_characters_stay_one_line_each(tmp_path, capsys):
    # An unknown key "a\nb\x1b[31m" was printed as it is: a line break and a raw escape sequence.
    path = write(tmp_path / "k.yaml", '"a\\nb\\e[31m": 1\nkv_cache_config: {"x\\ny": 2}\n')
    for argv in (["convert-config", path], ["serve", "org/target", "--dry-run", "--extra-engine-args", path]):
        capsys.readouterr()
        assert cli.main(argv) == 0
        err = capsys.readouterr().err
        assert "\x1b" not in err and "a\\nb\\x1b[31m = 1" in err and "kv_cache_config.x\\ny = 2" in err, err
        assert all(line.startswith(("unknown:", "kvslots serve:")) for line in err.splitlines()), err


# Loaded as sitecustomize in the child: a terminal's Ctrl-C (a background shell starts children
# with SIGINT ignored), and an import of KVSLOTS_TEST_SLOW that waits, after saying so in a file,
# so that the signal lands inside that import every time.
_SLOW_IMPORT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["KVSLOTS_TEST_SLOW"]:
            open(os.environ["KVSLOTS_TEST_MARK"], "w").close()
            time.sleep(60)
        return None
sys.meta_path.insert(0, _Slow())
"""


@pytest.mark.parametrize("entry, slow", [
    (["-m", "kvslots"], "kvslots.cli"),  # __main__'s own import
    (["-m", "kvslots"], "kvslots.serve.cli"),  # build_parser's imports
    (["-c", "import sys; from kvslots.cli import main; sys.exit(main())"], "kvslots.demo.run"),  # the console script
])
def test_ctrl_c_during_the_imports_is_one_line_and_status_130(tmp_path, entry, slow):
    import signal

    (tmp_path / "sitecustomize.py").write_text(_SLOW_IMPORT)
    mark = tmp_path / "importing"
    root = os.path.join(os.path.dirname(__file__), "..", "python")
    env = dict(os.environ, KVSLOTS_TEST_SLOW=slow, KVSLOTS_TEST_MARK=str(mark),
               PYTHONPATH=os.pathsep.join(p for p in [str(tmp_path), root, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, *entry, "serve", "org/target", "--dry-run"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and out == "", (proc.returncode, err)
    assert err == "kvslots: interrupted\n", err


def test_ctrl_c_in_a_command_that_does_not_catch_it_is_one_line_and_status_130(capsys, monkeypatch):
    import signal

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_command", interrupted)
    before = signal.getsignal(signal.SIGINT)
    try:
        code = cli.main(["convert-config", "x.yaml"])
    except KeyboardInterrupt:  # caught here: escaping, it would stop the whole test session
        pytest.fail("the KeyboardInterrupt escaped kvslots (a traceback)")
    assert code == 130 and capsys.readouterr().err == "kvslots convert-config: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # a caller's argv: not the process's exit
