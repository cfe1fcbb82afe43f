"""The real vLLM engine on CPU with tiny random-weight models built by the tests: greedy outputs
and speculative-decoding acceptance are the same with and without the KVSlotsConnector, and a
repeated long prompt is served from the host tier after the device cache is reset.

Each configuration runs in its own process (tests/engine_run.py): a fresh engine per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def run_engine(models_dir: str, **spec) -> dict:
    spec = {"models": models_dir, "prompt_len": PROMPT, **spec}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_run.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_connector_is_transparent_and_serves_the_host_tier(models_dir, method):
    base = run_engine(models_dir, method=method, connector=False)
    conn = run_engine(models_dir, method=method, connector=True)
    # Same greedy tokens, request by request (the third is the repeat after the device reset).
    assert conn["outputs"] == base["outputs"]
    assert base["outputs"][0] == base["outputs"][2]
    # Same drafts proposed and accepted: the restored draft KV drafts like a computed one.
    for key in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens"):
        assert conn["spec"][key] == base["spec"][key], key
    if method == "draft_model":
        assert conn["spec"]["vllm:spec_decode_num_accepted_tokens"] == conn["spec"]["vllm:spec_decode_num_draft_tokens"] > 0
    # The repeat was served from the host tier: all full prompt blocks but the one EAGLE-family
    # drafters drop (draft_model keeps it) and the one that holds the last prompt token.
    full = (PROMPT - 1) // BLOCK
    expected_blocks = full - 1 if method in ("eagle", "eagle3") else full
    assert conn["connector"]["loaded_blocks"] == expected_blocks
    assert conn["connector"]["hit_tokens"] == expected_blocks * BLOCK
    assert conn["connector"]["failed_loads"] == conn["connector"]["failed_stores"] == 0
    # Host-tier events arrived on the connector's publisher and decoded.
    assert "BlockStored" in conn["events"]
