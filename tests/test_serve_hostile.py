"""`kvslots serve --dry-run` with hostile KV-events endpoints (what test_serve.py leaves out): an
endpoint the publisher's own rule refuses, and a replay endpoint that binds the events
endpoint's address (for some data-parallel rank), are one line and exit status 2 before vLLM
starts -- not vLLM's ZMQ error once the engine is loaded."""

from __future__ import annotations

import json
import os
import sys

import pytest

from kvslots import cli


def _serve(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["serve", "org/target", "--dry-run", "-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flag", ["--kv-events-endpoint", "--kv-events-replay-endpoint"])
@pytest.mark.parametrize("endpoint", ["pgm://h:1", "epgm://h:1", "udp://h:1", "http://h:1", "TCP://h:1",
                                      " tcp://*:5557"])
def test_endpoint_the_publisher_refuses_is_one_line_exit_2(capsys, flag, endpoint):
    code, out, err = _serve(capsys, flag, endpoint)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvslots serve: error: {flag} "), err


@pytest.mark.parametrize("argv", [
    ["--kv-events-replay-endpoint", "tcp://127.0.0.1:5557"],  # the default events endpoint's
    ["--kv-events-endpoint", "tcp://*:6000", "--kv-events-replay-endpoint", "tcp://127.0.0.1:6000"],
    ["--kv-events-endpoint", "tcp://[::ffff:127.0.0.1]:6000", "--kv-events-replay-endpoint", "tcp://*:6000"],
    ["--kv-events-endpoint", "ipc:///tmp/kv.sock", "--kv-events-replay-endpoint", "ipc:///tmp/kv.sock"],
    ["--kv-events-endpoint", "tcp://*:6000", "--kv-events-replay-endpoint", "tcp://*:6001",
     "--", "--data-parallel-size", "2"],  # rank 1's events port is rank 0's replay port
    ["--kv-events-endpoint", "tcp://*:6001", "--kv-events-replay-endpoint", "tcp://*:6000",
     "--", "--data-parallel-size", "2"],
    ["--", "--kv-events-config", '{"endpoint": "tcp://*:7000", "replay_endpoint": "tcp://*:7000"}'],
])
def test_replay_endpoint_binding_the_events_address_is_one_line_exit_2(capsys, argv):
    code, out, err = _serve(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "bind the same address" in err, err


@pytest.mark.parametrize("argv", [
    [],
    ["--kv-events-endpoint", "tcp://*:6000", "--kv-events-replay-endpoint", "tcp://*:6001"],
    ["--kv-events-endpoint", "tcp://*:6000", "--kv-events-replay-endpoint", "tcp://*:6002",
     "--", "--data-parallel-size", "2"],
    ["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0"],  # the OS picks each
    ["--kv-events-endpoint", "tcp://10.0.0.1:6000", "--kv-events-replay-endpoint", "tcp://127.0.0.1:6000"],
    ["--kv-events-endpoint", "tcp://127.0.0.1:6000", "--kv-events-replay-endpoint", "tcp://127.0.0.1:6000"],
    ["--kv-events-endpoint", "ipc:///tmp/kv.sock", "--kv-events-replay-endpoint", "ipc:///tmp/kv-replay.sock"],
])
def test_distinct_endpoints_still_pass(capsys, argv):
    # (tcp://127.0.0.1:6000 twice: vLLM's publisher connects to it, only the replay socket binds.)
    code, out, err = _serve(capsys, *argv)
    assert code == 0 and "--kv-events-config" in out, err


@pytest.mark.parametrize("config, problem", [
    ('{"endpoint": 5}', "endpoint must be a str"),
    ('{"endpoint": "pgm://h:1"}', "must start with tcp://"),
    ('{"replay_endpoint": "tcp://h:99999"}', "port 99999 is past 65535"),
    ('{"replay_endpoint": "udp://h:1"}', "must start with tcp://"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false"),
    ('{"topic": 5}', "topic must be a string"),
    ('{"publisher": null}', "publisher must be a string"),
])
def test_kv_events_config_after_dashes_gets_the_flags_checks(capsys, config, problem):
    # Passed on to vLLM unchecked: its publisher failed once the engine was loaded.
    code, out, err = _serve(capsys, "--", "--kv-events-config", config)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvslots serve: error: after --: --kv-events-config: ") and problem in err, err


@pytest.mark.parametrize("argv, problem", [
    (["--", "--kv-transfer-config", '{"kv_connector_extra_config": []}'], "must be a JSON object"),  # was dropped
    (["--", "--kv-transfer-config", '{"kv_connector_extra_config": ""}'], "must be a JSON object"),
    (["--", "--kv-transfer-config", '{"kv_connector_extra_config": 0}'], "must be a JSON object"),
    (["--", "--kv-transfer-config", '{"kv_role": 5}'], "kv_role 5 is not one of"),
    (["--", "--kv-transfer-config", '{"kv_role": "producer"}'], "is not one of"),
    (["--role", "prefill", "--", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'], "conflicts with --role prefill"),
    (["--role", "decode", "--", "--kv-transfer-config", '{"kv_role": "kv_both"}'], "conflicts with --role decode"),
    (["--is-prefill-worker", "--", "--kv-transfer-config", '{"kv_role": "kv_both"}'], "conflicts with --role prefill"),
])
def test_kv_transfer_config_after_dashes_is_checked(capsys, argv, problem):
    code, out, err = _serve(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and problem in err, err


@pytest.mark.parametrize("argv", [
    ["--", "--kv-events-config", '{"topic": "kv", "endpoint": "tcp://*:6000", "enable_kv_cache_events": true}'],
    ["--", "--kv-transfer-config", '{"kv_connector_extra_config": {}, "kv_role": "kv_both"}'],
    ["--", "--kv-transfer-config", '{"kv_connector_extra_config": null}'],
    ["--role", "prefill", "--", "--kv-transfer-config", '{"kv_role": "kv_producer"}'],
])
def test_good_configs_after_dashes_pass(capsys, argv):
    code, out, err = _serve(capsys, *argv)
    assert code == 0, err


# ---- the Python API: kvslots.serve's public calls ----

from kvslots.errors import ServeError  # noqa: E402
from kvslots.serve import build_plan, plan_from_argv, scan_vllm_args, supervise  # noqa: E402


@pytest.mark.parametrize("argv", ["org/target", None, 5, [5], ["org/target", None], ["org/target\0"]])
def test_plan_from_argv_needs_a_list_of_arguments(argv):
    with pytest.raises(ServeError):  # a str was parsed character by character; None, ints: TypeError
        plan_from_argv(argv)


@pytest.mark.parametrize("argv, kwargs", [
    (["org/target", "--port", "x"], {}), (["org/target", "--bogus"], {}), (["--help"], {}), (["-h"], {}), ([], {}),
    (["org/target", "--role", "nope"], {}), (["org/target", "--x\ny"], {}),
    (["org/target"], {"python": 5}), (["org/target"], {"python": "py\0"}), (["org/target"], {"python": ""}),
])
def test_plan_from_argv_argument_errors_are_serve_errors(capsys, argv, kwargs):
    # An argument error was argparse's: a line on stderr and SystemExit (--help: the help, exit 0).
    capsys.readouterr()
    with pytest.raises(ServeError) as ei:
        plan_from_argv(argv, **kwargs)
    assert "\n" not in str(ei.value)
    assert capsys.readouterr() == ("", "")
    assert plan_from_argv(["org/target"], python="/py").argv[0] == "/py"


@pytest.mark.parametrize("tail", ["--x", None, 5, [5], ["--max-model-len", "1\0"], [b"--x"]])
def test_scan_vllm_args_needs_a_list_of_arguments(tail):
    with pytest.raises(ServeError):  # AttributeError / TypeError
        scan_vllm_args(tail)


@pytest.mark.parametrize("argv, kwargs", [
    ([], {}), ("/bin/true", {}), ([5], {}), (["/bin/true\0"], {}), (None, {}),  # IndexError, TypeError, ValueError
    (["/bin/true"], {"grace": float("nan")}), (["/bin/true"], {"grace": "15"}), (["/bin/true"], {"grace": 0}),
    (["/bin/true"], {"grace": float("inf")}), (["/bin/true"], {"env": {"A": 5}}), (["/bin/true"], {"env": {"A": "a\0"}}),
    (["/bin/true"], {"env": {"A=B": "1"}}), (["/bin/true"], {"env": {"": "1"}}), (["/bin/true"], {"env": [("A", "1")]}),
])
def test_supervise_refuses_what_it_cannot_run_before_starting_anything(argv, kwargs):
    import signal

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(ServeError):
        supervise(argv, **kwargs)
    assert signal.getsignal(signal.SIGINT) is before  # no handler left behind


def _is_subreaper() -> bool:
    import ctypes

    flag = ctypes.c_int(-1)
    assert ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


def test_supervise_and_build_plan_good_and_bad_calls():
    before = _is_subreaper() if sys.platform.startswith("linux") else None
    assert supervise(("/bin/sh", "-c", "exit 3"), env={"A": "1"}, grace=0.5, log=lambda m: None) == 3
    # The subreaper flag is process-wide: left on, this process would adopt every later orphan
    # and never reap it (a test's grandchild stayed a zombie).
    assert before is None or _is_subreaper() == before
    with pytest.raises(ServeError):
        build_plan(None)
    with pytest.raises(ServeError):
        build_plan({"model": "org/target"})


@pytest.mark.parametrize("argv", [["--disk-path", "/etc/passwd"], ["--disk-path", "/dev/null"],
                                  ["--connector-config", '{"disk_path": "/etc/hostname"}'],
                                  ["--", "--kv-transfer-config", '{"kv_connector_extra_config": {"disk_path": "/dev/null"}}']])
def test_disk_path_that_is_not_a_directory_is_one_line_exit_2(capsys, argv):
    # The connector refused it only once vLLM had started.
    code, out, err = _serve(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "not a directory" in err, err


def test_disk_path_directory_or_not_yet_made_passes(capsys, tmp_path):
    for path in (str(tmp_path), str(tmp_path / "new")):
        code, out, err = _serve(capsys, "--disk-path", path)
        assert code == 0, err


@pytest.mark.parametrize(("config", "problem"), [
    ("[1]", "must be a JSON object"),
    ('{"model_type": NaN}', "finite number"),
    ('{"a": 1, "a": 2}', "duplicate key"),
    ("fifo", "config.json"),
])
def test_a_draft_directory_whose_config_json_cannot_be_read_is_one_line_exit_2(capsys, tmp_path, config, problem):
    # vLLM reads it when the engine starts: it failed there, after kvslots serve had started it.
    draft = tmp_path / "draft"
    draft.mkdir()
    if config == "fifo":
        os.mkfifo(draft / "config.json")
    elif config is not None:
        (draft / "config.json").write_text(config)
    spec = json.dumps({"method": "eagle", "model": str(draft), "num_speculative_tokens": 3})
    code, out, err = _serve(capsys, "--speculative-config", spec)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "speculative_config.model" in err and problem in err, err
    (draft / "config.json").unlink(missing_ok=True)
    (draft / "config.json").write_text('{"model_type": "eagle"}')
    code, out, err = _serve(capsys, "--speculative-config", spec)
    assert code == 0, err


@pytest.fixture
def busy_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _serve_for_real(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    """`kvslots serve` without --dry-run, where vLLM must never be started."""
    from kvslots.serve import cli as serve_cli

    def no_vllm(*a, **k):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(serve_cli, "supervise", no_vllm)
    capsys.readouterr()
    code = cli.main(["serve", "org/target", "-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_port_in_use_is_one_line_exit_2_before_vllm_starts(capsys, monkeypatch, busy_port):
    for argv in (["--port", str(busy_port)], ["--", "--port", str(busy_port)]):
        code, _, err = _serve_for_real(capsys, monkeypatch, "--host", "127.0.0.1", *argv)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("kvslots serve: error: ") and f"cannot listen on 127.0.0.1:{busy_port}" in err, err


@pytest.mark.parametrize("host", ["no-such-host.invalid", "300.1.1.1"])  # "a b": test_cli_hostile_serve
def test_a_host_that_does_not_resolve_is_one_line_exit_2_before_vllm_starts(capsys, monkeypatch, host):
    code, _, err = _serve_for_real(capsys, monkeypatch, "--host", host, "--port", "8123")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("kvslots serve: error: ") and "cannot resolve it" in err, err


def test_dry_run_does_not_check_the_address(capsys, busy_port):
    code, out, _ = _serve(capsys, "--port", str(busy_port))
    assert code == 0 and f"--port {busy_port}" in out


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "", "99999999999999999999"])
def test_a_data_parallel_size_vllm_would_refuse_is_one_line_exit_2(capsys, value):
    code, out, err = _serve(capsys, "--", "--data-parallel-size", value)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--data-parallel-size" in err and "not an integer in [1, 65535]" in err, err


def test_a_good_data_parallel_size_after_the_separator_passes(capsys):
    code, out, _ = _serve(capsys, "--", "-dp", "2")
    assert code == 0 and "-dp 2" in out


@pytest.mark.parametrize("argv", [["-tp", "x"], ["-tp", str(2**64)], ["--tensor-parallel-size=0"],
                                  ["--pipeline-parallel-size", "-1"], ["-pp", "1e3"], ["-tp"]])
def test_a_parallel_size_vllm_would_refuse_is_one_line_exit_2(capsys, argv):
    # With the connector on CPU it sizes VLLM_CPU_NUM_OF_RESERVED_CPU (2**64 went into it).
    code, out, err = _serve(capsys, "--", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "parallel-size" in err and "integer in [1, 65535]" in err, err


def test_good_parallel_sizes_after_the_separator_pass(capsys):
    code, out, _ = _serve(capsys, "--", "-tp", "2", "--pipeline-parallel-size=2")
    assert code == 0 and "-tp 2" in out


@pytest.mark.parametrize("yaml_text, key", [
    ("tensor_parallel_size: 9223372036854775807\npipeline_parallel_size: 9223372036854775807\n", "tensor_parallel_size"),
    ("pipeline_parallel_size: 65536\n", "pipeline_parallel_size"),
    ("tensor_parallel_size: 65536\nenable_attention_dp: true\n", "tensor_parallel_size"),  # would be the DP size
])
def test_a_yaml_parallel_size_past_the_tails_bound_is_one_line_exit_2(tmp_path, capsys, yaml_text, key):
    # The same bound as after --: the YAML's sizes were taken as given (2**63-1 twice made
    # VLLM_CPU_NUM_OF_RESERVED_CPU a 38-digit number, printed and passed to vLLM).
    f = tmp_path / "engine.yaml"
    f.write_text(yaml_text)
    code, out, err = _serve(capsys, "--extra-engine-args", str(f))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{key}: must be <= 65535" in err, err
    f.write_text("tensor_parallel_size: 65535\npipeline_parallel_size: 2\n")
    code, out, _ = _serve(capsys, "--extra-engine-args", str(f))
    assert code == 0 and "--tensor-parallel-size 65535" in out


@pytest.mark.parametrize("arg", ["--x\ny", "--x\x1b[2J"])
def test_an_unknown_option_with_control_characters_is_one_line(capsys, arg):
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:  # the newline was printed as given: two lines
        cli.main(["serve", "org/target", "--dry-run", arg])
    out, err = capsys.readouterr()
    assert ei.value.code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvslots serve: error: ") and ("\\n" in err or "\\x1b" in err), err


@pytest.mark.parametrize("argv", [["--host-cache-gb", "1e-300"], ["--host-cache-gb", "5e-324"],
                                  ["--disk-path", "/nonexistent/kv", "--disk-gb", "1e-300"],
                                  ["--connector-config", '{"host_cache_gb": 1e-10}'],
                                  ["--", "--kv-transfer-config", '{"kv_connector_extra_config": {"host_cache_gb": 1e-300}}']])
def test_a_tier_smaller_than_a_byte_is_one_line_exit_2_before_vllm_starts(capsys, argv):
    # It holds no block of any model; the engine refused it only once vLLM had loaded.
    code, out, err = _serve(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "holds no block" in err, err
    code, out, err = _serve(capsys, "--host-cache-gb", "1e-9")  # a byte or more: the engine decides
    assert code == 0, err


@pytest.mark.parametrize("content, problem", [
    ("", "invalid JSON"), (b"\0" * 64, "invalid JSON"), ("null", "must be a JSON object"),
    ('{"a": 1, "a": 2}', "duplicate key 'a'"), ('{"x": NaN}', "must be a finite number"),
    ("[" * 100_000 + "]" * 100_000, "nested more than"), (b"\xff{}", "not UTF-8"),
    # A speculators checkpoint kvslots cannot read was served as a target model.
    ('{"speculators_model_type": "eagle3", "transformer_layer_config": {}, "speculators_config": '
     '{"proposal_methods": [{"speculative_tokens": 1e309}], "verifier": {"name_or_path": "org/t"}}}', "finite"),
    ('{"speculators_model_type": "eagle3", "transformer_layer_config": {}, "speculators_config": '
     '{"proposal_methods": [{"speculative_tokens": 9223372036854775808}], "verifier": {"name_or_path": "org/t"}}}',
     "signed 64-bit"),
])
def test_a_model_config_json_it_cannot_read_is_one_line_exit_2(tmp_path, capsys, content, problem):
    model = tmp_path / "m"
    model.mkdir()
    cfg = model / "config.json"
    cfg.write_bytes(content if isinstance(content, bytes) else content.encode())
    capsys.readouterr()
    code = cli.main(["serve", str(model), "--dry-run", "-q"])  # was served as a target model
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvslots serve: error: {cfg}: ") and problem in err, err


@pytest.mark.parametrize("argv, where", [
    (["--kv-events-topic", "\udcff"], "--kv-events-topic"),  # bytes of argv that are not UTF-8
    (["--", "--kv-events-config.topic", "k\udcffv"], "after --: --kv-events-config: topic"),
])
def test_an_events_topic_that_is_not_unicode_is_one_line_exit_2(capsys, argv, where):
    # Written into the JSON as "\udcff": vLLM's publisher could not encode it once the engine was loaded.
    code, out, err = _serve(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kvslots serve: error: {where} must be valid Unicode text"), err
    code, out, err = _serve(capsys, "--kv-events-topic", "k\u00e9v")
    assert code == 0 and ('"topic":"k\\u00e9v"' in out or '"topic":"k\u00e9v"' in out), out


@pytest.mark.parametrize("port", ["99999", "-1", "0", str(2**64)])
def test_a_port_after_the_separator_out_of_range_is_one_line_exit_2(capsys, monkeypatch, port):
    # 2**64 was check_listen's OverflowError traceback; 99999 and 0 started vLLM.
    for run in (_serve, lambda capsys, *a: _serve_for_real(capsys, monkeypatch, *a)):
        code, out, err = run(capsys, "--", "--port", port)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err == f"kvslots serve: error: after --: --port {port!r} is not a port number in 1..65535\n", err


@pytest.mark.parametrize("port", [99999, -1, 2**64, "80", True, None])
def test_check_listen_refuses_what_is_not_a_port(port):
    from kvslots._listen import check_listen
    from kvslots.errors import ConfigError

    with pytest.raises(ConfigError, match="not a port number in 0..65535"):  # 2**64: OverflowError; 99999 passed
        check_listen("127.0.0.1", port)


def test_a_yaml_host_cache_size_too_large_names_the_yaml_key(capsys, tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(f"kv_cache_config: {{host_cache_size: {2**63 - 1}}}\n")
    code, out, err = _serve(capsys, "--extra-engine-args", str(f))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    # It named only kv_connector_extra_config.host_cache_gb, a key the user never wrote.
    assert "from the YAML's kv_cache_config.host_cache_size, 9223372036854775807 bytes" in err, err


def test_supervise_from_another_thread_is_a_serve_error_and_starts_nothing(tmp_path):
    import signal
    import threading

    marker = tmp_path / "ran"
    got: list[BaseException] = []

    def call():
        try:
            supervise(["/bin/sh", "-c", f"touch {marker}"], grace=0.5, log=lambda m: None)
        except BaseException as e:  # noqa: BLE001 - what it raised is the test
            got.append(e)

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=call)
    t.start()
    t.join(timeout=30)
    assert len(got) == 1 and isinstance(got[0], ServeError), got  # signal.signal's ValueError
    assert "main thread" in str(got[0]) and not marker.exists()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("kind, problem", [("fifo", "not a regular file (a FIFO)"), ("dir", "is a directory"),
                                           ("loop", "Too many levels of symbolic links"), ("dangling", "no such file")])
def test_a_config_json_that_is_no_file_is_named_as_such(tmp_path, capsys, kind, problem):
    import os
    import re

    from kvslots.config.speculators import load_speculators_checkpoint
    from kvslots.errors import ConfigError

    model = tmp_path / "m"
    model.mkdir()
    cfg = model / "config.json"
    {"fifo": lambda: os.mkfifo(cfg), "dir": cfg.mkdir, "loop": lambda: cfg.symlink_to(cfg),
     "dangling": lambda: cfg.symlink_to(tmp_path / "nowhere")}[kind]()
    capsys.readouterr()
    assert cli.main(["serve", str(model), "--dry-run", "-q"]) == 2  # was "has no config.json"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvslots serve: error: {cfg}: ") and problem in err, err
    with pytest.raises(ConfigError, match=re.escape(problem)) as ei:  # was "no config.json in the ... directory"
        load_speculators_checkpoint(str(model))
    assert ei.value.source == str(cfg)


def test_home_relative_models_are_given_to_vllm_expanded(tmp_path, monkeypatch, capsys):
    # MODEL ~/target, a YAML's ~/draft and --speculative-config's model ~/draft were found here
    # with ~ expanded and passed on as written; vLLM and Hugging Face refuse "~/target" as a Hub id.
    import json
    import shlex

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    yaml_file = tmp_path / "e.yaml"
    yaml_file.write_text("speculative_config:\n  decoding_type: Eagle3\n  speculative_model_dir: ~/draft\n"
                         "  max_draft_len: 3\n")
    explicit = '{"method": "eagle3", "model": "~/draft", "num_speculative_tokens": 3}'
    for extra in (["--extra-engine-args", str(yaml_file)], ["--speculative-config", explicit]):
        capsys.readouterr()
        code = cli.main(["serve", "~/target", "--dry-run", "-q", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        argv = shlex.split(out.splitlines()[-1])
        assert argv[argv.index("--model") + 1] == str(tmp_path / "target")
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec["model"] == str(tmp_path / "draft")



@pytest.mark.parametrize("when, why", [("at start", "stdout is closed"), ("later", "Bad file descriptor")])
def test_dry_run_with_stdout_closed_is_one_line_exit_2(when, why):
    # The command is a dry run's whole output. stdout closed at start (>&-): the final flush of a
    # None stdout was an AttributeError traceback, exit status 1; closed later: an EBADF traceback.
    import subprocess

    argv = ["serve", "org/target", "--dry-run", "-q"]
    if when == "at start":
        cmd = ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "kvslots", *argv]
    else:
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.close(1); sys.argv = ['kvslots', *sys.argv[1:]]; "
               "runpy.run_module('kvslots', run_name='__main__')", *argv]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"kvslots serve: error: cannot write the output: {why}\n", \
        proc.stderr


@pytest.mark.parametrize("yaml_text, what", [
    # Within the file limits: a 200 KB --hf-overrides argument, a 180 KB environment variable.
    ("model_kwargs: {x: " + "d" * 200_000 + "}\n", "argument of --hf-overrides is"),
    ("pp_partition: [" + ",".join([str(2**62)] * 9000) + "]\n", "environment variable VLLM_PP_LAYER_PARTITION is"),
])
def test_a_command_string_longer_than_execve_takes_is_one_line_exit_2(tmp_path, capsys, yaml_text, what):
    # Planned and printed by --dry-run; a real run failed only to start vLLM ('Argument list too
    # long', exit status 127).
    f = tmp_path / "e.yaml"
    f.write_text(yaml_text)
    code, out, err = _serve(capsys, "--extra-engine-args", str(f))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"kvslots serve: error: the vLLM command's {what} " in err and "at most 131072" in err, err
    f.write_text("pp_partition: [" + ",".join(["1"] * 1000) + "]\n")  # long, but within the limit
    assert _serve(capsys, "--extra-engine-args", str(f))[0] == 0


@pytest.mark.parametrize("where", ["build_plan", "check_listen"])
def test_ctrl_c_before_vllm_starts_is_one_line_and_status_130(capsys, monkeypatch, where):
    # A Ctrl-C while the plan was built or the address checked (a slow config, a host name to
    # resolve) was a KeyboardInterrupt traceback: supervise's handlers were not in place yet.
    from kvslots.serve import cli as serve_cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, where, interrupted)
    try:
        code, out, err = _serve_for_real(capsys, monkeypatch, "--port", "8123")
    except KeyboardInterrupt:  # caught here: escaping, it would stop the whole test session
        pytest.fail("the KeyboardInterrupt escaped kvslots serve (a traceback)")
    assert code == 130, (code, err)
    assert err == "kvslots serve: interrupted before vLLM started\n", err
    assert out == ""  # the command is printed only once every check passed


def _serve_in_a_child(patches: str, timeout: float):
    """``kvslots serve org/target`` in an interpreter of its own, after ``patches`` (source that
    replaces parts of ``serve_cli``, with os, signal, sys and time imported) ran there."""
    import os
    import subprocess

    script = (
        "import os, signal, sys, time\n"
        # A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored
        # (the CI rehearsal ran so): give the child a terminal's Ctrl-C.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from kvslots import cli\n"
        "from kvslots.serve import cli as serve_cli\n"
        + patches +
        "sys.exit(cli.main(['serve', 'org/target', '-q', '--port', '8123']))\n")
    root = os.path.join(os.path.dirname(__file__), "..", "python")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_real_sigint_before_vllm_starts_leaves_no_traceback(tmp_path):
    # The signal itself, in a process of its own: the resolver (check_listen) is where it lands.
    proc = _serve_in_a_child(
        "def slow_resolver(*a):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
        "serve_cli.check_listen = slow_resolver\n"
        "serve_cli.supervise = lambda *a, **k: sys.exit('vLLM was started')\n", timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "kvslots serve: interrupted before vLLM started\n", proc.stderr


@pytest.mark.parametrize("argv", [["org/t", "--host", "\ud800"], ["org/t", "--", "--foo", "\ud800"],
                                  ["org/t", "--", "--scheduler-cls", "a\udfff"], ["org/\ud800"]])
def test_plan_from_argv_refuses_a_lone_surrogate_no_program_can_get(argv):
    # Only U+DC80..U+DCFF stand for bytes of a command line (os.fsencode); '\ud800' was a
    # UnicodeEncodeError from the plan's size check (or, run, from Popen).
    with pytest.raises(ServeError, match="lone surrogates"):
        plan_from_argv(argv)


def test_build_plan_refuses_a_lone_surrogate_in_a_flag_value():
    from kvslots.errors import KVSlotsError
    from kvslots.serve import make_parser

    args = make_parser().parse_args(["org/t", "--dry-run"])
    args.host = "\ud800"  # a caller's own Namespace: no argv check before the plan
    with pytest.raises(KVSlotsError, match="lone surrogate"):
        build_plan(args)


@pytest.mark.parametrize("attr, value", [
    ("kv_events_endpoint", 5), ("kv_events_replay_endpoint", 5),  # a TypeError / AttributeError
    ("vllm_args", "--enforce-eager"),  # was one vLLM argument per character
    ("port", "x"), ("port", 10**6), ("port", True), ("host", 5), ("host_cache_gb", float("nan")),
    ("role", "x"), ("no_connector", "yes"), ("model", None), ("grace_period", -1.0),
])
def test_build_plan_checks_a_callers_namespace_as_the_parser_would(attr, value):
    from kvslots.serve import make_parser

    args = make_parser().parse_args(["org/t"])
    setattr(args, attr, value)
    before = dict(vars(args))
    with pytest.raises(ServeError, match=f"args.{attr}"):
        build_plan(args)
    assert vars(args) == before  # nothing changed


def test_build_plan_fills_in_what_a_callers_namespace_leaves_out():
    import argparse
    import pathlib

    plan = build_plan(argparse.Namespace(model="org/t"))  # no vllm_args: was an AttributeError
    assert plan.model == "org/t" and plan.port == 8000 and plan.slot_manager == "kvslots"
    plan = build_plan(argparse.Namespace(model="org/t", port="8123", host_cache_gb=2, vllm_args=("--enforce-eager",)))
    assert plan.port == 8123 and plan.kv_transfer_config["kv_connector_extra_config"]["host_cache_gb"] == 2.0
    assert plan.tail == ["--enforce-eager"]
    with pytest.raises(ServeError, match="args has no model"):
        build_plan(argparse.Namespace(port=1))
    assert build_plan(argparse.Namespace(model=pathlib.PurePath("org/t"))).model == "org/t"


@pytest.mark.parametrize("argv, env", [(["/bin/true", "\ud800"], None), (["/bin/true"], {"A": "\ud800"}),
                                       (["/bin/true"], {"\udbff": "1"})])
def test_supervise_refuses_a_lone_surrogate_before_starting_anything(argv, env):
    import signal

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(ServeError, match="lone surrogates"):  # was Popen's UnicodeEncodeError
        supervise(argv, env=env, grace=1, log=lambda m: None)
    assert signal.getsignal(signal.SIGINT) is before


def test_surrogate_escaped_bytes_of_a_command_line_still_pass():
    # '\udcff' is the byte 0xff of a command line that is not UTF-8: the OS takes it as given.
    plan = plan_from_argv(["org/t", "--", "--x", "\udcff"])
    assert plan.argv[-1] == "\udcff"
    assert supervise(["/bin/sh", "-c", "exit 0", "\udcff"], env={"A": "\udcfe"}, grace=1, log=lambda m: None) == 0


_LEAVES_A_STUBBORN_CHILD = r"""
import os, subprocess, sys
kid = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {kid.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
"""


def test_ctrl_c_while_waiting_for_leftover_processes_moves_on(tmp_path):
    import os
    import signal
    import subprocess
    import time

    # vLLM exits at once and leaves a process in its group that ignores SIGINT and SIGTERM.
    # supervise waits the grace period for it before SIGTERM, then again before SIGKILL; a
    # Ctrl-C meanwhile was recorded and ignored, so with a long grace period kvslots serve
    # could not be stopped short of SIGKILL. Now each signal moves to the next step.
    leader = tmp_path / "leader.py"
    leader.write_text(_LEAVES_A_STUBBORN_CHILD)
    ready = tmp_path / "ready"
    code = (f"import sys; from kvslots.serve import supervise; "
            f"sys.exit(supervise([sys.executable, {str(leader)!r}, {str(ready)!r}], grace=1000))")
    root = os.path.join(os.path.dirname(__file__), "..", "python")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    sup = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert sup.poll() is None and time.monotonic() < deadline, "the leader never got going"
        time.sleep(0.05)
    pgid, kid = (int(x) for x in ready.read_text().split())
    try:
        time.sleep(0.5)  # the leader has exited: supervise waits for the rest of its group
        # Each Ctrl-C is one step (SIGTERM now, then SIGKILL now); a few more than needed, in case
        # the first came while the leader was still exiting (then it was forwarded to the group).
        for _ in range(6):
            if sup.poll() is not None:
                break
            sup.send_signal(signal.SIGINT)
            time.sleep(0.5)
        try:
            _, err = sup.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("supervise still waits for the leftover process after six Ctrl-C (grace=1000)")
        assert "SIGKILL" in err, err
        assert not os.path.exists(f"/proc/{kid}") or open(f"/proc/{kid}/stat").read().split()[2] == "Z"
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if sup.poll() is None:
            sup.kill()
            sup.wait()


@pytest.mark.parametrize("host, problem", [
    ("*", "is a wildcard"), ("0.0.0.0", "is a wildcard"), ("::", "is a wildcard"),
    ("::1", "is an IPv6 address"), ("[fe80::1]", "is an IPv6 address"),
    ("", "1 to 253 characters"), (" ", "without a scheme, port or spaces"), ("a b", "without a scheme"),
    ("a\0b", "without a scheme"), ("tcp://10.0.0.5", "without a scheme"), ("10.0.0.5:9000", "without a scheme"),
    ("node-1.lan/x", "without a scheme"), ("*.lan", "without a scheme"), ("a" * 254, "1 to 253 characters"),
])
def test_a_pd_host_that_is_no_address_peers_reach_is_one_line_exit_2(capsys, host, problem):
    # '*' (and 0.0.0.0) passed: the prefill worker then advertised a wildcard to decode workers,
    # which failed only once a request was pulled.
    code, out, err = _serve(capsys, "--role", "prefill", "--pd-host", host)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvslots serve: error: kv_connector_extra_config.pd_host (--pd-host) ") and problem in err, err
    # The same key from --connector-config, and with it after --, gets the same rule.
    code, out, err = _serve(capsys, "--role", "decode", "--connector-config", json.dumps({"pd_host": host}))
    assert code == 2 and problem in err and err.count("\n") == 1, err
    code, out, err = _serve(capsys, "--role", "decode", "--", "--kv-transfer-config",
                            json.dumps({"kv_connector_extra_config": {"pd_host": host}}))
    assert code == 2 and problem in err and err.count("\n") == 1, err


@pytest.mark.parametrize("host", ["localhost", "10.0.0.5", "192.168.1.20", "node-1.lan", "node-1.lan.", "kv_pd_0",
                                  "a" * 63 + ".example"])
def test_pd_hosts_that_peers_can_reach_pass(capsys, host):
    for role in ("prefill", "decode"):
        code, out, err = _serve(capsys, "--role", role, "--pd-host", host)
        assert code == 0 and err == "", err
        assert json.dumps(host) in out or host in out, out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_after_vllm_exited_leaves_the_servers_exit_status(sig):
    # One more Ctrl-C (or a SIGTERM from a process manager) that came once vLLM had exited met
    # the handlers supervise had put back: SIGTERM and SIGHUP ended kvslots serve by the signal,
    # SIGINT was "interrupted before vLLM started" (or a traceback). The status is the server's.
    proc = _serve_in_a_child(
        "real = serve_cli.supervise\n"
        "def vllm_then_signals(argv, **kw):\n"
        "    status = real(['/bin/sh', '-c', 'exit 3'], **kw)  # vLLM has exited with status 3\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "    time.sleep(0.5)\n"
        "    return status\n"
        "serve_cli.check_listen = lambda *a: None\n"
        "serve_cli.supervise = vllm_then_signals\n", timeout=60)
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert proc.stderr == "kvslots serve: vLLM exited with status 3\n", proc.stderr


def test_supervise_puts_the_callers_handlers_back_unless_told_not_to():
    import signal

    def mine(signum, frame):
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        assert supervise(["/bin/sh", "-c", "exit 0"], grace=1, log=lambda m: None) == 0
        assert all(signal.getsignal(s) is mine for s in before)
        assert supervise(["/bin/sh", "-c", "exit 0"], grace=1, log=lambda m: None, restore_signals=False) == 0
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in before)
        with pytest.raises(ServeError, match="restore_signals must be a bool"):
            supervise(["/bin/sh", "-c", "exit 0"], grace=1, log=lambda m: None, restore_signals=0)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
