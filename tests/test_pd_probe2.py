"""Outside probes of the P/D transport (kvslots.vllm.pd): hostile arguments to its public calls
and hostile peers on its sockets. Each test names what failed before."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvslots.errors import InvalidArgumentError, KVSlotsError

NB, BB, NS = 16, 256, 2


@pytest.fixture
def transport():
    os.environ.setdefault("GLOG_minloglevel", "1")
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (requirements/pd.txt) is not installed")
    from kvslots.vllm.pd import BlockLayout, MooncakeTransport

    buf = np.zeros(NS * NB * BB, dtype=np.uint8)
    layout = BlockLayout.from_buffer(buf.ctypes.data, block_bytes=BB, num_blocks=NB, num_segments=NS)
    t = MooncakeTransport("127.0.0.1")
    t.register(layout)
    yield t, layout, buf
    t.close()


@pytest.mark.parametrize("which", ["remote_ids", "local_ids"])
@pytest.mark.parametrize("ids", [range(10**12), range(2**70), range(10**8)], ids=["1e12", "2_70", "1e8"])
def test_a_huge_id_range_is_refused_at_once(transport, which, ids):
    # numpy built the whole array before any check: range(10**12) was a MemoryError (7 TiB asked
    # for), range(10**8) some 800 MB and seconds, range(2**70) an OverflowError; a read of more
    # ids than the local blocks they go to is refused anyway.
    t, layout, buf = transport
    args = {"remote_ids": [0], "local_ids": [0], which: ids}
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match=which):
        t.plan(layout, **args)
    with pytest.raises(KVSlotsError):
        t.read_blocks("127.0.0.1:1", layout, **args)
    assert time.monotonic() - start < 2
    # As many ids as blocks still plan: one entry per segment.
    assert len(t.plan(layout, range(NB), range(NB))[0]) == NS
    assert not buf.any()
