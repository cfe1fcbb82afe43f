"""The real vLLM engine on CPU with tiny random-weight models built by the tests: greedy outputs
and speculative-decoding acceptance are the same with and without the KVSlotsConnector, a
repeated long prompt is served from the host tier after the device cache is reset, and for EAGLE
and EAGLE-3 the last block of a host hit is served exactly when its draft KV is what a recompute
writes (compared byte for byte: random EAGLE heads accept almost nothing, so acceptance counts
cannot show a wrong draft KV).

Each configuration runs in its own process (tests/engine_run.py): a fresh engine per run, two
side by side where a test compares two (tests/engine_procs.py)."""

from __future__ import annotations

import os

import pytest
from engine_procs import EngineProcess

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
PROMPT = 400


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models

    root = str(tmp_path_factory.mktemp("tiny-engine"))
    build_tiny_models(root)
    return root


def start_engine(models_dir: str, **spec) -> EngineProcess:
    return EngineProcess(os.path.join(HERE, "engine_run.py"), {"models": models_dir, "prompt_len": PROMPT, **spec},
                         timeout=900)


def run_engine(models_dir: str, **spec) -> dict:
    return start_engine(models_dir, **spec).result()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_connector_is_transparent_and_serves_the_host_tier(models_dir, method):
    base, conn = (start_engine(models_dir, method=method, connector=c) for c in (False, True))
    base, conn = base.result(), conn.result()
    # Same greedy tokens, request by request (the third is the repeat after the device reset).
    assert conn["outputs"] == base["outputs"]
    assert base["outputs"][0] == base["outputs"][2]
    # Same drafts proposed and accepted: the restored draft KV drafts like a computed one.
    for key in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens"):
        assert conn["spec"][key] == base["spec"][key], key
    if method == "draft_model":
        assert conn["spec"]["vllm:spec_decode_num_accepted_tokens"] == conn["spec"]["vllm:spec_decode_num_draft_tokens"] > 0
    # The repeat was served from the host tier: every full prompt block but the one that holds
    # the last prompt token, EAGLE-family drafters included (the last block's recorded next
    # token matches the repeat's).
    full = (PROMPT - 1) // BLOCK
    expected_blocks = full
    assert conn["connector"]["loaded_blocks"] == expected_blocks
    assert conn["connector"]["hit_tokens"] == expected_blocks * BLOCK
    assert conn["connector"]["failed_loads"] == conn["connector"]["failed_stores"] == 0
    # Host-tier events arrived on the connector's publisher and decoded.
    assert "BlockStored" in conn["events"]


@pytest.fixture(scope="module")
def plain_draft_kv(models_dir):
    """The same scenario without speculative decoding: the host hits to match (started now, it
    runs beside the first test's own engine)."""
    return start_engine(models_dir, method=None, connector=True, draft_kv=True)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_last_block_is_served_from_host_with_the_draft_kv_a_recompute_writes(models_dir, plain_draft_kv,
                                                                                  method):
    r = run_engine(models_dir, method=method, connector=True, draft_kv=True)
    plain_draft_kv = plain_draft_kv.result()
    full = r["full_blocks"]
    assert r["draft_layers"], "the drafter's layers are in the host blocks"
    # Each host block recorded the token that followed it when stored.
    assert r["successors"] == r["expected_successors"]
    # The repeated prompt gets the same host hit as without speculative decoding: every full
    # block, the last one included.
    assert r["hit_p"] == plain_draft_kv["hit_p"] == full * BLOCK
    # Greedy outputs: the repeat (from the host tier) and the recompute agree, and match the
    # non-speculative run's.
    o = r["outputs"]
    assert o["p"] == o["p_repeat"] == o["p_recomputed"] == plain_draft_kv["outputs"]["p"]
    assert o["q"] == o["q_recomputed"] == plain_draft_kv["outputs"]["q"]
    # The blocks the repeat loaded hold, in the draft layers as in the target's, the bytes a
    # recompute writes.
    assert all(r["p_draft_equal"]) and all(r["p_target_equal"])
    # A prompt with another token after the same blocks: the last block is recomputed (its
    # stored draft KV, written with the other next token, differs from what Q's recompute
    # writes there; the target KV and the earlier blocks do not).
    assert r["hit_q"] == (full - 1) * BLOCK
    assert plain_draft_kv["hit_q"] == full * BLOCK, "without a drafter the last block is served"
    assert all(r["pq_target_equal"])
    assert all(r["pq_draft_equal"][: full - 1]) and not r["pq_draft_equal"][full - 1]
    assert r["connector"]["failed_loads"] == r["connector"]["failed_stores"] == 0


def test_eagle_block_ending_a_prefill_chunk_is_not_served_as_a_last_block(models_dir):
    """With chunks of 128 tokens vLLM's padded drafter writes the last position of each partial
    chunk with a stand-in for the next token: such a block records no successor and is
    recomputed when it would be the last block of a hit."""
    r = run_engine(models_dir, method="eagle", connector=True, draft_kv=True, max_num_batched_tokens=128)
    full = r["full_blocks"]
    chunk_ends = {128 // BLOCK * k - 1 for k in range(1, PROMPT // 128 + 1)}
    assert [s is None for s in r["successors"]] == [i in chunk_ends for i in range(full)]
    assert (full - 1) in chunk_ends
    assert r["hit_p"] == (full - 1) * BLOCK
    assert all(r["p_draft_equal"]) and all(r["p_target_equal"])
    o = r["outputs"]
    assert o["p"] == o["p_repeat"] == o["p_recomputed"]
