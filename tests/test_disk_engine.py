"""The disk tier in a real vLLM engine on CPU (tiny random-weight models, EAGLE drafter), each
phase in its own process (tests/disk_engine_run.py): prompts overflow a 16-block host tier, the
device prefix cache is reset, and the repeats are served from disk with identical outputs; a
restarted engine finds the disk tier again; a corrupt record is recomputed with one warning. Disk
hits load asynchronously (vLLM's WAITING_FOR_REMOTE_KVS) and move up to the host tier."""

from __future__ import annotations

import os

import pytest
from engine_procs import EngineProcess

HERE = os.path.dirname(os.path.abspath(__file__))
FULL_BLOCKS = (400 - 1) // 32  # served blocks of a 400-token prompt


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    root = str(tmp_path_factory.mktemp("tiny-disk"))
    build_tiny_models(root)
    return root


def run(models: str, disk: str, phase: str) -> dict:
    spec = {"models": models, "disk": disk, "phase": phase}
    return EngineProcess(os.path.join(HERE, "disk_engine_run.py"), spec, timeout=900).result()


def disk_source(r: dict) -> int:
    return sum(v for k, v in r["by_source"].items() if "'disk'" in k)


def test_disk_tier_serves_hits_survives_a_restart_and_recomputes_a_corrupt_block(models_dir, tmp_path):
    disk = str(tmp_path / "disk")
    fill = run(models_dir, disk, "fill")
    assert fill["restored"] == 0
    assert fill["again"] == fill["first"][:2], "outputs served from disk equal the computed ones"
    # 4 prompts x 12 blocks through a 16-block host tier: the first two prompts are on disk only.
    assert fill["stored_after_fill"] >= 2 * FULL_BLOCKS
    assert fill["disk_hit_tokens"] == 2 * FULL_BLOCKS * 32 and fill["host_hit_tokens"] == 0
    assert disk_source(fill) == fill["disk_hit_tokens"], "vLLM counts them under source 'disk'"
    assert fill["disk_stats"]["disk_worker_bytes_written"] > 0 and fill["warnings"] == []
    # Per-tier figures on vLLM's own metrics (KVSlotsConnector.build_prom_metrics).
    cap = {k: v for k, v in fill["tier_metrics"].items() if k.startswith("vllm:kvslots_tier_capacity_blocks")}
    assert sorted(cap.values()) == [16, 256], fill["tier_metrics"]

    again = run(models_dir, disk, "restart")
    # Blocks a hit moved up to the host tier left the index, but their records stay readable
    # until their slots are reused: a restart (host tier empty) finds them again.
    used = fill["disk_stats"]["disk_used_blocks"]
    assert fill["disk_stats"]["disk_promoted_blocks"] > 0
    assert used <= again["restored"] <= used + fill["disk_stats"]["disk_promoted_blocks"]
    assert again["again"] == fill["first"][:2]
    # Hits move blocks up (a block lives in one tier at a time): blocks the host tier held at
    # shutdown come back only where their old record survived, so at least the first prompt
    # (spilled again by the second's promotion) is served from disk in full.
    assert FULL_BLOCKS * 32 <= again["disk_hit_tokens"] <= 2 * FULL_BLOCKS * 32
    assert disk_source(again) == again["disk_hit_tokens"]

    bad = run(models_dir, disk, "corrupt")
    assert bad["corrupted"] == 1
    assert bad["again"] == fill["first"][:2], "the corrupt block is recomputed, the output is unchanged"
    assert len(bad["warnings"]) == 1, bad["warnings"]
    assert bad["disk_stats"]["disk_corrupt_blocks"] == 1
    assert bad["disk_stats"]["disk_worker_corrupt_blocks"] == 1
