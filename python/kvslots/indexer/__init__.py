"""``kvslots indexer``: which worker holds how much of a prompt, from the workers' KV events.

Parts: :mod:`.config` (worker specs, settings), :mod:`.subscription` (the workers' event streams,
through ``kvslots.events.subscriber``), :mod:`.backend` / :mod:`.redis_backend` (where the index lives),
:mod:`.service` (wiring, metrics), :mod:`.app` (the HTTP API), :mod:`.cli` (the command).
The index itself is Rust: ``kvslots._core.PrefixIndex``.
"""

from typing import TYPE_CHECKING, Any

from .config import IndexerConfig, WorkerSpec

if TYPE_CHECKING:
    from .service import IndexerService

__all__ = ["IndexerConfig", "IndexerService", "WorkerSpec"]


def __getattr__(name: str) -> Any:
    # The service needs the optional 'indexer' extra (FastAPI, prometheus_client, redis): import
    # it on first use, so that `kvslots --help` and the other commands work without it.
    if name == "IndexerService":
        from .service import IndexerService

        return IndexerService
    raise AttributeError(name)
