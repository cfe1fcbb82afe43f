"""A free TCP port for a server a test starts.

Picked below the kernel's ephemeral range (32768-60999 on Linux), so no socket the kernel
numbers itself (a client's connection, a ``bind(0)``) can take it between this check and the
server's bind. Each xdist worker walks its own slice of the range from a random start and never
hands out a port twice, so neither two workers nor two calls in one test pick the same port.
A second pytest run beside this one (`make test` runs the vLLM 0.33 part beside the 0.32 one)
takes a range of its own from ``KVSLOTS_TEST_PORTS`` ("low-high").
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator

_LOW, _HIGH = 20000, 32000


def _range() -> tuple[int, int]:
    given = os.environ.get("KVSLOTS_TEST_PORTS")
    if not given:
        return _LOW, _HIGH
    low, _, high = given.partition("-")
    return int(low), int(high)


def _candidates() -> Iterator[int]:
    lo, hi = _range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    width = (hi - lo) // count
    low = lo + index * width
    start = random.randrange(width)
    for i in itertools.count(start):
        yield low + i % width


_PORTS = _candidates()  # reads the worker's slice at its first port


def free_port() -> int:
    for port in itertools.islice(_PORTS, 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 1000 tries")
