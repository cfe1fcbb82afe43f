"""`kvslots serve --dry-run` with hostile KV-events endpoints (what test_serve.py leaves out): an
endpoint the publisher's own rule refuses, and a replay endpoint that binds the events
endpoint's address (for some data-parallel rank), are one line and exit status 2 before vLLM
starts -- not vLLM's ZMQ error once the engine is loaded."""

from __future__ import annotations

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
