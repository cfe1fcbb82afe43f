"""Hostile `kvslots serve` / `kvslots convert-config` input, without -q: an error is the only
line on stderr (`kvslots <cmd>: error: ...`, exit status 2) -- no note, warning or vLLM command
printed before it, nothing started."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvslots import cli


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


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


# ---- 1. every check before the first note or the vLLM command -------------------------------


def test_serve_address_error_comes_before_any_note_or_the_command(capsys, monkeypatch, busy_port):
    # org/target (a Hub id) and the KV connector give notes; the address check came after them
    # and after the vLLM command was printed on stdout.
    _no_vllm(monkeypatch)
    for argv in (["--host", "no-such-host.invalid"], ["--host", "127.0.0.1", "--port", str(busy_port)],
                 ["--host", "127.0.0.1", "--", "--port", str(busy_port)]):
        code, out, err = _main(capsys, "serve", "org/target", *argv)
        _assert_only_the_error(code, out, err, "serve", "cannot ")


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
