"""``kvslots indexer``: which worker holds how much of a prompt, from the workers' KV events.

Parts: :mod:`.config` (worker specs, settings), :mod:`.subscription` (the ZMQ event streams,
gaps, replays), :mod:`.backend` / :mod:`.redis_backend` (where the index lives),
:mod:`.service` (wiring, metrics), :mod:`.app` (the HTTP API), :mod:`.cli` (the command).
The index itself is Rust: ``kvslots._core.PrefixIndex``.
"""

from .config import IndexerConfig, WorkerSpec
from .service import IndexerService

__all__ = ["IndexerConfig", "IndexerService", "WorkerSpec"]
