"""A worker stand-in for the P/D transport tests and bench: registers a buffer of random blocks
with a MooncakeTransport, prints one JSON line (session, layout, seed), then serves reads until
its stdin closes.

    python tests/pd_transport_peer.py SEED NUM_BLOCKS BLOCK_BYTES NUM_SEGMENTS
"""

import json
import sys

import numpy as np

from kvslots.vllm.pd import BlockLayout, MooncakeTransport


def peer_buffer(seed: int, num_blocks: int, block_bytes: int, num_segments: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=num_segments * num_blocks * block_bytes, dtype=np.uint8)


def main() -> None:
    seed, num_blocks, block_bytes, num_segments = (int(x) for x in sys.argv[1:5])
    buf = peer_buffer(seed, num_blocks, block_bytes, num_segments)
    t = MooncakeTransport("127.0.0.1")
    layout = BlockLayout.from_buffer(buf.ctypes.data, block_bytes=block_bytes, num_blocks=num_blocks,
                                     num_segments=num_segments)
    t.register(layout)
    print(json.dumps({"session": t.session_id, "layout": layout.to_wire()}), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    t.close()


if __name__ == "__main__":
    main()
