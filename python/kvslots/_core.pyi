"""Type stubs for the Rust extension ``kvslots._core``."""

from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

__version__: str

IntSeq = Sequence[int] | npt.NDArray[np.integer[Any]]

def block_hash(parent: int, tokens: IntSeq, lora_id: int | None = None) -> int:
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

def copy_blocks(
    src_addr: int,
    src_len: int,
    src_offset: int,
    src_stride: int,
    dst_addr: int,
    dst_len: int,
    dst_offset: int,
    dst_stride: int,
    block_bytes: int,
    src_blocks: IntSeq,
    dst_blocks: IntSeq,
    threads: int = 1,
) -> int:
    """Copies whole blocks between two host memory regions; returns the bytes copied.

    For every i: ``dst[dst_offset + dst_blocks[i]*dst_stride :][:block_bytes] =
    src[src_offset + src_blocks[i]*src_stride :][:block_bytes]``. Regions are raw addresses
    (torch ``data_ptr()``) and lengths in bytes. Every range is checked first: an out-of-range or
    negative id, overlapping destination blocks or overlapping regions raise
    ``InvalidArgumentError`` and copy nothing. Runs of consecutive blocks become one memcpy;
    copies over 4 MiB are split across up to ``threads`` threads. The GIL is released.

    Unsafe by contract: the addresses cannot be verified, so the caller must pass live host
    memory that nothing else writes during the call (``kvslots.transfer.BlockCopier`` does).
    """

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

class SlotManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_seed: int = 0,
        enable_prefix_caching: bool = True,
        max_tokens_per_slot: int | None = None,
    ) -> None: ...
    def create(
        self,
        request_id: str,
        prompt: IntSeq,
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
    def commit(self, request_id: str, tokens: IntSeq) -> int:
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
        slot_ids: IntSeq,
        num_accepted: IntSeq,
        accepted_tokens: IntSeq,
        num_rejected: IntSeq,
        num_new_tokens: IntSeq,
        lookahead: IntSeq | None = None,
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
    def __contains__(self, request_id: str) -> bool: ...

class SlotTracker:
    def __init__(self, block_size: int, *, hash_seed: int = 0) -> None: ...
    def add(self, request_id: str, *, lookahead: int = 0, lora_id: int | None = None) -> None: ...
    def blocks_needed(self, request_id: str, new_tokens: int) -> int: ...
    def reserve(self, request_id: str, new_tokens: int, new_blocks: IntSeq) -> None: ...
    def commit(
        self, request_id: str, tokens: IntSeq, block_hashes: IntSeq | None = None
    ) -> list[tuple[int, int, int]]: ...
    def rollback(self, request_id: str, num_tokens: int) -> None: ...
    def set_lookahead(self, request_id: str, lookahead: int) -> list[int]: ...
    def finish(self, request_id: str) -> list[int]: ...
    def slot_info(self, request_id: str) -> SlotInfo: ...
    def block_table(self, request_id: str) -> list[int]: ...
    def block_hashes(self, request_id: str) -> list[int]: ...
    def __len__(self) -> int: ...

class HostCache:
    """The host-memory tier, keyed by external (vLLM) block hashes.

    Stores are two-phase: ``begin_store`` takes host blocks (evicting LRU cached ones) that stay
    invisible to lookups until ``complete_store`` registers them and queues ``BlockStored``.
    Loads pin their blocks from ``begin_load`` to ``end_load``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None: ...
    def match_prefix(self, block_hashes: IntSeq) -> int: ...
    def contains(self, block_hash: int) -> bool: ...
    def num_pending_events(self) -> int: ...
    def lookup(self, block_hash: int) -> int | None: ...
    def begin_load(self, request_id: str, block_hashes: IntSeq) -> list[int]: ...
    def end_load(self, blocks: IntSeq) -> None: ...
    def begin_store(self, block_hashes: IntSeq) -> list[tuple[int, int, int]]: ...
    def complete_store(
        self,
        stores: list[tuple[int, int]],
        parent_block_hash: int | None,
        token_ids: IntSeq,
        lora_id: int | None = None,
    ) -> None: ...
    def begin_store_run(
        self,
        step: int,
        block_hashes: IntSeq,
        parent_block_hash: int | None,
        token_ids: IntSeq,
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
        medium: str | None = "CPU",
        data_parallel_rank: int | None = None,
        hashes_as_bytes: bool = False,
    ) -> bytes:
        """Queued events as one msgpack ``KVEventBatch`` (vLLM's wire format); the queue stays.
        The host tier's medium defaults to "CPU"."""
    def drain_events_msgpack(
        self,
        ts: float,
        medium: str | None = "CPU",
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
