"""The slot manager: the Rust engine with a few Python conveniences."""

from __future__ import annotations

from .. import _core
from ..events import KVEvent
from ..events.codec import _from_raw
from .._args import text


class SlotManager(_core.SlotManager):
    """KV-cache block slots for requests under speculative decoding, over a pool it owns.

    Per engine step a request reserves ``new_tokens`` positions plus its lookahead K
    (``reserve``), commits the verified tokens (``commit``: every block they fill becomes
    immutable, hashed and registered as prefix cache, and a ``BlockStored`` event is queued) and
    rolls back the rejected drafts (``rollback``: the tail blocks stay as capacity).
    :meth:`step` does all of that for a whole batch in one call. ``finish`` returns mutable
    blocks to the free stack and immutable ones to the LRU cache, which is evicted lazily
    (``BlockRemoved``) when the free stack runs dry.

    Events: :meth:`drain_events` returns vLLM-compatible structs; ``drain_events_msgpack(ts,
    medium, data_parallel_rank)`` returns the same batch already encoded as vLLM's msgpack
    ``KVEventBatch`` (by the Rust core, byte-identical to msgspec's), ready for
    :class:`kvslots.events.publisher.EventPublisher`.

    Every method either succeeds or raises a :class:`kvslots.SlotError` subclass having changed
    nothing.
    """

    def drain_events(self, medium: str | None = None) -> list[KVEvent]:
        """Takes the queued events as vLLM-compatible structs (``medium`` is set on each)."""
        if medium is not None:
            # Checked before the queue is emptied, as drain_events_msgpack does: a medium of
            # another type went into every struct, which then could not be encoded. An exact
            # str, since msgspec encodes no str subclass.
            medium = text(medium, "medium")
        # The core's own tuples: the public from_raw's per-item checks would triple the cost.
        return [_from_raw(raw, medium, False, None) for raw in self.drain_raw_events()]

    def __repr__(self) -> str:
        return (
            f"SlotManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"slots={len(self)}, free={self.num_free}, held={self.num_held}, cached={self.num_cached})"
        )
