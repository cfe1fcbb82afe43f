"""vLLM's CPU backend reserves one more core per rank for any KV connector; the KVSlotsConnector
runs no thread of its own, so kvslots serve asks vLLM for the reservation it makes without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvslots.serve import plan_from_argv
from kvslots.vllm import cpu_cores
from kvslots.vllm.cpu_cores import (
    RESERVED_CPU_ENV,
    connector_cpu_env,
    reservation_warning,
    reserved_cpus_without_connector,
)


def test_reservation_matches_vllm_without_a_connector():
    assert reserved_cpus_without_connector(1, "x86_64") == 1
    assert reserved_cpus_without_connector(4, "x86_64") == 4
    assert reserved_cpus_without_connector(2, "aarch64") == 2
    assert reserved_cpus_without_connector(4, "ppc64le") == 1
    assert connector_cpu_env(2, {}, "x86_64") == {RESERVED_CPU_ENV: "2"}
    assert connector_cpu_env(2, {RESERVED_CPU_ENV: "0"}, "x86_64") == {}, "the user's value stands"
    assert connector_cpu_env(1, {RESERVED_CPU_ENV: ""}, "x86_64") == {RESERVED_CPU_ENV: "1"}
    assert reservation_warning(1, {RESERVED_CPU_ENV: "1"}) is None
    assert f"{RESERVED_CPU_ENV}=1" in (reservation_warning(1, {}) or "")


@pytest.fixture
def target(tmp_path: Path) -> str:
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return str(d)


def plan(argv: list[str]):
    return plan_from_argv(argv, python="/py")


def test_serve_sets_the_reservation_on_a_cpu_build(target, monkeypatch):
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    monkeypatch.setattr("kvslots.serve.plan.vllm_is_cpu_build", lambda: True)
    monkeypatch.setattr(cpu_cores.platform, "machine", lambda: "x86_64")
    p = plan([target])
    assert p.env == {RESERVED_CPU_ENV: "1"}
    assert any(RESERVED_CPU_ENV in n for n in p.notes)
    assert p.shell().startswith(f"{RESERVED_CPU_ENV}=1 ")
    # One per local rank: tensor x pipeline parallel, from the tail (short or long form).
    assert plan([target, "--", "-tp", "2", "--pipeline-parallel-size=2"]).env == {RESERVED_CPU_ENV: "4"}
    # Not without our connector, and never over the user's own value.
    assert plan([target, "--no-connector"]).env == {}
    monkeypatch.setenv(RESERVED_CPU_ENV, "0")
    assert plan([target]).env == {}


def test_serve_leaves_gpu_builds_alone(target, monkeypatch):
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    monkeypatch.setattr("kvslots.serve.plan.vllm_is_cpu_build", lambda: False)
    assert plan([target]).env == {}


def test_arguments_of_the_wrong_type_or_size_are_kvslots_errors():
    # They were TypeError ('2' > 1), AttributeError (a machine of 5, an environ of 5), or a
    # count of 10**100 cores put in the environment; now an error naming the argument.
    from kvslots.errors import ArgumentTypeError, InvalidArgumentError

    with pytest.raises(ArgumentTypeError, match="local_world_size"):
        reserved_cpus_without_connector("2", "x86_64")
    with pytest.raises(ArgumentTypeError, match="local_world_size"):
        connector_cpu_env(True, {}, "x86_64")
    with pytest.raises(ArgumentTypeError, match="local_world_size"):
        reservation_warning(float("nan"), {})
    with pytest.raises(InvalidArgumentError, match="local_world_size"):
        connector_cpu_env(10**100, {}, "x86_64")
    with pytest.raises(InvalidArgumentError, match="local_world_size"):
        connector_cpu_env(-5, {}, "x86_64")
    with pytest.raises(ArgumentTypeError, match="machine"):
        reserved_cpus_without_connector(1, 5)
    with pytest.raises(ArgumentTypeError, match="environ"):
        connector_cpu_env(1, environ=5)
    assert connector_cpu_env(0, {}, "x86_64") == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert connector_cpu_env(4, {}, "aarch64") == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}
