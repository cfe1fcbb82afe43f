"""The disk file's fingerprint covers how a block's bytes are laid out (vLLM's resolved KV-cache
layout, ``VLLM_KV_CACHE_LAYOUT``, and the attention backend configured): an engine restarted in
another layout of the same byte size starts the file afresh instead of serving bytes laid out
for the other one. No engine: the part that builds the fingerprint (``DiskLayout.of``) and the
parts that open the file (the worker's ``DiskStore``, the scheduler's ``DiskIndex`` restore)."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from kvslots._core import DiskIndex
from kvslots.vllm.connector.disk import DiskLayout, DiskWorker

BS = 4
BPB = 3000


def configs(layout: str | None = "LBHNC", *, on_cache_config: bool = False, backend: object = None,
            per_kind: dict | None = None) -> tuple[SimpleNamespace, SimpleNamespace]:
    """(vllm_config, kv_cache_config) as far as the fingerprint reads them; the layout where
    vLLM's engine core puts it (``KVCacheConfig.kv_cache_layout``) or, as a worker records it,
    on ``CacheConfig``."""
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model="no-such-model-dir", revision=None, dtype="float16"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS,
                                     kv_cache_layout=layout if on_cache_config else None),
        speculative_config=None,
        attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}))
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])],
                         kv_cache_layout=None if on_cache_config else layout)
    return cfg, kv


def layout_of(*a, **kw) -> DiskLayout:
    return DiskLayout.of(*configs(*a, **kw), BPB)


def test_the_kv_cache_layout_is_part_of_the_fingerprint(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    hnd, nhd = layout_of("LBHNC"), layout_of("LBNHC")
    assert hnd.kwargs() != nhd.kwargs(), "another layout of the same byte size: another fingerprint"
    assert layout_of("LBHNC").fingerprint == hnd.fingerprint
    # vLLM's legacy names are the same layouts, wherever vLLM recorded them.
    assert layout_of("HND").fingerprint == hnd.fingerprint
    assert layout_of("NHD").fingerprint == nhd.fingerprint
    assert layout_of("LBHNC", on_cache_config=True).fingerprint == hnd.fingerprint
    # Not resolved anywhere: what VLLM_KV_CACHE_LAYOUT asked for.
    unresolved = layout_of(None)
    assert unresolved.fingerprint not in (hnd.fingerprint, nhd.fingerprint)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    assert layout_of(None).fingerprint == nhd.fingerprint
    assert dict(getattr(hnd, "identity", ()))["KV-cache layout"] == "LBHNC(0,1,2,3,4)"
    assert dict(getattr(nhd, "identity", ()))["KV-cache layout"] == "LBNHC(0,1,3,2,4)"


def test_the_attention_backend_configured_is_part_of_the_fingerprint():
    auto = layout_of("LBHNC")
    flash = layout_of("LBHNC", backend=SimpleNamespace(name="FLASH_ATTN"))
    flashinfer = layout_of("LBHNC", backend=SimpleNamespace(name="FLASHINFER"))
    per_kind = layout_of("LBHNC", per_kind={"sliding_window": SimpleNamespace(name="TRITON_ATTN")})
    assert len({auto.fingerprint, flash.fingerprint, flashinfer.fingerprint, per_kind.fingerprint}) == 4
    assert dict(getattr(flash, "identity", ()))["attention backend"] == "FLASH_ATTN"


def test_the_installed_vllm_gives_its_layout_and_backend_names():
    # vLLM's own objects (not stand-ins): its KVCacheLayout and AttentionBackendEnum.
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvslots.vllm.compat import attention_backend, kv_cache_layout

    cfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="HND"),
                          attention_config=AttentionConfig(backend=AttentionBackendEnum.FLASH_ATTN))
    assert kv_cache_layout(cfg, SimpleNamespace()) == "LBHNC(0,1,2,3,4)"
    assert attention_backend(cfg) == "FLASH_ATTN"
    assert attention_backend(SimpleNamespace(attention_config=AttentionConfig())) == "auto"
    assert attention_backend(SimpleNamespace()) == "auto"
    assert kv_cache_layout(SimpleNamespace(), SimpleNamespace(kv_cache_layout="BOGUS" * 40)) == ("BOGUS" * 40)[:64]


def _write_blocks(tmp_path, layout: DiskLayout, n: int) -> None:
    w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
    for i in range(n):
        assert w.store.submit(i, np.full(BPB, i + 1, np.uint8), 100 + i, [i] * BS)
    w.store.flush()
    assert w.take_done() == [(i, True) for i in range(n)]
    w.close()
    del w
    gc.collect()


def _restore(tmp_path, layout: DiskLayout):
    return DiskIndex(8, BS).restore_from_file(str(tmp_path / "kvslots-disk-tier.kvs"), **layout.kwargs())


def test_a_restart_in_another_layout_serves_none_of_the_old_blocks(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    hnd, nhd = layout_of("LBHNC"), layout_of("LBNHC")
    _write_blocks(tmp_path, hnd, 3)
    # The same layout again: the blocks are found (the control).
    n, damaged, why = _restore(tmp_path, hnd)
    assert (n, damaged, why) == (3, 0, None)

    # Restarted with VLLM_KV_CACHE_LAYOUT=NHD: nothing of the old file is restored by the
    # scheduler, and the worker starts the file afresh, saying which layout changed.
    n, _, why = _restore(tmp_path, nhd)
    assert n == 0 and why is not None and "fingerprint" in why
    with caplog.at_level(logging.WARNING, logger="kvslots.vllm.connector.disk"):
        w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=nhd, queue_len=8)
    assert w.store.opened.startswith("discarded")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "starting it afresh" in msg
    assert "KV-cache layout 'LBHNC(0,1,2,3,4)' -> 'LBNHC(0,1,3,2,4)'" in msg, msg
    w.close()
    del w
    gc.collect()
    assert _restore(tmp_path, nhd) == (0, 0, None), "started afresh: an empty file of the new layout"
    assert _restore(tmp_path, hnd)[0] == 0, "the old layout's blocks are gone"


def test_the_log_line_names_this_engines_layout_when_nothing_is_kept_beside_the_file(tmp_path, caplog):
    from kvslots.vllm.connector.disk import IDENTITY_SUFFIX

    _write_blocks(tmp_path, layout_of("LBHNC"), 1)
    (tmp_path / ("kvslots-disk-tier.kvs" + IDENTITY_SUFFIX)).write_bytes(b"\xff{not json" * 10)
    with caplog.at_level(logging.WARNING, logger="kvslots.vllm.connector.disk"):
        w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout_of("LBNHC"), queue_len=8)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "this engine: KV-cache layout LBNHC(0,1,3,2,4), attention backend auto" in msg, msg
    w.close()
    # Rewritten with this engine's identity.
    import json

    kept = json.loads((tmp_path / ("kvslots-disk-tier.kvs" + IDENTITY_SUFFIX)).read_text())
    assert kept["KV-cache layout"] == "LBNHC(0,1,3,2,4)"


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_the_scheduler_and_the_worker_compute_one_fingerprint(layout):
    # The scheduler's KVCacheConfig is a deep copy of the worker's (generate_scheduler_kv_cache_config);
    # the worker also records the layout on its CacheConfig: either place gives the same.
    assert layout_of(layout).fingerprint == layout_of(layout, on_cache_config=True).fingerprint


@pytest.mark.parametrize("what", ["fifo", "symlink", "directory"])
def test_what_is_kept_beside_the_file_cannot_block_or_redirect_the_worker(tmp_path, what):
    # The identity file is read at every start: a FIFO in its place blocked the worker's start
    # (open() waits for a writer). Its temporary is created exclusively: a link put there is
    # not written through.
    import os
    import threading

    from kvslots.vllm.connector.disk import IDENTITY_SUFFIX

    side = tmp_path / ("kvslots-disk-tier.kvs" + IDENTITY_SUFFIX)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    if what == "fifo":
        os.mkfifo(side)
    elif what == "symlink":
        os.symlink(victim, str(side) + f".{os.getpid()}.tmp")
    else:
        side.mkdir()
    got: list = []

    def start() -> None:
        try:
            got.append(DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout_of("LBHNC"),
                                  queue_len=8))
        except BaseException as e:  # noqa: BLE001 - reported below
            got.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # let the blocked open() go (a writer appears), then fail
        os.close(os.open(side, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("the worker's start blocked on the FIFO beside its file")
    w = got[0]
    assert isinstance(w, DiskWorker), w
    assert w.store.opened == "created"
    w.close()
    assert victim.read_text() == "keep"
    if what != "directory":
        assert side.is_file() and "KV-cache layout" in side.read_text()
