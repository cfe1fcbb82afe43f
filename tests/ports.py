"""A free TCP port for a server a test starts.

Picked below the kernel's ephemeral range (32768-60999 on Linux), so no socket the kernel
numbers itself (a client's connection, another test's ``bind(0)``) can take it between this
check and the server's bind; each xdist worker draws from its own slice, so two workers never
pick the same port either.
"""

from __future__ import annotations

import os
import random
import socket

_LOW, _HIGH = 20000, 32000


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    width = (_HIGH - _LOW) // count
    low = _LOW + index * width
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, low + width)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + width}")
