"""Type stubs for the Rust extension ``kvslots._core``."""

from typing import Any, Sequence, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

__all__ = [
    "SlotManager",
    "SlotTracker",
    "SlotInfo",
    "HostCache",
    "PrefixIndex",
    "ApplyStats",
    "lora_key",
    "block_hash",
    "encode_event_batch",
    "copy_blocks",
    "BlockRegion",
    "__version__",
]

__version__: str

# Stub-only aliases (not in the extension): an integer sequence argument, and a
# [gpu, cpu, storage] per-tier triple as the extension returns it.
_IntSeq = Sequence[int] | npt.NDArray[np.integer[Any]]
_TierBlocks = list[int]

def block_hash(parent: int, tokens: _IntSeq, lora_id: int | None = None) -> int:
    """xxh3-64 over parent (u64 LE) || tokens (u32 LE) || lora_id (u64 LE, when given)."""

def encode_event_batch(
    events: Sequence[tuple[Any, ...]],
    ts: float,
    *,
    medium: str | None = None,
    data_parallel_rank: int | None = None,
    hashes_as_bytes: bool = False,
) -> bytes:
    """Raw event tuples (as ``drain_raw_events`` returns) as one msgpack ``KVEventBatch``,
    byte-identical to msgspec encoding the same vLLM structs."""

@final
class BlockRegion:
    """A host memory region split into blocks, registered once from the memory object itself.

    ``memory`` is a C-contiguous numpy array or a plain contiguous CPU ``torch.Tensor`` (its
    address, size, dtype and device are read from the object, which the region keeps alive).
    Block ``id`` (``0 <= id < num_blocks``) is the bytes ``offset + id * stride ..
    + block_bytes`` (``stride`` defaults to ``block_bytes``); the whole layout is checked to lie
    inside the memory.
    """

    def __new__(
        cls, memory: Any, *, block_bytes: int, num_blocks: int, stride: int | None = None, offset: int = 0
    ) -> Self: ...
    @property
    def memory(self) -> Any: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def writable(self) -> bool: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def offset(self) -> int: ...

def copy_blocks(src: BlockRegion, dst: BlockRegion, src_blocks: _IntSeq, dst_blocks: _IntSeq, threads: int = 1) -> int:
    """Copies block ``src_blocks[i]`` of ``src`` into block ``dst_blocks[i]`` of ``dst`` for
    every i; returns the bytes copied.

    No address crosses this call: ids are checked against the regions' block counts, the
    regions' memory is re-read from their objects (it must not have moved or shrunk), block
    sizes must match, the dst memory must be writable and the two memories distinct, and no dst
    block may be written twice; any failure raises ``InvalidArgumentError`` having copied
    nothing. Runs of consecutive blocks become one memcpy; copies over 4 MiB are split across
    up to ``threads`` threads. The GIL is released during the copy.
    """

@final
class SlotInfo:
    @property
    def committed(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def lookahead(self) -> int: ...
    @property
    def reserved_lookahead(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_immutable(self) -> int: ...
    @property
    def capacity(self) -> int: ...

@disjoint_base
class SlotManager:
    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        hash_seed: int = 0,
        enable_prefix_caching: bool = True,
        max_tokens_per_slot: int | None = None,
    ) -> Self: ...
    def create(
        self,
        request_id: str,
        prompt: _IntSeq,
        *,
        lookahead: int = 0,
        match_prefix: bool = True,
        lora_id: int | None = None,
    ) -> int:
        """Creates a slot; returns the number of prompt tokens matched from the prefix cache."""
    def slot_id(self, request_id: str) -> int:
        """Handle for :meth:`step` (rejected once the request finishes)."""
    def reserve(self, request_id: str, new_tokens: int) -> int:
        """Room for ``new_tokens`` pending positions plus the lookahead; returns blocks allocated."""
    def commit(self, request_id: str, tokens: _IntSeq) -> int:
        """Commits verified tokens; returns the number of blocks that became immutable."""
    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Rolls back rejected speculative tokens."""
    def set_lookahead(self, request_id: str, lookahead: int) -> int:
        """Sets K; returns the number of surplus blocks freed when it shrinks."""
    def finish(self, request_id: str) -> None: ...
    def evict(self, num_blocks: int) -> int: ...
    def clear_cache(self) -> int: ...
    def step(
        self,
        slot_ids: _IntSeq,
        num_accepted: _IntSeq,
        accepted_tokens: _IntSeq,
        num_rejected: _IntSeq,
        num_new_tokens: _IntSeq,
        lookahead: _IntSeq | None = None,
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
        """One engine step for a batch; returns (num_new_blocks, new_block_ids, num_committed_blocks)."""
    def block_table(self, request_id: str) -> list[int]: ...
    def slot_info(self, request_id: str) -> SlotInfo: ...
    def committed_tokens(self, request_id: str) -> list[int]: ...
    def block_hashes(self, request_id: str) -> list[int]: ...
    def request_ids(self) -> list[str]: ...
    def registered_hashes(self) -> list[int]: ...
    def lookup(self, block_hash: int) -> int | None: ...
    def registered_hash(self, block_id: int) -> int | None: ...
    def refcount(self, block_id: int) -> int: ...
    def cached_blocks(self) -> list[int]: ...
    def stats(self) -> dict[str, int]: ...
    def drain_raw_events(self) -> list[tuple[Any, ...]]: ...
    def events_msgpack(
        self,
        ts: float,
        medium: str | None = None,
        data_parallel_rank: int | None = None,
        hashes_as_bytes: bool = False,
    ) -> bytes:
        """Queued events as one msgpack ``KVEventBatch`` (vLLM's wire format); the queue stays."""
    def drain_events_msgpack(
        self,
        ts: float,
        medium: str | None = None,
        data_parallel_rank: int | None = None,
        hashes_as_bytes: bool = False,
    ) -> bytes:
        """Like ``events_msgpack``, then empties the queue."""
    def num_pending_events(self) -> int: ...
    def discard_events(self) -> int:
        """Drops the queued events without converting them; returns how many there were."""
    def check_invariants(self) -> str | None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_seed(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_held(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @staticmethod
    def metadata_bytes_per_block() -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, request_id: str, /) -> bool: ...

@final
class SlotTracker:
    def __new__(cls, block_size: int, *, hash_seed: int = 0) -> Self: ...
    def add(self, request_id: str, *, lookahead: int = 0, lora_id: int | None = None) -> None: ...
    def blocks_needed(self, request_id: str, new_tokens: int) -> int: ...
    def reserve(self, request_id: str, new_tokens: int, new_blocks: _IntSeq) -> None: ...
    def commit(
        self, request_id: str, tokens: _IntSeq, block_hashes: _IntSeq | None = None
    ) -> list[tuple[int, int, int]]: ...
    def rollback(self, request_id: str, num_tokens: int) -> None: ...
    def set_lookahead(self, request_id: str, lookahead: int) -> list[int]: ...
    def finish(self, request_id: str) -> list[int]: ...
    def slot_info(self, request_id: str) -> SlotInfo: ...
    def block_table(self, request_id: str) -> list[int]: ...
    def block_hashes(self, request_id: str) -> list[int]: ...
    def check_invariants(self) -> str | None: ...
    def __len__(self) -> int: ...

@final
class HostCache:
    """The host-memory tier, keyed by external (vLLM) block hashes.

    Stores are two-phase: ``begin_store`` takes host blocks (evicting LRU cached ones) that stay
    invisible to lookups until ``complete_store`` registers them and queues ``BlockStored``.
    Loads pin their blocks from ``begin_load`` to ``end_load``.
    """

    def __new__(cls, num_blocks: int, block_size: int) -> Self: ...
    def match_prefix(self, block_hashes: _IntSeq) -> int: ...
    def contains(self, block_hash: int) -> bool: ...
    def num_pending_events(self) -> int: ...
    def lookup(self, block_hash: int) -> int | None: ...
    def begin_load(self, request_id: str, block_hashes: _IntSeq) -> list[int]: ...
    def end_load(self, blocks: _IntSeq) -> None: ...
    def begin_store(self, block_hashes: _IntSeq) -> list[tuple[int, int, int]]: ...
    def complete_store(
        self,
        stores: list[tuple[int, int]],
        parent_block_hash: int | None,
        token_ids: _IntSeq,
        lora_id: int | None = None,
    ) -> None: ...
    def begin_store_run(
        self,
        step: int,
        block_hashes: _IntSeq,
        parent_block_hash: int | None,
        token_ids: _IntSeq,
        lora_id: int | None = None,
    ) -> list[tuple[int, int]]: ...
    def complete_step(self, step: int, failed_blocks: list[int] = ...) -> int: ...
    @property
    def pending_steps(self) -> int: ...
    def abort_store(self, stores: list[tuple[int, int]]) -> None: ...
    def clear(self) -> int: ...
    def drain_raw_events(self) -> list[tuple[Any, ...]]: ...
    def events_msgpack(
        self,
        ts: float,
        medium: str | None = ...,
        data_parallel_rank: int | None = None,
        hashes_as_bytes: bool = False,
    ) -> bytes:
        """Queued events as one msgpack ``KVEventBatch`` (vLLM's wire format); the queue stays.
        The host tier's medium defaults to "CPU"."""
    def drain_events_msgpack(
        self,
        ts: float,
        medium: str | None = ...,
        data_parallel_rank: int | None = None,
        hashes_as_bytes: bool = False,
    ) -> bytes:
        """Like ``events_msgpack``, then empties the queue."""
    def registered_hashes(self) -> list[int]: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> str | None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_held(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_storing(self) -> int: ...

# ---- prefix index of `kvslots indexer` ----

@final
class ApplyStats:
    """What one `PrefixIndex.apply` did; skipped events and blocks are counted, never raised."""

    @property
    def events(self) -> int: ...
    @property
    def stored_blocks(self) -> int: ...
    @property
    def removed_blocks(self) -> int: ...
    @property
    def cleared(self) -> int: ...
    @property
    def orphan_blocks(self) -> int: ...
    @property
    def unresolved_blocks(self) -> int: ...
    @property
    def invalid_events(self) -> int: ...
    @property
    def unknown_events(self) -> int: ...
    @property
    def unknown_medium_events(self) -> int: ...

@final
class PrefixIndex:
    """Which (worker, tier) holds which block, keyed by a chained token hash. Thread-safe."""

    def __new__(
        cls,
        *,
        capacity: int | None = None,
        tier_weights: dict[str, float] | None = None,
        hash_seed: int = 0,
        journal: bool = False,
    ) -> Self: ...
    def add_worker(self, name: str) -> None: ...
    def remove_worker(self, name: str) -> int: ...
    def clear_worker(self, name: str) -> int: ...
    def workers(self) -> list[str]: ...
    def worker_len(self, name: str) -> int: ...
    def apply(self, worker: str, payload: bytes, default_tier: str = "GPU") -> ApplyStats:
        """Decodes one msgpack KVEventBatch and applies it; EventDecodeError applies nothing."""
    def lookup(
        self, token_ids: _IntSeq, block_size: int, lora_id: int | None = None, lora_name: str | None = None
    ) -> list[tuple[str, int, _TierBlocks, float]]:
        """(worker, blocks, [gpu, cpu, storage] blocks, score) per worker holding block 0."""
    def chain_keys(
        self, token_ids: _IntSeq, block_size: int, lora_id: int | None = None, lora_name: str | None = None
    ) -> list[int]: ...
    def score_blocks(self, blocks: list[dict[str, int]]) -> list[tuple[str, int, _TierBlocks, float]]: ...
    def take_changes(
        self,
    ) -> tuple[list[tuple[str, int, int | None, _TierBlocks]], list[tuple[int, str, int]]]: ...
    def dump(self) -> list[tuple[str, int, int, _TierBlocks]]: ...
    def load(self, worker: str, entries: Sequence[tuple[int, int, Sequence[int]]]) -> None: ...
    def stats(self) -> dict[str, int | None]: ...
    @property
    def tier_weights(self) -> list[tuple[str, float]]: ...
    @property
    def capacity(self) -> int | None: ...
    def check_invariants(self) -> str | None: ...
    def __len__(self) -> int: ...

def lora_key(name: str) -> int:
    """The LoRA key a lookup uses for a LoRA given by name only."""
