"""A pure-Python reference model of the slot manager: small, obviously correct, slow.

It has the same API and the same observable behaviour as the Rust ``SlotManager`` (block ids
handed out, hashes, events, errors), and serves as the oracle in tests and as a baseline in
benchmarks. Allocation order is part of that behaviour: free blocks come off a stack (block 0
first), cached blocks are evicted least recently used first, and a finished request's blocks are
released tail first.
"""

from __future__ import annotations

import functools
import operator
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

from .. import _core
from ..errors import (
    ArgumentTypeError,
    CapacityExceededError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRollbackError,
    KVSlotsError,
    NoCopy,
    OutOfBlocksError,
    UnknownRequestError,
    short_repr,
)

U32 = 2**32
U64 = 2**64
MAX_BLOCKS = 2**31  # pools hold fewer blocks than this (the engine's refcount word keeps a flag bit)


def block_hash(parent: int, tokens: Sequence[int], lora_id: int | None = None) -> int:
    """xxh3-64 over parent (u64 LE) || tokens (u32 LE) || lora_id (u64 LE, when given)."""
    data = struct.pack("<Q", parent) + struct.pack(f"<{len(tokens)}I", *tokens)
    if lora_id is not None:
        data += struct.pack("<Q", lora_id)
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class SlotInfo:
    committed: int
    pending: int
    lookahead: int
    reserved_lookahead: int
    num_blocks: int
    num_immutable: int
    capacity: int


@dataclass
class _Slot:
    request_id: str
    lora_id: int | None
    lookahead: int
    tokens: list[int] = field(default_factory=list)
    pending: int = 0
    reserved_lookahead: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


# ---- argument rules: the same as the extension's (rust/python/src/convert.rs) ----
#
# An integer is an ``int`` (not a ``bool``) or an object with ``__index__``; a float is refused.
# A flag is a ``bool``. A request id is a ``str`` that encodes as UTF-8. An integer sequence is a
# 1-D numpy array of an integer (or object) dtype, or any iterable of integers but a ``str``.
# Wrong types raise ArgumentTypeError, values out of range InvalidArgumentError.


def _ceil_div(a: int, b: int) -> int:
    """Exact ceil(a / b) for ints of any size (no float rounding)."""
    return -(-a // b)


#: Longest request id a message quotes whole, in characters (the core's SHOWN_ID_CHARS).
SHOWN_ID_CHARS = 64


def _shown(request_id: str) -> str:
    """A request id as a message quotes it: whole up to SHOWN_ID_CHARS characters, else its
    start and its length (the core's ``error::shown``)."""
    if len(request_id) <= SHOWN_ID_CHARS:
        return repr(request_id)
    return f"{request_id[:SHOWN_ID_CHARS]!r}... ({len(request_id)} characters)"


def _where(request_id: str | None) -> str:
    return f" for request {_shown(request_id)}" if request_id is not None else ""


def _int(value: Any, what: str, lo: int, hi: int, request_id: str | None = None) -> int:
    if isinstance(value, (bool, float)) or type(value).__name__ in ("bool_", "bool"):
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be an int, got "
                                f"{type(value).__name__} {short_repr(value)}", request_id)
    try:
        v = operator.index(value)
        if not isinstance(value, int) and isinstance(type(value).__index__(value), bool):
            # operator.index turns an __index__ returning True into 1 (a DeprecationWarning only);
            # the Rust core refuses it, as it refuses a bool.
            raise TypeError
    except TypeError:
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be an int, got "
                                f"{type(value).__name__}", request_id) from None
    except KVSlotsError:
        raise
    except Exception as e:
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be an int", request_id) from e
    if not lo <= v < hi:
        if v < 0 <= lo:
            raise InvalidArgumentError(f"invalid argument{_where(request_id)}: {what} must be >= 0, got {v}",
                                       request_id)
        raise InvalidArgumentError(f"invalid argument{_where(request_id)}: {what} = {v} is out of range",
                                   request_id)
    return v


def _count(value: Any, what: str, request_id: str | None = None) -> int:
    return _int(value, what, 0, U64, request_id)


def _opt_int(value: Any, what: str, hi: int, request_id: str | None = None) -> int | None:
    return None if value is None else _int(value, what, 0, hi, request_id)


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"invalid argument: {what} must be a bool, got {type(value).__name__} {short_repr(value)}")
    return value


def _request_id(value: Any) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"invalid argument: request_id must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"invalid argument: request_id must be valid Unicode text, got {short_repr(value)}") from None
    # Its text as an exact str: a subclass's own __hash__ / __eq__ must not steer the dict
    # lookups (the extension reads only the text).
    return str.__str__(value)


def _next_item(i: int, what: str, request_id: str | None) -> None:
    if i >= _core.MAX_ITER_ITEMS:
        raise InvalidArgumentError(f"invalid argument{_where(request_id)}: {what} gives more than "
                                   f"{_core.MAX_ITER_ITEMS} items (an endless iterator?); pass a list or a numpy array",
                                   request_id)


def _ints(values: Any, what: str, bound: int, request_id: str | None = None) -> list[int]:
    kind = getattr(getattr(values, "dtype", None), "kind", None)
    if kind is not None and hasattr(values, "ndim"):
        if values.ndim != 1:
            raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be a 1-D array", request_id)
        if kind not in "iuO":
            raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be integers, got dtype "
                                    f"{values.dtype}", request_id)
        values = values.tolist() if kind in "iu" else list(values)
    if isinstance(values, str):
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be a sequence of integers",
                                request_id)
    if isinstance(values, (list, tuple)):
        # Read in place, as the extension does (a subclass's own __iter__ / __len__ is not
        # called); the length is re-read after each item, whose __index__ may change the list.
        base: Any = list if isinstance(values, list) else tuple
        out: list[int] = []
        while len(out) < base.__len__(values):
            i = len(out)
            _next_item(i, what, request_id)
            out.append(_int(base.__getitem__(values, i), f"{what}[{i}]", 0, bound, request_id))
        return out
    try:
        items = iter(values)
    except TypeError:
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be a sequence of integers",
                                request_id) from None
    except KVSlotsError:
        raise
    except Exception as e:
        raise ArgumentTypeError(f"invalid argument{_where(request_id)}: {what} must be a sequence of integers",
                                request_id) from e
    out = []
    i = 0
    while True:
        _next_item(i, what, request_id)
        try:
            v = next(items)
        except StopIteration:
            break
        except KVSlotsError:
            raise
        except Exception as e:
            raise InvalidArgumentError(f"invalid argument{_where(request_id)}: {what}: iterating it raised an error",
                                       request_id) from e
        out.append(_int(v, f"{what}[{i}]", 0, bound, request_id))
        i += 1
    return out


class ReferenceSlotManager(NoCopy):
    """Same contract as :class:`kvslots.SlotManager`, in plain Python."""

    # As the extension's SlotManager (the model agrees with it): copy.copy shared its lists and
    # dicts, so a slot made on the copy held the original's blocks.
    _copy_refusal = "it holds a block pool and request state; make a new manager"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_seed: int = 0,
        enable_prefix_caching: bool = True,
        max_tokens_per_slot: int | None = None,
    ) -> None:
        hash_seed = _int(hash_seed, "hash_seed", 0, U64)
        enable_prefix_caching = _flag(enable_prefix_caching, "enable_prefix_caching")
        num_blocks = _count(num_blocks, "num_blocks")
        block_size = _count(block_size, "block_size")
        max_tokens_per_slot = _opt_int(max_tokens_per_slot, "max_tokens_per_slot", U64)
        if not 1 <= block_size < U32:
            raise InvalidArgumentError(f"invalid argument: block_size must be in [1, {U32 - 1}], got {block_size}")
        if num_blocks >= MAX_BLOCKS:
            raise InvalidArgumentError(f"invalid argument: num_blocks must be below {MAX_BLOCKS} (got {num_blocks})")
        if max_tokens_per_slot == 0:
            raise InvalidArgumentError("invalid argument: max_tokens_per_slot must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.max_tokens_per_slot = max_tokens_per_slot
        # One call at a time, as the extension serializes its callers (threads interleaving in
        # create / finish / step raised raw KeyErrors and left blocks held by no request).
        # Re-entrant: an argument's __index__ may call back, as the extension allows too.
        self._lock = threading.RLock()
        self._refcount = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # registered block -> hash
        self._registry: dict[int, int] = {}  # hash -> block
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._slots: dict[str, _Slot] = {}
        self._slab: list[str | None] = []
        self._gen: list[int] = []
        self._free_slab: list[int] = []
        self._events: list[tuple[Any, ...]] = []
        self._stats = dict.fromkeys(
            [
                "requests_created", "requests_finished", "prefix_hit_tokens", "committed_tokens",
                "committed_blocks", "registered_blocks", "rolled_back_tokens", "allocated_blocks",
                "released_blocks", "evicted_blocks",
            ],
            0,
        )

    # ---- queries ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def usage(self) -> float:
        return self.num_held / self.num_blocks if self.num_blocks else 0.0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: str) -> bool:
        return _request_id(request_id) in self._slots

    def _slot(self, request_id: str) -> _Slot:
        request_id = _request_id(request_id)
        try:
            return self._slots[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request {_shown(request_id)}", request_id) from None

    def slot_id(self, request_id: str) -> int:
        i = self._slab.index(self._slot(request_id).request_id)
        return (self._gen[i] << 32) | i

    def slot_info(self, request_id: str) -> SlotInfo:
        s = self._slot(request_id)
        return SlotInfo(len(s.tokens), s.pending, s.lookahead, s.reserved_lookahead, len(s.blocks),
                        len(s.hashes), len(s.blocks) * self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._slot(request_id).blocks)

    def committed_tokens(self, request_id: str) -> list[int]:
        return list(self._slot(request_id).tokens)

    def block_hashes(self, request_id: str) -> list[int]:
        return list(self._slot(request_id).hashes)

    def request_ids(self) -> list[str]:
        return list(self._slots)

    def registered_hashes(self) -> list[int]:
        return sorted(self._registry)

    def lookup(self, block_hash: int) -> int | None:
        return self._registry.get(_int(block_hash, "block_hash", 0, U64))

    def _block_id(self, block_id: Any) -> int:
        b = _int(block_id, "block_id", 0, U32)
        if b >= self.num_blocks:
            raise InvalidArgumentError(f"invalid argument: block id {b} is outside the pool of {self.num_blocks} blocks")
        return b

    def registered_hash(self, block_id: int) -> int | None:
        return self._hash_of.get(self._block_id(block_id))

    def refcount(self, block_id: int) -> int:
        return self._refcount[self._block_id(block_id)]

    def cached_blocks(self) -> list[int]:
        return list(self._lru)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def drain_raw_events(self) -> list[tuple[Any, ...]]:
        out, self._events = self._events, []
        return out

    def num_pending_events(self) -> int:
        return len(self._events)

    def discard_events(self) -> int:
        n = len(self._events)
        self._events.clear()
        return n

    # ---- pool primitives ----
    def _available(self) -> int:
        return len(self._free) + len(self._lru)

    def _allocate(self, n: int, into: list[int]) -> None:
        evicted = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                h = self._hash_of.pop(b)
                del self._registry[h]
                evicted.append(h)
            self._refcount[b] = 1
            into.append(b)
        self._stats["allocated_blocks"] += n
        self._removed(evicted)

    def _removed(self, hashes: list[int]) -> None:
        if hashes:
            self._stats["evicted_blocks"] += len(hashes)
            self._events.append(("BlockRemoved", hashes))

    def _pin(self, b: int) -> None:
        if self._refcount[b] == 0:
            del self._lru[b]
        self._refcount[b] += 1

    def _unpin(self, b: int) -> None:
        self._refcount[b] -= 1
        if self._refcount[b] == 0:
            if b in self._hash_of:
                self._lru[b] = None
            else:
                self._free.append(b)

    def _check_len(self, s: _Slot, tokens: int) -> None:
        if self.max_tokens_per_slot is not None and tokens > self.max_tokens_per_slot:
            raise CapacityExceededError(
                f"capacity exceeded for request {_shown(s.request_id)}: tokens exceed max_tokens_per_slot "
                f"({tokens} > {self.max_tokens_per_slot})",
                s.request_id,
                {"requested": tokens, "limit": self.max_tokens_per_slot},
            )

    def _out_of_blocks(self, request_id: str, needed: int, available: int) -> OutOfBlocksError:
        return OutOfBlocksError(
            f"out of blocks for request {_shown(request_id)}: needs {needed} more block(s), only {available} "
            f"free or evictable in a pool of {self.num_blocks}",
            request_id,
            {"needed": needed, "available": available, "total": self.num_blocks},
        )

    def _check_commit(self, s: _Slot, n: int) -> None:
        if n > s.pending:
            raise CapacityExceededError(
                f"capacity exceeded for request {_shown(s.request_id)}: committed tokens exceed the pending "
                f"positions ({n} > {s.pending})",
                s.request_id,
                {"requested": n, "limit": s.pending},
            )

    def _rollback_error(self, s: _Slot, n: int, pending: int, committed: int) -> InvalidRollbackError:
        return InvalidRollbackError(
            f"invalid rollback for request {_shown(s.request_id)}: cannot roll back {n} token(s), only "
            f"{pending} speculative token(s) are pending after {committed} committed",
            s.request_id,
            {"requested": n, "pending": pending, "committed": committed},
        )

    # ---- operations ----
    def create(self, request_id: str, prompt: Sequence[int], *, lookahead: int = 0, match_prefix: bool = True,
               lora_id: int | None = None) -> int:
        k = _count(lookahead, "lookahead")
        match_prefix = _flag(match_prefix, "match_prefix")
        request_id = _request_id(request_id)
        prompt = _ints(prompt, "prompt", U32, request_id)
        lora_id = _opt_int(lora_id, "lora_id", U64, request_id)
        if request_id in self._slots:
            raise DuplicateRequestError(f"request {_shown(request_id)} already has a slot", request_id)
        s = _Slot(request_id, lora_id, k)
        self._check_len(s, len(prompt))
        bs = self.block_size
        if match_prefix and self.enable_prefix_caching:
            parent = self.hash_seed
            for i in range(max(len(prompt) - 1, 0) // bs):
                h = block_hash(parent, prompt[i * bs:(i + 1) * bs], lora_id)
                if h not in self._registry:
                    break
                s.blocks.append(self._registry[h])
                s.hashes.append(h)
                parent = h
            for b in s.blocks:
                self._pin(b)
            s.tokens = prompt[: len(s.blocks) * bs]
        if self._free_slab:
            i = self._free_slab.pop()
            self._gen[i] = (self._gen[i] + 1) % U32
            self._slab[i] = request_id
        else:
            self._slab.append(request_id)
            self._gen.append(0)
        self._slots[request_id] = s
        self._stats["requests_created"] += 1
        self._stats["prefix_hit_tokens"] += len(s.tokens)
        return len(s.tokens)

    def reserve(self, request_id: str, new_tokens: int) -> int:
        request_id = _request_id(request_id)
        n = _count(new_tokens, "new_tokens", request_id)
        s = self._slot(request_id)
        self._check_len(s, len(s.tokens) + s.pending + n)
        target = _ceil_div(len(s.tokens) + s.pending + n + s.lookahead, self.block_size)
        extra = max(target - len(s.blocks), 0)
        if extra > self._available():
            raise self._out_of_blocks(request_id, extra, self._available())
        self._allocate(extra, s.blocks)
        s.pending += n
        s.reserved_lookahead = s.lookahead
        return extra

    def commit(self, request_id: str, tokens: Sequence[int]) -> int:
        request_id = _request_id(request_id)
        tokens = _ints(tokens, "tokens", U32, request_id)
        s = self._slot(request_id)
        self._check_commit(s, len(tokens))
        return self._commit(s, tokens)

    def _commit(self, s: _Slot, tokens: list[int]) -> int:
        bs = self.block_size
        s.tokens.extend(tokens)
        s.pending -= len(tokens)
        run: list[int] = []
        run_parent: int | None = None
        first = len(s.hashes)
        full = len(s.tokens) // bs

        def close() -> None:
            if run:
                block_tokens = s.tokens[run_start * bs:(run_start + len(run)) * bs]
                self._events.append(("BlockStored", list(run), run_parent, block_tokens, bs, s.lora_id))
                run.clear()

        run_start = first
        for b in range(first, full):
            parent = self.hash_seed if b == 0 else s.hashes[b - 1]
            h = block_hash(parent, s.tokens[b * bs:(b + 1) * bs], s.lora_id)
            s.hashes.append(h)
            block = s.blocks[b]
            if self.enable_prefix_caching and h not in self._registry and block not in self._hash_of:
                if not run:
                    run_start, run_parent = b, (parent if b > 0 else None)
                run.append(h)
                self._registry[h] = block
                self._hash_of[block] = h
                self._stats["registered_blocks"] += 1
            else:
                close()
        close()
        self._stats["committed_tokens"] += len(tokens)
        self._stats["committed_blocks"] += full - first
        return full - first

    def rollback(self, request_id: str, num_tokens: int) -> None:
        request_id = _request_id(request_id)
        n = _count(num_tokens, "num_tokens", request_id)
        s = self._slot(request_id)
        if n > s.pending:
            raise self._rollback_error(s, n, s.pending, len(s.tokens))
        s.pending -= n
        self._stats["rolled_back_tokens"] += n

    def _surplus(self, s: _Slot, tokens: int) -> int:
        keep = max(_ceil_div(tokens, self.block_size), len(s.hashes))
        return max(len(s.blocks) - keep, 0)

    def _shrink(self, s: _Slot, surplus: int) -> None:
        for _ in range(surplus):
            self._unpin(s.blocks.pop())
        self._stats["released_blocks"] += surplus

    def set_lookahead(self, request_id: str, lookahead: int) -> int:
        request_id = _request_id(request_id)
        k = _count(lookahead, "lookahead", request_id)
        s = self._slot(request_id)
        s.lookahead = k
        if k >= s.reserved_lookahead:
            return 0
        s.reserved_lookahead = k
        surplus = self._surplus(s, len(s.tokens) + s.pending + k)
        self._shrink(s, surplus)
        return surplus

    def finish(self, request_id: str) -> None:
        s = self._slot(request_id)
        request_id = s.request_id
        del self._slots[request_id]
        for b in reversed(s.blocks):
            self._unpin(b)
        self._stats["released_blocks"] += len(s.blocks)
        self._stats["requests_finished"] += 1
        i = self._slab.index(request_id)
        self._slab[i] = None
        self._free_slab.append(i)

    def evict(self, num_blocks: int) -> int:
        n = _count(num_blocks, "num_blocks")
        evicted: list[int] = []
        while len(evicted) < n and self._lru:
            b, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._registry[h]
            evicted.append(h)
            self._free.append(b)
        self._removed(evicted)
        return len(evicted)

    def clear_cache(self) -> int:
        n = len(self._registry)
        for b in list(self._lru):
            self._free.append(b)
        self._lru.clear()
        self._registry.clear()
        self._hash_of.clear()
        self._events.append(("AllBlocksCleared",))
        return n

    def _resolve(self, slot_id: int) -> _Slot:
        gen, i = slot_id >> 32, slot_id & (U32 - 1)
        if i < len(self._slab) and self._slab[i] is not None and self._gen[i] == gen:
            return self._slots[self._slab[i]]  # type: ignore[index]
        raise InvalidArgumentError(f"invalid argument: slot id {slot_id} does not name a live slot")

    def step(self, slot_ids: Sequence[int], num_accepted: Sequence[int], accepted_tokens: Sequence[int],
             num_rejected: Sequence[int], num_new_tokens: Sequence[int],
             lookahead: Sequence[int] | None = None) -> tuple[list[int], list[int], list[int]]:
        ids = _ints(slot_ids, "slot_ids", U64)
        acc = _ints(num_accepted, "num_accepted", U32)
        toks = _ints(accepted_tokens, "accepted_tokens", U32)
        rej = _ints(num_rejected, "num_rejected", U32)
        new = _ints(num_new_tokens, "num_new_tokens", U32)
        look = None if lookahead is None else _ints(lookahead, "lookahead", U32)
        n = len(ids)
        if not (len(acc) == len(rej) == len(new) == n and (look is None or len(look) == n)):
            raise InvalidArgumentError("invalid argument: step arrays differ in length")
        if sum(acc) != len(toks):
            raise InvalidArgumentError(f"invalid argument: num_accepted sums to {sum(acc)} but accepted_tokens has {len(toks)} tokens")
        bs = self.block_size
        slots: list[_Slot] = []
        targets: list[int] = []
        freed = 0
        for j in range(n):
            s = self._resolve(ids[j])
            if any(s is t for t in slots):
                raise InvalidArgumentError(f"invalid argument for request {_shown(s.request_id)}: slot appears twice in one step", s.request_id)
            slots.append(s)
            self._check_commit(s, acc[j])
            if rej[j] > s.pending - acc[j]:
                raise self._rollback_error(s, rej[j], s.pending - acc[j], len(s.tokens) + acc[j])
            k = s.lookahead if look is None else look[j]
            filled = len(s.tokens) + s.pending - rej[j] + new[j]
            self._check_len(s, filled)
            target = _ceil_div(filled + k, bs)
            if target < len(s.blocks) and k < s.reserved_lookahead:
                freed += len(s.blocks) - target
            targets.append(target)
        available = self._available() + freed
        needed = 0
        for j, s in enumerate(slots):
            needed += max(targets[j] - len(s.blocks), 0)
            if needed > available:
                raise self._out_of_blocks(s.request_id, needed, available)
        committed, offset = [], 0
        for j, s in enumerate(slots):
            committed.append(self._commit(s, toks[offset:offset + acc[j]]))
            offset += acc[j]
            s.pending -= rej[j]
            self._stats["rolled_back_tokens"] += rej[j]
        for j, s in enumerate(slots):
            if look is not None:
                s.lookahead = look[j]
            if targets[j] < len(s.blocks) and s.lookahead < s.reserved_lookahead:
                self._shrink(s, len(s.blocks) - targets[j])
        num_new, new_ids = [], []
        for j, s in enumerate(slots):
            extra = max(targets[j] - len(s.blocks), 0)
            self._allocate(extra, s.blocks)
            s.pending += new[j]
            s.reserved_lookahead = s.lookahead
            new_ids.extend(s.blocks[len(s.blocks) - extra:])
            num_new.append(extra)
        return num_new, new_ids, committed


def _serialized(fn: Any) -> Any:
    @functools.wraps(fn)
    def call(self: ReferenceSlotManager, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kwargs)

    return call


# Every public method and property (and __len__ / __contains__) under the instance's lock.
for _name, _member in list(vars(ReferenceSlotManager).items()):
    if _name.startswith("_") and _name not in ("__len__", "__contains__"):
        continue
    if isinstance(_member, property):
        setattr(ReferenceSlotManager, _name, property(_serialized(_member.fget)))
    elif callable(_member):
        setattr(ReferenceSlotManager, _name, _serialized(_member))
del _name, _member
