"""The servers raise their soft descriptor limit toward the hard one before deriving their
connection caps from it (as vLLM's API server does): under a distribution's default soft limit
of 1024 the proxy's defaults left clients a few hundred connections while the hard limit
allowed far more."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from kvslots import cli

PROBE = "from kvslots._fds import raise_limit; print(raise_limit(), raise_limit(10))"


def _in_child(soft: int, hard: int) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_soft_limit_is_raised_to_the_hard_one_and_never_lowered():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard descriptor limit here is {hard}: no room to raise a soft limit into")
    assert _in_child(1024, 4096) == ["4096", "4096"]  # and a lower target does not lower it
    assert _in_child(1024, 1024) == ["1024", "1024"]


@pytest.mark.parametrize("argv", [["proxy", "--prefill", "nope", "--decode", "http://127.0.0.1:1"],
                                  ["indexer", "--port", "0"]])
def test_both_servers_raise_it_before_anything_else(monkeypatch, capsys, argv):
    from kvslots import _fds
    from kvslots.indexer import cli as indexer_cli

    called = []

    def fake(target=_fds.SERVER_LIMIT):
        called.append(target)
        raise SystemExit(7)  # stop there: nothing else of the server runs

    monkeypatch.setattr(_fds, "raise_limit", fake)
    monkeypatch.setattr(indexer_cli, "raise_limit", fake)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 7 and called == [_fds.SERVER_LIMIT]
