"""``kvslots serve --role`` / ``--is-prefill-worker``: the vLLM command of each P/D role, as
vLLM's own parser reads it, and the conflicting flags refused with one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvslots.errors import ServeError
from kvslots.serve.cli import DEFAULT_PD_PORT, plan_from_argv


@pytest.fixture
def target(tmp_path):
    from kvslots._dev.tiny import build_target, build_tokenizer

    d = str(tmp_path / "target")
    build_tokenizer(d)
    build_target(d)
    return d


def _kt(plan):
    return plan.kv_transfer_config


def test_roles_pick_kv_role_and_vllms_manager(target):
    pre = plan_from_argv([target, "--is-prefill-worker"])
    assert _kt(pre)["kv_role"] == "kv_producer"
    assert _kt(pre)["kv_connector_extra_config"]["pd_port"] == DEFAULT_PD_PORT
    assert pre.scheduler_cls is None  # vLLM's KV cache manager, not scheduler mode
    assert plan_from_argv([target, "--role", "prefill", "--pd-port", "9100", "--pd-host", "10.0.0.5"]) \
        .kv_transfer_config["kv_connector_extra_config"] == {"pd_port": 9100, "pd_host": "10.0.0.5"}
    dec = plan_from_argv([target, "--role", "decode"])
    assert _kt(dec)["kv_role"] == "kv_consumer" and _kt(dec)["kv_load_failure_policy"] == "recompute"
    assert "pd_port" not in _kt(dec)["kv_connector_extra_config"]
    both = plan_from_argv([target])
    assert _kt(both)["kv_role"] == "kv_both"


@pytest.mark.parametrize("argv, msg", [
    (["--is-prefill-worker", "--role", "decode"], "conflicts"),
    (["--role", "decode", "--pd-port", "9000"], "control port"),
    (["--pd-port", "9000"], "add --role"),
    (["--role", "prefill", "--no-connector"], "--no-connector"),
    (["--role", "prefill", "--slot-manager", "kvslots"], "KV cache manager"),
    (["--role", "prefill", "--pd-port", "9000", "--connector-config", '{"pd_port": 9001}'], "conflicts"),
    (["--role", "prefill", "--pd-host", "a:b"], "pd_host"),
])
def test_conflicting_flags_are_serve_errors(target, argv, msg):
    with pytest.raises(ServeError, match=msg):
        plan_from_argv([target, *argv])


def test_cli_error_is_one_line_exit_2(target):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "python"))
    r = subprocess.run([sys.executable, "-m", "kvslots", "serve", target, "--role", "decode", "--pd-port", "9",
                        "--dry-run"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "control port" in r.stderr


def test_vllm_parses_the_role_commands(target):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvslots.config.connector import ConnectorConfig
    from kvslots.vllm.compat import cli_args_module

    parser = cli_args_module().make_arg_parser(FlexibleArgumentParser())
    for argv, producer, consumer in (([target, "--is-prefill-worker"], True, False),
                                     ([target, "--role", "decode"], False, True)):
        plan = plan_from_argv(argv)
        ns = parser.parse_args(plan.vllm_args)
        cli_args_module().validate_parsed_serve_args(ns)
        kt = AsyncEngineArgs.from_cli_args(ns).kv_transfer_config
        assert (kt.is_kv_producer, kt.is_kv_consumer) == (producer, consumer)
        ConnectorConfig.from_extra_config(kt.kv_connector_extra_config)
