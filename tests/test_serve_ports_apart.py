"""``kvslots serve`` refuses a plan whose own sockets share a TCP port: the HTTP server, the P/D
control socket and the KV events sockets of every data-parallel rank are bound by one vLLM, and
two listening sockets on one address and port (or one on the wildcard) cannot both bind. Each
address alone was free, so every check passed and the second bind failed inside vLLM
(EADDRINUSE, a traceback once the model was loaded)."""

from __future__ import annotations

import pytest

from kvslots import cli
from kvslots.errors import ServeError
from kvslots.serve.cli import plan_from_argv


@pytest.mark.parametrize("argv, port, what", [
    (["--port", "5557"], 5557, "--port and the KV events endpoints"),  # the default events endpoint
    (["--port", "5558"], 5558, "--port and the KV events endpoints"),  # its default replay endpoint
    (["--port", "5560", "--", "--data-parallel-size", "2"], 5560, "--port and the KV events endpoints"),  # rank 1's
    (["--host", "0.0.0.0", "--port", "5557"], 5557, "--port and the KV events endpoints"),
    (["--port", "6000", "--kv-events-endpoint", "tcp://*:6000"], 6000, "--port and the KV events endpoints"),
    (["--host", "localhost", "--port", "6000", "--kv-events-endpoint", "tcp://[::ffff:127.0.0.1]:6000"], 6000,
     "--port and the KV events endpoints"),
    (["--role", "prefill", "--port", "17600"], 17600, "--port and --pd-port"),  # the default --pd-port
    (["--role", "prefill", "--pd-port", "5558"], 5558, "--pd-port and the KV events endpoints"),
    (["--connector-config", '{"pd_port": 9000}', "--port", "9000"], 9000, "--port and --pd-port"),  # kv_both
], ids=["events", "replay", "dp-rank", "wildcard-http", "wildcard-events", "mapped-localhost", "pd-default",
        "pd-replay", "pd-both"])
def test_two_sockets_of_one_worker_on_one_port_are_one_line_exit_2(capsys, argv, port, what):
    capsys.readouterr()
    assert cli.main(["serve", "org/m", "--dry-run", "-q", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"{what} both listen on port {port}" in err, err
    with pytest.raises(ServeError, match=f"both listen on port {port}"):
        plan_from_argv(["org/m", *argv])


@pytest.mark.parametrize("argv", [
    ["--port", "5559"],  # past the replay port
    ["--port", "5557", "--no-kv-events"],
    ["--port", "5557", "--kv-events-endpoint", "tcp://*:0"],  # the OS picks the events port
    ["--port", "5557", "--kv-events-endpoint", "tcp://127.0.0.1:5557"],  # vLLM connects there, binds nothing
    ["--host", "::1", "--port", "5557"],  # another address
    ["--host", "::", "--port", "6000", "--kv-events-endpoint", "tcp://*:6000"],  # IPv6 and IPv4 wildcards
    ["--role", "decode", "--port", "17600"],  # a decode worker binds no control port
    ["--role", "prefill", "--pd-host", "10.1.2.3", "--port", "17600"],
])
def test_sockets_apart_still_plan(argv):
    assert plan_from_argv(["org/m", *argv]).argv


@pytest.mark.parametrize("argv", [["--role", "prefill", "--pd-port", "{busy}"],
                                  ["--connector-config", '{{"pd_port": {busy}}}'],  # kv_both with a control port
                                  ["--role", "prefill", "--pd-host", "192.0.2.1"]])  # no address of this host
def test_a_control_socket_that_cannot_listen_is_one_line_before_vllm_starts(capsys, monkeypatch, argv):
    # Found only once the model was loaded: the connector's TransferError 'P/D control socket
    # cannot bind', in vLLM's traceback.
    import socket

    from kvslots.serve import cli as serve_cli

    def no_vllm(*a, **k):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(serve_cli, "supervise", no_vllm)
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        http = free.getsockname()[1]
        free.close()
        capsys.readouterr()
        code = cli.main(["serve", "org/m", "--port", str(http), "--no-kv-events",
                         *(a.format(busy=busy.getsockname()[1]) for a in argv)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvslots serve: error: P/D control socket: cannot listen on "), err
