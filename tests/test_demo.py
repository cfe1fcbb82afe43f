"""The README's main job, end to end: `kvslots demo` serves a tiny local model through
`kvslots serve` with the connector, KV events and an in-process indexer."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")


def test_demo_shows_host_tier_hits_acceptance_and_scores(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvslots", "demo", "--json", "--cache-dir", str(tmp_path / "models")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["identical_after_reset"] and r["device_cache_reset"]
    assert r["host_tier_hit_tokens_on_repeat"] >= 320 // 32 * 32 - 32
    sd = r["spec_decode"]
    assert sd["num_accepted_tokens_total"] == sd["num_draft_tokens_total"] > 0  # draft_model = target
    before, after = r["indexer_before_reset"]["tiers"], r["indexer_after_reset"]["tiers"]
    assert before["GPU"]["tokens"] >= 320 and before["CPU"]["tokens"] >= 320
    assert after["GPU"]["tokens"] == 0 and after["CPU"]["tokens"] == before["CPU"]["tokens"]


def test_a_server_that_does_not_come_up_is_one_error_line(capsys, monkeypatch):
    import argparse

    from kvslots.demo import run as demo
    from kvslots.errors import ServeError

    class Exited:
        returncode = 3

        def poll(self):
            return 3

    with pytest.raises(ServeError, match="exited with status 3 before it was ready"):
        demo._wait_healthy("http://127.0.0.1:9", Exited(), timeout=5)

    def fail(args):
        raise ServeError("the server was not ready after 1 s (--timeout)")

    monkeypatch.setattr(demo, "run", fail)
    assert demo._main(argparse.Namespace(json=False)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "kvslots demo: error: the server was not ready after 1 s (--timeout)\n"
