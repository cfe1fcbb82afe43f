"""Hostile `kvslots serve` / `kvslots convert-config` input, without -q: an error is the only
line on stderr (`kvslots <cmd>: error: ...`, exit status 2) -- no note, warning or vLLM command
printed before it, nothing started."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvslots import cli
from kvslots.config import vllm_fields
from test_serve_hostile import busy_port  # noqa: F401 (a fixture: a listening port)


def _no_vllm(monkeypatch) -> None:
    from kvslots.serve import cli as serve_cli

    def no_vllm(*a, **k):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(serve_cli, "supervise", no_vllm)


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_only_the_error(code: int, out: str, err: str, command: str, problem: str) -> None:
    assert code == 2, (code, out, err)
    assert out == "", out
    assert err.count("\n") == 1 and err.startswith(f"kvslots {command}: error: "), err
    assert problem in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




# ---- 1. every check before the first note or the vLLM command -------------------------------


def test_serve_address_error_comes_before_any_note_or_the_command(capsys, monkeypatch, busy_port):
    # org/target (a Hub id) and the KV connector give notes; the address check came after them
    # and after the vLLM command was printed on stdout.
    _no_vllm(monkeypatch)
    for argv in (["--host", "no-such-host.invalid"], ["--host", "127.0.0.1", "--port", str(busy_port)],
                 ["--host", "127.0.0.1", "--", "--port", str(busy_port)]):
        code, out, err = _main(capsys, "serve", "org/target", *argv)
        _assert_only_the_error(code, out, err, "serve", "cannot ")


def test_an_events_port_in_use_is_one_line_before_vllm_starts(capsys, monkeypatch, busy_port):
    # vLLM's publisher bound the endpoint (and the replay socket its own) only once the engine
    # was loaded: ZMQError "Address already in use" after the model load, in vLLM's log.
    _no_vllm(monkeypatch)
    free = _free_port()
    http = _free_port()
    while http in (free, busy_port):  # the HTTP server's port apart from the events sockets'
        http = _free_port()
    for argv in (["--kv-events-endpoint", f"tcp://*:{busy_port}"],
                 ["--kv-events-endpoint", f"tcp://[::ffff:127.0.0.1]:{busy_port}"],
                 ["--kv-events-endpoint", f"tcp://*:{free}", "--kv-events-replay-endpoint",
                  f"tcp://127.0.0.1:{busy_port}"],
                 # the second data-parallel rank binds the port after the first's
                 ["--kv-events-endpoint", f"tcp://*:{busy_port - 1}", "--kv-events-replay-endpoint", "none",
                  "--", "--data-parallel-size", "2"]):
        code, out, err = _main(capsys, "serve", "org/target", "--port", str(http), *argv)
        _assert_only_the_error(code, out, err, "serve", "KV events: cannot listen on ")
        assert f":{busy_port}: " in err, err


def test_events_ports_vllm_connects_to_or_the_os_picks_are_not_checked(monkeypatch):
    from kvslots.serve.cli import plan_from_argv

    for argv, want in ((["--kv-events-endpoint", "tcp://127.0.0.1:5557"], [("127.0.0.1", 5558)]),
                       (["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "none"], []),
                       (["--no-kv-events"], []),
                       (["--kv-events-endpoint", "tcp://*:6000", "--", "--data-parallel-size", "2"],
                        [("0.0.0.0", 6000), ("0.0.0.0", 6001), ("127.0.0.1", 6002), ("127.0.0.1", 6003)])):
        assert plan_from_argv(["org/target", *argv]).events_bind_addresses() == want, argv


def test_serve_flag_errors_found_late_come_alone(capsys, monkeypatch):
    _no_vllm(monkeypatch)
    code, out, err = _main(capsys, "serve", "org/target", "--kv-events-endpoint", "tcp://*:99999")
    _assert_only_the_error(code, out, err, "serve", "--kv-events-endpoint")


def _noisy_yaml(tmp_path: Path) -> str:
    """A TRT-LLM YAML whose conversion has notes (an ignored and an unknown key)."""
    path = tmp_path / "engine.yaml"
    path.write_text("max_batch_size: 8\nprint_iter_log: true\nno_such_trtllm_key: 1\n")
    return str(path)


def test_convert_config_empty_output_path_error_comes_alone(tmp_path, capsys):
    code, out, err = _main(capsys, "convert-config", _noisy_yaml(tmp_path), "-o", "")
    _assert_only_the_error(code, out, err, "convert-config", "an empty path names no file")


def test_convert_config_unwritable_output_error_comes_alone(tmp_path, capsys):
    code, out, err = _main(capsys, "convert-config", _noisy_yaml(tmp_path), "-o", str(tmp_path / "no" / "dir"))
    _assert_only_the_error(code, out, err, "convert-config", "cannot write")


def test_convert_config_failed_check_comes_alone(tmp_path, capsys, monkeypatch):
    from kvslots.config import cli as config_cli
    from kvslots.errors import ConfigError

    def refuse(result):
        raise ConfigError("refused for the test")

    monkeypatch.setattr(config_cli, "check_with_vllm", refuse)
    code, out, err = _main(capsys, "convert-config", _noisy_yaml(tmp_path), "--check")
    _assert_only_the_error(code, out, err, "convert-config", "vLLM check failed: refused for the test")


def test_convert_config_notes_still_printed_on_success(tmp_path, capsys):
    code, out, err = _main(capsys, "convert-config", _noisy_yaml(tmp_path))
    assert code == 0 and "--max-num-seqs 8" in out, (out, err)
    assert "no_such_trtllm_key" in err and "print_iter_log" in err, err
    target = tmp_path / "out.txt"
    code, out, err = _main(capsys, "convert-config", _noisy_yaml(tmp_path), "-o", str(target))
    assert code == 0 and out == "" and "--max-num-seqs 8" in target.read_text(), (out, err)
    assert "no_such_trtllm_key" in err, err


# ---- 2. the server's --host: the endpoints' host rule, before anything is printed ------------


@pytest.mark.parametrize("host, problem", [
    ("a b", "the host contains spaces or control characters"),
    (" ", "the host contains spaces or control characters"),
    ("a\tb", "the host contains spaces or control characters"),
    ("a\nb", "the host contains spaces or control characters"),
    ("a\x01b", "the host contains spaces or control characters"),
    ("a\x7fb", "the host contains spaces or control characters"),
    ("a\u2028b", "the host contains spaces or control characters"),
    ("a\0b", "the host contains spaces or control characters"),
    ("", "an empty host names no address"),
    ("a\udc80b", "no lone surrogates"),
    ("a" * 254, "at most 253 characters"),
    ("a." * 200 + "lan", "at most 253 characters"),
])
@pytest.mark.parametrize("where", ["flag", "tail"])
def test_a_server_host_that_names_no_address_is_one_line_exit_2(capsys, host, problem, where):
    # It went into the vLLM command (--dry-run printed it; vLLM's server failed on it).
    argv = ["--host", host] if where == "flag" else ["--", "--host", host]
    code, out, err = _main(capsys, "serve", "org/target", "--dry-run", *argv)
    if where == "tail" and "\0" in host:  # refused first as no argument a program can get
        _assert_only_the_error(code, out, err, "serve", "is not a command-line argument")
        return
    _assert_only_the_error(code, out, err, "serve", problem)
    assert ("after --: --host" in err) == (where == "tail"), err


def test_a_server_host_is_refused_before_anything_starts(capsys, monkeypatch):
    _no_vllm(monkeypatch)
    code, out, err = _main(capsys, "serve", "org/target", "--host", "a b", "--port", "8123")
    _assert_only_the_error(code, out, err, "serve", "--host 'a b': the host contains spaces")


def test_plan_from_argv_refuses_a_bad_server_host():
    from kvslots.errors import ServeError
    from kvslots.serve.cli import plan_from_argv

    for host in ("a b", "", "a" * 254, "a\udc80b"):
        with pytest.raises(ServeError, match="--host"):
            plan_from_argv(["org/target", "--host", host])


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0", "localhost", "node-1.lan",
                                  "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61])
def test_server_hosts_that_may_name_an_address_pass(capsys, host):
    assert len(host) <= 253
    for argv in (["--host", host], ["--", "--host", host]):
        code, out, err = _main(capsys, "serve", "org/target", "--dry-run", "-q", *argv)
        assert code == 0 and err == "" and "--host" in out, (out, err)


def test_the_endpoint_host_rule_has_one_home():
    # The events endpoints and the server host give the same reason from one function.
    from kvslots.errors import InvalidArgumentError
    from kvslots.events.protocol import check_endpoint, host_problem

    assert host_problem("a b") == "the host contains spaces or control characters"
    assert host_problem("node-1.lan") is None
    with pytest.raises(InvalidArgumentError, match=host_problem("a b")):
        check_endpoint("tcp://a b:5557")


# ---- 3. speculative-config keys: vLLM's SpeculativeConfig fields and types -------------------


@pytest.fixture
def eagle_draft(tmp_path) -> str:
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["EagleLlamaForCausalLM"], "model_type": "eagle"}')
    return str(d)


def _spec(draft: str, **extra) -> str:
    import json

    return json.dumps({"method": "eagle", "model": draft, "num_speculative_tokens": 3, **extra})


@pytest.mark.parametrize("extra, field, problem", [
    ({"disable_eagle_block_drop": [1]}, "speculative_config.disable_eagle_block_drop",
     "Input should be a valid boolean (vLLM's SpeculativeConfig.disable_eagle_block_drop is bool), got [1]"),
    ({"disable_eagle_block_drop": 2}, "speculative_config.disable_eagle_block_drop", "valid boolean"),
    ({"enforce_eager": "maybe"}, "speculative_config.enforce_eager", "valid boolean"),
    ({"prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max", "greater than or equal to 1"),
    ({"max_model_len": -5}, "speculative_config.max_model_len", "greater than or equal to 1"),
    ({"draft_tensor_parallel_size": "two"}, "speculative_config.draft_tensor_parallel_size", "valid integer"),
    ({"revision": 5}, "speculative_config.revision", "valid string"),
    ({"suffix_decoding_max_spec_factor": "x"}, "speculative_config.suffix_decoding_max_spec_factor", "valid number"),
    ({"synthetic_acceptance_rates": [0.5, "x"]}, "speculative_config.synthetic_acceptance_rates[1]", "valid number"),
    ({"synthetic_acceptance_rates": {"a": 1}}, "speculative_config.synthetic_acceptance_rates", "valid list"),
    ({"kv_cache_dtype": "fp7"}, "speculative_config.kv_cache_dtype", "Input should be 'auto'"),
    ({"rejection_sample_method": "best"}, "speculative_config.rejection_sample_method", "'standard'"),
    ({"quantization": 3}, "speculative_config.quantization", "one of the types"),
    ({"disable_eagle_blok_drop": True}, "speculative_config.disable_eagle_blok_drop",
     "unexpected keyword argument: vLLM's SpeculativeConfig has no such field (did you mean disable_eagle_block_drop?)"),
    ({"no_such_key_at_all": 1}, "speculative_config.no_such_key_at_all", "unexpected keyword argument"),
])
@pytest.mark.parametrize("where", ["flag", "tail"])
def test_a_speculative_config_key_vllm_would_refuse_is_one_line_exit_2(capsys, eagle_draft, extra, field,
                                                                        problem, where):
    # Passed on unchecked: vLLM's SpeculativeConfig(**...) refused it once the server ran.
    fields = vllm_fields.dataclass_fields("vllm.config.speculative", "SpeculativeConfig") or {}
    rule = fields.get(field.split(".")[-1])
    if rule is not None and " str" in rule.annotation and problem.startswith("Input should be '"):
        pytest.skip(f"this vLLM takes any str as {rule.name} ({rule.annotation})")  # 0.33's kv_cache_dtype
    spec = _spec(eagle_draft, **extra)
    argv = ["--speculative-config", spec] if where == "flag" else ["--", "--speculative-config", spec]
    code, out, err = _main(capsys, "serve", "org/target", "--dry-run", *argv)
    _assert_only_the_error(code, out, err, "serve", problem)
    assert err.startswith(f"kvslots serve: error: {field}: "), err


def test_an_unknown_speculative_method_is_refused_with_vllms_list(capsys):
    code, out, err = _main(capsys, "serve", "org/target", "--dry-run", "--speculative-config",
                           '{"method": "eagle4", "num_speculative_tokens": 3}')
    _assert_only_the_error(code, out, err, "serve", "speculative_config.method: Input should be 'ngram', ")


def test_a_yaml_speculative_config_key_vllm_has_not_is_not_passed_on(tmp_path, capsys, eagle_draft):
    # The TRT-LLM YAML's own keys are converted; any other is listed and left out, never passed on.
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text(f"speculative_config:\n  decoding_type: Eagle\n  max_draft_len: 3\n"
                         f"  speculative_model_dir: {eagle_draft}\n  disable_eagle_block_drop: [1]\n")
    code, out, err = _main(capsys, "serve", "org/target", "--dry-run", "--extra-engine-args", str(yaml_file))
    assert code == 0 and "disable_eagle_block_drop" not in out, (out, err)
    assert "unknown: speculative_config.disable_eagle_block_drop" in err, err


@pytest.mark.parametrize("extra", [
    {}, {"disable_eagle_block_drop": True}, {"enforce_eager": None}, {"prompt_lookup_max": 3},
    {"quantization": "fp8"}, {"quantization": "my_own_method"}, {"kv_cache_dtype": "fp8"},
    {"draft_load_config": {"load_format": "auto"}},  # a class: left to vLLM
    {"attention_backend": "FLASH_ATTN"},  # a mode="before" validator: left to vLLM
    {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 1024, 1]]},
    {"synthetic_acceptance_rates": [0.5, 1]}, {"draft-tensor-parallel-size": 1},
])
def test_speculative_config_keys_vllm_takes_pass(capsys, eagle_draft, extra):
    code, out, err = _main(capsys, "serve", "org/target", "--dry-run", "-q", "--speculative-config",
                           _spec(eagle_draft, **extra))
    assert code == 0 and err == "" and "--speculative-config" in out, (out, err)


@pytest.mark.parametrize("given, read", [("false", False), ("no", False), (0, False), ("true", True), (1, True)])
def test_a_value_vllm_reads_as_a_boolean_is_given_to_it_as_one(capsys, eagle_draft, given, read):
    # vLLM (pydantic, lax) reads "false" as False; kvslots read the string as true (the indexer was
    # told eagle=true the wrong way round). Both now read vLLM's value, which the command carries.
    import json

    from kvslots.serve.cli import plan_from_argv

    plan = plan_from_argv(["org/target", "--speculative-config", _spec(eagle_draft, disable_eagle_block_drop=given)])
    assert plan.speculative_config["disable_eagle_block_drop"] is read
    i = plan.argv.index("--speculative-config")
    assert json.loads(plan.argv[i + 1])["disable_eagle_block_drop"] is read
    assert ("eagle=true" in (plan.indexer_worker() or "")) is (not read)


def test_the_shortcut_never_accepts_what_pydantic_refuses():
    # validate_field skips pydantic for a value exactly of the field's plain type; pydantic agrees.
    from kvslots.config.vllm_fields import _plainly_valid, _within, dataclass_fields

    fields = dataclass_fields("vllm.config.speculative", "SpeculativeConfig")
    if fields is None:
        pytest.skip("vLLM's source is not installed")
    values = [None, True, False, 0, 1, 3, -1, 2.5, "eagle", "fp8", "x", "", [1], {"a": 1}]
    for rule in fields.values():
        adapter = rule.adapter()
        if adapter is None:
            continue
        for v in values:
            if _plainly_valid(rule.kind, v) and _within(rule.bounds, v):
                adapter.validate_python(v)  # raises if the shortcut let through what pydantic refuses


def test_without_vllms_source_nothing_is_checked_here(monkeypatch, eagle_draft):
    from kvslots.config import speculative, vllm_fields

    monkeypatch.setattr(vllm_fields, "dataclass_fields", lambda *a: None)
    spec = speculative.resolve_speculative_config(None, {"method": "ngram", "num_speculative_tokens": 2, "x": 1})
    assert spec == {"method": "ngram", "num_speculative_tokens": 2, "x": 1}


def test_the_field_check_is_cheap(eagle_draft):
    # Read from vLLM's source, vLLM not imported; pydantic only for a value not plainly valid.
    import subprocess
    import sys

    code = ("import sys, time; from kvslots.config.speculative import check_vllm_fields; t = time.perf_counter(); "
            f"check_vllm_fields({{'method': 'eagle', 'model': {eagle_draft!r}, 'num_speculative_tokens': 3}}); "
            "print(time.perf_counter() - t, 'vllm' in sys.modules, 'pydantic' in sys.modules, "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1:] == ["False", "False", "False"], out
    assert float(out[0]) < 2.0, out  # ~0.05 s (parsing vllm/config/speculative.py); importing vLLM takes ~10 s


def test_a_key_that_is_not_text_is_a_config_error():
    from kvslots.config.speculative import resolve_speculative_config
    from kvslots.errors import ConfigError

    with pytest.raises(ConfigError, match="keys must be strings"):
        resolve_speculative_config(None, {1: 2, "method": "ngram", "num_speculative_tokens": 2})
