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
