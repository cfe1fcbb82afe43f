"""The disk tier's settings: the connector's extra-config keys (validated, off by default) and
the ``kvslots serve`` flags that set them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvslots import cli
from kvslots.config.connector import ConnectorConfig
from kvslots.errors import ConnectorConfigError
from kvslots.serve import plan_from_argv

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 512, "torch_dtype": "float32"}


@pytest.fixture(autouse=True)
def _reserved(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


@pytest.fixture
def target(tmp_path: Path) -> str:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path / "t")


def test_disk_keys_default_off_and_size_the_tier() -> None:
    cfg = ConnectorConfig.from_extra_config({})
    assert cfg.disk_path is None
    cfg = ConnectorConfig.from_extra_config({"disk_path": "/x", "disk_gb": 1})
    assert cfg.num_disk_blocks(1 << 20) == 1024
    assert ConnectorConfig.from_extra_config({"disk_path": "/x", "disk_blocks": 7}).num_disk_blocks(1 << 20) == 7
    with pytest.raises(ConnectorConfigError, match="holds no block"):
        ConnectorConfig.from_extra_config({"disk_gb": 1e-9}).num_disk_blocks(1 << 20)


@pytest.mark.parametrize("extra", [{"disk_path": ""}, {"disk_path": 3}, {"disk_path": "a\0b"}, {"disk_gb": 0},
                                   {"disk_gb": -1.0}, {"disk_gb": float("nan")}, {"disk_gb": float("inf")},
                                   {"disk_gb": True}, {"disk_gb": "8"}, {"disk_blocks": 0}, {"disk_blocks": 2.5},
                                   {"disk_blocks": 1 << 40}, {"disk_queue_len": -3}, {"disk_queue_len": None}])
def test_bad_disk_values_are_refused(extra: dict) -> None:
    with pytest.raises(ConnectorConfigError, match=next(iter(extra))):
        ConnectorConfig.from_extra_config(extra)


def test_serve_flags_set_the_disk_keys_and_recompute_on_load_failure(target: str, tmp_path: Path) -> None:
    d = str(tmp_path / "disk")
    plan = plan_from_argv([target, "--disk-path", d, "--disk-gb", "2"])
    kv = plan.kv_transfer_config
    assert kv["kv_connector_extra_config"] == {"disk_path": d, "disk_gb": 2.0}
    assert kv["kv_load_failure_policy"] == "recompute"
    plan = plan_from_argv([target])
    assert "disk_path" not in plan.kv_transfer_config["kv_connector_extra_config"]
    assert "kv_load_failure_policy" not in plan.kv_transfer_config


@pytest.mark.parametrize("argv, word", [(["--disk-gb", "2"], "needs --disk-path"),
                                        (["--disk-gb", "-1", "--disk-path", "/x"], "--disk-gb"),
                                        (["--disk-path", "/x", "--connector-config", '{"disk_path": "/y"}'],
                                         "conflicts"),
                                        (["--disk-path", "/x", "--no-connector"], "--no-connector")])
def test_bad_serve_disk_flags_exit_2_with_one_line(target: str, argv: list, word: str, capsys) -> None:
    try:
        rc = cli.main(["serve", target, *argv, "--dry-run"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and word in err[0], err


def test_disk_path_expands_the_home_directory(target: str, tmp_path: Path, monkeypatch, capsys) -> None:
    # As a model path is: ~ in a --connector-config (JSON, which no shell expands) or a
    # --disk-path=~/x was taken as a directory named "~" under vLLM's working directory.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    want = str(home / "kv")
    assert ConnectorConfig(disk_path="~/kv").disk_path == want
    assert ConnectorConfig.from_extra_config({"disk_path": "~/kv"}).disk_path == want
    assert ConnectorConfig(disk_path="~nosuchuser-kvslots/kv").disk_path == "~nosuchuser-kvslots/kv"  # stays
    ConnectorConfig(disk_path="~/kv").check_disk_path()
    # The check kvslots serve runs before vLLM starts looks under $HOME too: a HOME that is a
    # file takes no disk tier (it tried ./~/kv and passed).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(target + "/config.json"))
    for argv in (["--connector-config", '{"disk_path": "~/kv"}'], ["--disk-path=~/kv"]):
        rc = cli.main(["serve", target, *argv, "--dry-run", "-q"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "is not a directory" in err[0], err
    assert not (tmp_path / "~").exists()


def test_disk_path_is_tried_before_start(tmp_path: Path) -> None:
    # A disk_path that exists but takes no file (/proc/self), or lies under a file, passed the
    # pre-start check: the connector refused it only once vLLM had loaded the model.
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, why in (("/proc/self", "cannot create a file in '/proc/self'"),
                      ("/proc/self/tier", "cannot create a file in '/proc/self'"),
                      (str(afile), "not a directory"),
                      (str(afile / "tier"), f"{str(afile)!r} is not a directory"),
                      (str(afile / "a" / "b"), f"{str(afile)!r} is not a directory")):
        with pytest.raises(ConnectorConfigError, match=f"disk_path=.*{re.escape(why)}"):
            ConnectorConfig(disk_path=path).check_disk_path()
    (tmp_path / "d" / "kvslots-disk-tier.kvs").mkdir(parents=True)  # where the tier's file goes
    with pytest.raises(ConnectorConfigError, match="is there and is not a regular file"):
        ConnectorConfig(disk_path=str(tmp_path / "d")).check_disk_path()
    # Passes: a directory, one still to be made, one holding an earlier run's file; nothing is
    # left behind (no probe file, no directory made).
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "kvslots-disk-tier.kvs").write_bytes(b"old")
    for path in (tmp_path / "e", tmp_path / "new" / "deeper", "."):
        ConnectorConfig(disk_path=str(path)).check_disk_path()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "d", "e"]
    assert [p.name for p in (tmp_path / "e").iterdir()] == ["kvslots-disk-tier.kvs"]
    assert (tmp_path / "e" / "kvslots-disk-tier.kvs").read_bytes() == b"old"
    ConnectorConfig().check_disk_path()  # no disk tier: nothing to check


def test_disk_path_without_write_permission_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    immutable = False
    if os.geteuid() == 0:
        # Root creates files in a read-only directory; not in an immutable one (chattr +i,
        # where the filesystem and the capabilities allow it), which is what is tried then.
        import subprocess

        try:
            got = subprocess.run(["chattr", "+i", str(ro)], capture_output=True, text=True)
            why = got.stderr.strip() or f"exit status {got.returncode}"
        except OSError as e:
            got, why = None, str(e)
        if got is None or got.returncode != 0:
            ro.chmod(0o700)
            pytest.skip(f"root creates files in a read-only directory, and chattr +i is not available ({why})")
        immutable = True
    try:
        for path in (ro, ro / "sub"):
            with pytest.raises(ConnectorConfigError, match="cannot create a file"):
                ConnectorConfig(disk_path=str(path)).check_disk_path()
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o700)


def test_serve_disk_path_that_takes_no_file_is_one_line_exit_2(target: str, tmp_path: Path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, word in ((["--disk-path", "/proc/self"], "cannot create a file in '/proc/self'"),
                       (["--disk-path", str(afile / "tier")], "is not a directory"),
                       (["--connector-config", json.dumps({"disk_path": "/proc/self/tier"})], "cannot create a file")):
        try:
            rc = cli.main(["serve", target, *argv, "--dry-run"])
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and word in err[0] and "disk_path" in err[0], err


def test_disk_path_whose_file_another_engine_holds_is_refused_before_start(tmp_path: Path) -> None:
    # The store takes an exclusive flock on its file; the pre-check opened it without looking,
    # so a second engine on one disk_path was refused only once vLLM had loaded the model.
    from kvslots._core import DiskStore

    held = DiskStore(str(tmp_path / "kvslots-disk-tier.kvs"), num_slots=2, block_size=4, num_layers=1,
                     bytes_per_block=64, dtype="float32", fingerprint=1)
    with pytest.raises(ConnectorConfigError, match=r"disk_path=.*kvslots-disk-tier\.kvs' is in use by another engine"):
        ConnectorConfig(disk_path=str(tmp_path)).check_disk_path()
    del held  # the lock goes with the store
    ConnectorConfig(disk_path=str(tmp_path)).check_disk_path()
