"""A host name is looked up with a bound (kvslots._listen.RESOLVE_TIMEOUT_S): ``check_listen``
called getaddrinfo, which has no timeout of its own, so a resolver that never answered (a dead DNS
server, a hung NSS module) made ``kvslots serve``, ``kvslots indexer`` and ``kvslots proxy`` hang
before they started. Now one line, exit status 2. The resolver is replaced by one that never
answers for a name (an address still resolves: it needs no resolver)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from kvslots import _listen
from kvslots.errors import ConfigError

#: Source run first in the children: a resolver that never answers for a name.
HUNG_RESOLVER = """
import socket, threading, kvslots._listen as listen
real = socket.getaddrinfo
def hung(host, *rest):
    numeric = len(rest) > 4 and rest[4] & socket.AI_NUMERICHOST  # answered without a resolver
    if host in (None, "127.0.0.1", "::1") or numeric:
        return real(host, *rest)
    threading.Event().wait()
socket.getaddrinfo = hung
listen.RESOLVE_TIMEOUT_S = 0.5
"""


@pytest.fixture
def hung_resolver(monkeypatch):
    release = threading.Event()
    real = socket.getaddrinfo

    def hung(host, *rest):
        numeric = len(rest) > 4 and rest[4] & socket.AI_NUMERICHOST  # answered without a resolver
        if host in (None, "127.0.0.1", "::1") or numeric:  # addresses, however asked
            return real(host, *rest)
        release.wait()
        raise socket.gaierror(socket.EAI_AGAIN, "released by the test")  # never resolves

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    monkeypatch.setattr(_listen, "RESOLVE_TIMEOUT_S", 0.3, raising=False)
    yield
    release.set()  # the lookup threads end


def test_check_listen_gives_up_on_a_resolver_that_does_not_answer(hung_resolver):
    result: list = []

    def call():
        try:
            _listen.check_listen("slow.example", 8123)
            result.append("listened")
        except ConfigError as e:
            result.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(5)  # the test's own bound: the old code waited for ever
    assert result, "check_listen hung on the resolver"
    assert isinstance(result[0], ConfigError), result
    assert str(result[0]) == "host 'slow.example': cannot resolve it (the resolver did not answer within 0.3 s)"
    assert time.monotonic() - t0 < 3


def test_an_address_needs_no_resolver(hung_resolver):
    # Controls: an address, or no host, is answered at once (no thread, no wait).
    for host in ("127.0.0.1", "::1", ""):
        _listen.check_listen(host, 0)


@pytest.mark.parametrize("argv, what", [
    (["serve", "org/target", "-q", "--host", "slow.example", "--port", "8123"], "kvslots serve: error: "),
    (["indexer", "--host", "slow.example", "--port", "8200"], "kvslots indexer: "),
    (["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--host", "slow.example"],
     "kvslots proxy: error: "),
])
def test_the_commands_say_so_in_one_line_and_exit_2(argv, what):
    script = HUNG_RESOLVER + (
        "from kvslots import cli\n"
        "from kvslots.serve import cli as serve_cli\n"
        "serve_cli.supervise = lambda *a, **k: sys.exit('vLLM was started')\n"
        f"import sys\nsys.exit(cli.main({argv!r}))\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvslots {argv[0]} hung on the resolver")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"{what}host 'slow.example': cannot resolve it (the resolver did not answer within 0.5 s)\n", \
        proc.stderr
