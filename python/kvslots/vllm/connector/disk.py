"""The disk tier under the host tier: the connector's scheduler part (:class:`DiskScheduler`) and
worker part (:class:`DiskWorker`).

Spill. With a disk tier, the host tier (Rust ``HostCache``) keeps the tokens, parent and
successor of each block; a block it evicts is handed to :class:`DiskScheduler`, which takes a
disk slot for it (``DiskIndex.begin_write``) and ships ``(host block, slot, ...)`` in the step's
metadata. The worker copies the host block's bytes to its background writer *before* that step's
stores reuse the host block (both run in ``handle_preemptions``); a full writer queue drops the
spill. Finished writes travel back in the worker metadata and register the block on disk
(``BlockStored``, medium ``STORAGE``).

Hits. A lookup continues on disk where the host hit ends, with the EAGLE last-block rule applied
to the last block of the whole hit. A request whose hit reaches the disk loads **asynchronously**
(``load_kv_async=True``): vLLM parks it in ``WAITING_FOR_REMOTE_KVS`` while the rest of the batch
keeps running, and schedules it once the worker reports it received (``get_finished``). Its host
part is copied in the step it is planned for, its disk blocks are read on the worker's Rust
reader threads and copied to the device at a step boundary once read: the step that started the
read when it has no forward and the read ends within ``DiskWorker.IDLE_WAIT_S``, a later one
otherwise (see :class:`DiskWorker` for why that is safe). A record that fails its checksum is not loaded: its device blocks are reported as load
errors with the finished receive (vLLM recomputes them under ``kv_load_failure_policy:
"recompute"``), a warning is logged once per block, and the block leaves the index. Host-only
hits stay synchronous.

Promotion. The disk blocks of a hit are read into host blocks taken for them (``begin_promote``),
registered in the host tier once loaded (``BlockStored``, medium ``CPU``), and then leave the disk
tier (``BlockRemoved``, medium ``STORAGE``): a block lives in one tier at a time, both only while
it is copied. The same holds for a block the host tier stores again from the device. The record
stays readable in the file until its slot is reused, so a restart (host tier empty) may find it
again. A prefix-cache reset clears the disk tier too and wipes the file.

One worker rank (tensor parallel size 1): each rank would need its own file and the scheduler
would have to agree across them; the connector refuses a disk tier otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from ..._core import DiskIndex, DiskStore
from ..._args import text
from ...errors import ConfigError, DiskTierError, InvalidArgumentError, KVSlotsError
from ...config.connector import DISK_FILE_NAME
from ...config.loader import read_config_text

logger = logging.getLogger(__name__)

FILE_NAME = DISK_FILE_NAME  # one name, where kvslots serve's check of disk_path reads it too


@dataclass(frozen=True)
class DiskLayout:
    """What the disk file belongs to; the scheduler and the worker compute the same one."""

    num_layers: int
    bytes_per_block: int
    dtype: str
    fingerprint: int
    #: What the fingerprint hashes, by name (long values by their digest): logged, and kept
    #: beside the file, so that a restart that finds another fingerprint can say what changed.
    identity: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_config: Any, bytes_per_block: int) -> "DiskLayout":
        from ..compat import attention_backend, kv_cache_layout

        mc, cc = vllm_config.model_config, vllm_config.cache_config
        layers = sorted(n for g in kv_cache_config.kv_cache_groups for n in g.layer_names)
        dtype = str(cc.cache_dtype if cc.cache_dtype != "auto" else mc.dtype).replace("torch.", "")
        spec = vllm_config.speculative_config
        revision = getattr(mc, "revision", None)
        parts = [mc.model, str(revision), dtype, str(cc.block_size), ",".join(layers),
                 str(bytes_per_block), str(getattr(spec, "model", None) if spec is not None else None),
                 _weights_identity(mc.model, revision)]
        # How a block's bytes are laid out: the same model, dtype and block size in another
        # layout (VLLM_KV_CACHE_LAYOUT=NHD vs HND) has blocks of the same size whose bytes mean
        # something else. (A file written before these were hashed is started afresh once: its
        # layout cannot be told.)
        layout, backend = kv_cache_layout(vllm_config, kv_cache_config), attention_backend(vllm_config)
        parts += [f"kv_cache_layout={layout}", f"attention_backend={backend}"]
        fp = int.from_bytes(hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest(), "little")
        names = ("model", "revision", "dtype", "block size", "layers", "bytes per block", "drafter", "weights",
                 "KV-cache layout", "attention backend")
        shown = [parts[i] for i in range(8)] + [layout or "unknown", backend]
        identity = tuple((n, v if len(v) <= 80 else "digest " + hashlib.blake2b(v.encode(), digest_size=8).hexdigest())
                         for n, v in zip(names, shown))
        return cls(num_layers=len(layers), bytes_per_block=bytes_per_block, dtype=dtype[:32], fingerprint=fp,
                   identity=identity)

    def kwargs(self) -> dict[str, Any]:
        return dict(num_layers=self.num_layers, bytes_per_block=self.bytes_per_block, dtype=self.dtype,
                    fingerprint=self.fingerprint)


IDENTITY_SUFFIX = ".identity.json"
_IDENTITY_MAX_BYTES = 64 * 1024


def _what_changed(path: str, layout: DiskLayout) -> str:
    """For the log line of a file whose fingerprint differs: what differs from the identity
    kept beside it by the engine that wrote it, else this engine's KV-cache layout and
    attention backend. The kept file is only read for this
    message: it decides nothing."""
    if not layout.identity:
        return ""
    mine = dict(layout.identity)
    raw = _read_small(path + IDENTITY_SUFFIX, _IDENTITY_MAX_BYTES)
    try:
        old = msgspec.json.decode(raw, type=dict[str, str]) if raw is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        old = None
    if old is not None:
        changed = [f"{k} {old[k]!r} -> {v!r}" for k, v in mine.items() if k in old and old[k] != v]
        if changed:
            return " (" + "; ".join(changed) + ")"
    return (f" (this engine: KV-cache layout {mine.get('KV-cache layout')}, attention backend "
            f"{mine.get('attention backend')}, model {mine.get('model')!r})")


def _keep_identity(path: str, layout: DiskLayout) -> None:
    """Keeps what the file's fingerprint hashes beside it (for :func:`_what_changed`)."""
    if not layout.identity:
        return
    data = msgspec.json.encode(dict(layout.identity))
    target = path + IDENTITY_SUFFIX
    if _read_small(target, len(data)) == data:
        return
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a stale one (or a link or FIFO put there): never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except OSError as e:  # a message helper only: the tier works without it
        logger.debug("kvslots disk tier: cannot write %s: %s", target, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read_small(path: str, limit: int) -> bytes | None:
    """A regular file's bytes if it has at most ``limit`` of them, else None, under the config
    files' reading rules (:func:`read_config_text`: opened without blocking and checked before
    it is read: a FIFO in its place blocked the worker's start)."""
    try:
        return read_config_text(path, max_bytes=limit).encode()
    except ConfigError:
        return None


def _weights_identity(model: str, revision: Any) -> str:
    """Which weights ``model`` names, beyond its name: the files of a local directory (name,
    size, modification time), or the snapshot (commit) a hub id resolves to in the local cache.
    A model directory retrained or re-downloaded in place keeps its name: the disk file must not
    serve the KV of the weights that were there before. "" where neither can be told (the
    name alone then, as vLLM resolves it)."""
    try:
        if os.path.isdir(model):
            files = []
            with os.scandir(model) as it:
                for e in it:
                    if not e.name.startswith(".") and e.is_file():
                        st = e.stat()
                        files.append((e.name, st.st_size, st.st_mtime_ns))
            return repr(sorted(files))
        from huggingface_hub import try_to_load_from_cache

        got = try_to_load_from_cache(model, "config.json", revision=revision)
        return os.path.dirname(got) if isinstance(got, str) else ""  # .../snapshots/<commit>
    except Exception:  # an unreadable directory, no hub client: the name alone
        return ""


def external(h: Any) -> int:
    """vLLM's 64-bit external form of a block hash (as the host tier keys it)."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")
    return int(h) & ((1 << 64) - 1)


@dataclass
class DiskLoad:
    req_id: str
    slots: list[int]
    hashes: list[int]
    device_blocks: list[int]
    #: Per block: the host block it is read into (promoted to the host tier), -1 for none.
    host_blocks: list[int] = field(default_factory=list)


@dataclass
class DiskStepMeta:
    """One step's disk work for the worker: a wipe (prefix-cache reset) and spills run before
    the step's host stores; loads start in ``start_load_kv`` and finish in the background."""

    #: (host block, disk slot, hash, token ids, successor, parent, lora id)
    spills: list[tuple[int, int, int, list[int], int | None, int | None, int | None]] = field(default_factory=list)
    loads: list[DiskLoad] = field(default_factory=list)
    wipe: bool = False
    #: The step runs no forward (nothing scheduled) while disk reads are in flight: the worker
    #: may wait a little for them and report them received in this same step.
    idle: bool = False


@dataclass
class _Inflight:
    """A disk hit being read: its pinned slots, the host blocks it moves up into and what the
    records carry (tokens, successor, parent, lora), for registering them in the host tier."""

    slots: list[int]
    hashes: list[int]
    host_blocks: list[int]
    metas: list[Any]
    parent: int | None
    stale: bool = False  # the prefix cache was reset while reading: promote nothing


@dataclass
class _PendingRead:
    """A disk hit being read on the worker: its store tickets (-> the load's block indices),
    the private rows of blocks without a host block, and the blocks not read intact."""

    load: DiskLoad
    tickets: dict[int, list[int]] = field(default_factory=dict)
    rows: Any = None
    bad: list[tuple[int, str]] = field(default_factory=list)
    failed: bool = False


class DiskScheduler:
    def __init__(self, planner: Any, *, directory: str, num_slots: int, block_size: int, layout: DiskLayout,
                 eagle: bool) -> None:
        self.planner = planner
        self.block_size = block_size
        self.eagle = eagle
        self.path = os.path.join(directory, FILE_NAME)
        planner.enable_spill()
        # With the EAGLE rule, STORAGE BlockStored events carry the blocks' successors (vLLM
        # 0.33's lookahead_token_ids), restored ones included: set before the restore below.
        self.index = DiskIndex(num_slots, block_size, publish_successors=eagle)
        # The workers opened (or started afresh) the file before the scheduler exists.
        restored, damaged, why = self.index.restore_from_file(self.path, **layout.kwargs())
        if why is not None:
            logger.info("kvslots disk tier: %s not reused (%s)", self.path, why)
        else:
            logger.info("kvslots disk tier: %d blocks found again in %s (%d damaged records skipped)",
                        restored, self.path, damaged)
        self._sources: dict[str, tuple[int, int]] = {}
        self._hits: dict[str, tuple[int, int, int]] = {}  # req -> (first disk block, disk blocks, host tokens)
        self._loads: list[DiskLoad] = []
        self._inflight: dict[str, _Inflight] = {}  # async reads, until the worker reports them
        self._writing: dict[int, int] = {}  # slot -> hash of writes under way
        self._stale_writes: set[int] = set()  # writes begun before a reset: not registered
        self._leaving: set[int] = set()  # hashes that entered the host tier: their disk copy goes
        self._wipe = False
        self.stats = {"hit_tokens": 0, "spilled_blocks": 0, "spills_not_taken": 0, "corrupt_blocks": 0,
                      "promoted_blocks": 0, "left_for_host": 0, "resets": 0}
        self.worker_stats: dict[str, int] = {}

    def lookup(self, request: Any, num_computed_tokens: int, host_tokens: int) -> int:
        """Tokens of the hit found on disk past the device and host hit. A request with such a
        hit loads asynchronously (the connector answers ``load_kv_async=True``)."""
        self._hits.pop(request.request_id, None)
        bs = self.block_size
        hashes = request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        k = num_computed_tokens // bs + host_tokens // bs
        if k >= max_blocks or self.index.num_stored == 0:
            return 0
        # The host hit stopped at k: if the host holds block k, its last block was dropped by
        # the EAGLE rule and nothing beyond may be served.
        first = external(hashes[k])
        if self.planner.lookup_block(first) is not None:
            return 0
        ext = [first] + [external(h) for h in hashes[k + 1:max_blocks]]
        d = self.index.match_prefix(ext)
        if d and self.eagle:
            succ = self.index.successor(ext[d - 1])
            pos = (k + d) * bs
            if succ is None or pos >= request.num_tokens or request.all_token_ids[pos] != succ:
                d -= 1
        if d == 0:
            return 0
        self._hits[request.request_id] = (k, d, host_tokens)
        return d * bs

    def host_part(self, request: Any, num_external_tokens: int) -> int:
        """Of the external tokens vLLM accepted, those that come from the host tier."""
        hit = self._hits.get(request.request_id)
        return num_external_tokens if hit is None else min(num_external_tokens, hit[2])

    def after_alloc(self, request: Any, device_blocks: list[int], num_external_tokens: int) -> None:
        """Plans the async read of a disk hit vLLM accepted (``num_external_tokens > 0``). Every
        such request gets a load, even an empty one: vLLM waits for its finished receive."""
        hit = self._hits.pop(request.request_id, None)
        if hit is None:
            return
        k, d, host_tokens = hit
        n = min(d, max(0, num_external_tokens - host_tokens) // self.block_size)
        ext = [external(h) for h in request.block_hashes[k:k + n]]
        slots: list[int] = []
        if n:
            try:
                slots = self.index.begin_read(ext)
            except Exception as e:  # evicted since the lookup: vLLM recomputes (load errors)
                logger.warning("kvslots disk tier: cannot load %s: %s", request.request_id, e)
        host = [-1] * n
        metas: list[Any] = [None] * n
        if slots:
            metas = [self.index.block_meta(h) for h in ext]
            # The blocks move up: each is read into a host block of its own (evicting, and
            # spilling, least recently used ones), registered there once loaded.
            for i, hb in self.planner.begin_promote(ext):
                host[i] = hb
        parent = external(request.block_hashes[k - 1]) if k > 0 else None
        self._inflight[request.request_id] = _Inflight(slots, ext, host, metas, parent)
        self._loads.append(DiskLoad(request.request_id, slots, ext, list(device_blocks[k:k + n]), host))
        if len(self._sources) > 4096:  # vLLM asks only with prefix-cache stats on
            self._sources.clear()
        self._sources[request.request_id] = (min(host_tokens, num_external_tokens), n * self.block_size)

    def hit_sources(self, request_id: str, num_external_tokens: int) -> tuple[int, int]:
        """(host tokens, disk tokens) of the request's last planned load."""
        host, disk = self._sources.pop(request_id, (num_external_tokens, 0))
        disk = min(disk, num_external_tokens)
        return num_external_tokens - disk, disk

    def forget(self, request_id: str) -> None:
        # An async read in flight stays: vLLM keeps the request's blocks until it is reported.
        self._hits.pop(request_id, None)
        self._sources.pop(request_id, None)

    def reset(self) -> int:
        """The prefix cache was reset (the weights may change): every block leaves the tier
        (one ``BlockRemoved``, medium ``STORAGE``: ``AllBlocksCleared`` carries no medium), the workers wipe the file (nothing comes
        back after a restart), writes and reads under way register and promote nothing."""
        n = self.index.clear()
        self._stale_writes.update(self._writing)
        for inf in self._inflight.values():
            inf.stale = True
        self.planner.take_registered()
        self._leaving.clear()
        self._wipe = True
        self.stats["resets"] += 1
        return n

    def build(self, idle: bool = False) -> DiskStepMeta | None:
        """The step's disk work; ``idle``: the step schedules no tokens. An idle tier (nothing
        evicted, loaded, reset or read) costs one Rust call and a few attribute reads."""
        taken = self.planner.take_spills()
        if not taken and not self._loads and not self._wipe and not (idle and self._inflight):
            return None
        spills = []
        for hb, h, parent, lora, succ, tokens in taken:
            try:
                slot = self.index.begin_write(h, tokens, succ, parent, lora)
            except KVSlotsError as e:
                # This block only (a record the index cannot take): raised out of the loop, the
                # slots begun before it stayed "writing" for ever and the rest were lost.
                logger.warning("kvslots disk tier: block %#x not spilled: %s", h, e)
                slot = None
            if slot is None:
                self.stats["spills_not_taken"] += 1
                continue
            self._writing[slot] = h
            spills.append((hb, slot, h, tokens, succ, parent, lora))
        self.stats["spilled_blocks"] += len(spills)
        loads, self._loads = self._loads, []
        if loads:
            self.stats["hit_tokens"] += sum(len(ld.device_blocks) for ld in loads) * self.block_size
        wipe, self._wipe = self._wipe, False
        idle = idle and bool(self._inflight)
        if not spills and not loads and not wipe and not idle:
            return None
        return DiskStepMeta(spills=spills, loads=loads, wipe=wipe, idle=idle)

    def complete(self, meta: Any) -> None:
        """The worker's report: finished writes, finished reads (their slots unpin, their
        blocks enter the host tier), bad records; then disk copies of blocks now in the host
        tier leave."""
        if not (meta.disk_done or meta.disk_loaded or meta.disk_corrupt or meta.disk_stats):
            self.drop_promoted()  # the idle tier's step: nothing from the worker's disk side
            return
        for slot, ok in getattr(meta, "disk_done", ()):
            self._writing.pop(slot, None)
            if slot in self._stale_writes:
                self._stale_writes.discard(slot)
                ok = False
            self.index.complete_write(slot, ok)
        for req_id, good in getattr(meta, "disk_loaded", ()):
            inf = self._inflight.pop(req_id, None)
            if inf is not None:
                self._finish_read(inf, good)
        for h in getattr(meta, "disk_corrupt", ()):
            if self.index.remove(h):
                self.stats["corrupt_blocks"] += 1
        if getattr(meta, "disk_stats", None):
            self.worker_stats = meta.disk_stats
        self.drop_promoted()

    def _finish_read(self, inf: _Inflight, good: int) -> None:
        if inf.slots:
            self.index.end_read(inf.slots)
        hb, hashes = inf.host_blocks, inf.hashes
        i, n = 0, len(hb)
        while i < n:
            if hb[i] < 0:
                i += 1
                continue
            j = i
            while j < n and hb[j] >= 0 and (j < good) == (i < good):
                j += 1
            if i < good and not inf.stale:
                # A contiguous run of the chain read intact: one BlockStored (medium CPU).
                metas = inf.metas[i:j]
                tokens = [t for m in metas for t in m[0]]
                parent = hashes[i - 1] if i > 0 else inf.parent
                self.planner.complete_promote(hashes[i:j], hb[i:j], tokens, [m[1] for m in metas],
                                              parent, metas[0][3])
                self.stats["promoted_blocks"] += j - i
            else:
                self.planner.abort_promote(hashes[i:j], hb[i:j])
            i = j
        if inf.stale:
            for h in hashes:  # kept by the reset only because they were pinned
                self.index.remove(h)

    def drop_promoted(self) -> None:
        """A block lives in one tier at a time: the disk copy of a block registered in the host
        tier (moved up by a hit, or stored again from the device) leaves the disk tier
        (``BlockRemoved``, medium ``STORAGE``) once no read pins it and its write is done. If
        the host tier evicts it first, the disk copy is its only one and stays."""
        if not self._leaving and not self._writing and not self.index.num_stored:
            # Nothing on disk or on its way there: no registered block has a disk copy (the
            # steady state of a tier that has not spilled yet costs one call per step).
            self.planner.discard_registered()
            return
        registered = self.planner.take_registered()
        if registered:  # one call filters them: most were never on disk
            self._leaving.update(self.index.held(registered))
        if not self._leaving:
            return
        writing = set(self._writing.values())
        for h in list(self._leaving):
            if self.planner.lookup_block(h) is not None:
                if self.index.remove(h):
                    self.stats["left_for_host"] += 1
                elif self.index.contains(h) or h in writing:
                    continue  # pinned by a read or being written: later
            self._leaving.discard(h)

    def metrics(self) -> dict[str, int]:
        s = self.index.stats()
        out = {f"disk_{k}": v for k, v in s.items()}
        out.update({f"disk_{k}": v for k, v in self.stats.items()})
        out["disk_reads_in_flight"] = len(self._inflight)
        out.update({f"disk_worker_{k}": v for k, v in self.worker_stats.items()})
        return out


class DiskWorker:
    """The worker's part: spills handed to the file's background writer, and disk hits read
    on a background thread of their own.

    Async reads. ``start`` (in ``start_load_kv``) queues each hit's read on the store's Rust
    reader threads (``DiskStore.read_rows_async``: one ``preadv`` per run of consecutive
    records, checksums; no Python and no GIL, so a read neither waits for the interpreter to
    start nor to finish), into the host blocks the scheduler reserved for the promotion (or a
    private buffer where it could not). ``poll`` (in ``get_finished``, on the worker's own
    thread, after the step's forward was launched) copies finished reads into the device blocks
    and reports the request as received. In a step that runs no forward (nothing scheduled:
    no batch to hold up) it first waits up to ``IDLE_WAIT_S`` for the reads, so a read that
    ends in that time is reported in the step that started it rather than a step later. This is
    safe: the device blocks belong to a request vLLM holds in ``WAITING_FOR_REMOTE_KVS``, which
    no forward reads or writes and whose blocks vLLM neither caches nor frees (even if it is
    aborted) until the receive is reported; the copy runs on the copier's stream, which first
    waits for the compute stream, and is synchronized before the report, so the forward that
    later reads the blocks (the next step at the earliest) sees them. The host blocks read
    into are unregistered and pinned at the scheduler until the report, so nothing else reads,
    writes or reuses them meanwhile; their evicted contents were handed to the writer (spills,
    ``handle_preemptions``) before the read was queued.
    """

    STAGING_BLOCKS = 16
    #: The longest a step with no forward waits for disk reads (a request arriving meanwhile
    #: is picked up at most this much later; the reads go on in the background after it).
    IDLE_WAIT_S = 0.005

    def __init__(self, *, directory: str, num_slots: int, block_size: int, layout: DiskLayout,
                 queue_len: int) -> None:
        directory = text(os.fspath(directory) if isinstance(directory, os.PathLike) else directory, "directory")
        if "\0" in directory:  # os.makedirs' ValueError
            raise InvalidArgumentError(f"directory must not contain NUL, got {directory!r}")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:  # a file there, no permission, a read-only filesystem
            raise DiskTierError(f"kvslots disk tier: cannot make the directory {directory!r}: {e}") from e
        self.layout = layout
        self.path = os.path.join(directory, FILE_NAME)
        kw = dict(num_slots=num_slots, block_size=block_size, queue_len=queue_len, **layout.kwargs())
        try:
            self.store = DiskStore(self.path, **kw)
        except DiskTierError as e:
            if "in use" not in str(e):
                raise
            # The file is locked by the store holding it (one engine per file). An engine of
            # this process that was let go but sits in a reference cycle still holds it until
            # the cycle collector runs: collect, then try once more (another process's stays).
            gc.collect()
            self.store = DiskStore(self.path, **kw)
        if self.store.opened.startswith("discarded"):
            why = _what_changed(self.path, layout) if "fingerprint" in self.store.opened else ""
            logger.warning("kvslots disk tier: %s %s%s; starting it afresh (its blocks are not served)",
                           self.path, self.store.opened, why)
        _keep_identity(self.path, layout)
        self.staging: Any = None
        self.copier: Any = None
        self._warned: set[int] = set()
        self._pending: list[_PendingRead] = []  # in the order they started
        self._by_ticket: dict[int, _PendingRead] = {}
        self._watch_wipe = False  # a wipe was queued: take_done looks whether it failed
        self._wipe_pending = False  # a reset's wipe could not be queued: retried before any spill
        self._failures_told = (0, 0)  # (dropped full, failed) spills already logged
        self._failures_told_at = float("-inf")
        self._not_queued: list[tuple[int, bool]] = []  # spills the store refused by raising
        self._not_queued_count = 0  # since the last log line
        self._not_queued_told_at = float("-inf")
        # The step metadata last spilled and started: a step retried after its hook raised
        # part-way (handle_preemptions' stores, start_load_kv's loads) queued them again, and
        # each write or read was reported twice (the scheduler's index refuses the second).
        self._spilled: DiskStepMeta | None = None
        self._started: DiskStepMeta | None = None
        self._unusable_told = False  # a store this process cannot use (forked) was said in the log

    def register(self, kv_caches: dict[str, Any], copier: Any, num_device_blocks: int, threads: int) -> None:
        from ..transfer import BlockCopier

        if copier.bytes_per_block != self.layout.bytes_per_block:
            raise InvalidArgumentError(f"kvslots disk tier: the KV caches registered hold blocks of "
                                       f"{copier.bytes_per_block} bytes, the disk file's layout (vLLM's KV cache "
                                       f"config) says {self.layout.bytes_per_block}")
        # A read still in flight from before a sleep (its disk outwaited the sleep's bound) lands
        # in the host region of before; the new copier would send its own host blocks of those
        # numbers to the device: KV that is not the request's. Not loaded: recomputed.
        for p in self._pending:
            if any(hb >= 0 for hb in p.load.host_blocks) and self.copier is not None and copier is not self.copier:
                p.failed = True
        self.copier = copier
        self.host_np = copier.host.numpy()
        # Reads with no host block of their own land here, then go to the device blocks.
        self.staging = BlockCopier(kv_caches, num_device_blocks, self.STAGING_BLOCKS, threads=threads)
        self.staging_np = self.staging.host.numpy()

    def spill(self, disk: DiskStepMeta) -> None:
        """Hands the step's spills to the writer. Never raises: a spill that cannot be queued
        (the store raised: a bad block or slot) is reported not written by the next
        ``take_done``, so the scheduler frees its disk slot; an exception let out part-way left
        the batch's later slots "writing" at the scheduler for ever (never reported). A step's
        metadata spilled already is not spilled again."""
        if disk is self._spilled:
            return
        self._spilled = disk
        if disk.wipe or self._wipe_pending:
            try:
                self.store.wipe()  # queued ahead of this step's spills
                self._watch_wipe = True
                self._wipe_pending = False
            except Exception as e:
                # Spills written after a wipe that never ran would sit beside records of before
                # the reset (found again after a restart): none is written until a wipe is
                # queued, tried again at each step.
                self._wipe_pending = True
                self._refuse(disk.spills, f"the wipe could not be queued ({type(e).__name__}: {e})")
                return
        failed: list[int] = []
        why = ""
        for i, (hb, slot, h, tokens, succ, parent, lora) in enumerate(disk.spills):
            try:
                self.store.submit(slot, self.host_np[hb], h, tokens, succ, parent, lora)
            except Exception as e:  # this block only: the others are queued as usual
                failed.append(i)
                why = why or f"{type(e).__name__}: {e}"
        if failed:
            self._refuse([disk.spills[i] for i in failed], why)

    def _refuse(self, spills: list[Any], why: str) -> None:
        """Spills not queued: reported not written by the next ``take_done`` (their slots
        freed), said in the log at most once a minute (a store that raises does so every step)."""
        if not spills:
            return
        self._not_queued.extend((s[1], False) for s in spills)
        self._not_queued_count += len(spills)
        now = time.monotonic()
        if now - self._not_queued_told_at >= self.FAILURE_LOG_S:
            logger.error("kvslots disk tier: %d spill(s) to %s could not be queued (last: %s); those blocks are "
                         "not kept on disk", self._not_queued_count, self.path, why)
            self._not_queued_count, self._not_queued_told_at = 0, now

    def start(self, disk: DiskStepMeta) -> None:
        """Queues the step's disk reads on the store's reader threads (never waits); a step's
        metadata started already is not started again (each read was reported twice)."""
        if disk is self._started:
            return
        self._started = disk
        for ld in disk.loads:
            p = _PendingRead(ld)
            n = len(ld.device_blocks)
            if len(ld.slots) == n and len(ld.host_blocks) == n:  # else not pinned: nothing read
                up = [i for i in range(n) if ld.host_blocks[i] >= 0]
                own = [i for i in range(n) if ld.host_blocks[i] < 0]
                try:
                    # Straight into the host blocks taken for the promotion; the rest into
                    # private rows. Rust threads do the reads: no Python, no GIL, until done.
                    if up:
                        t = self.store.read_rows_async([ld.slots[i] for i in up], [ld.hashes[i] for i in up],
                                                       self.host_np, [ld.host_blocks[i] for i in up])
                        p.tickets[t] = up
                    if own:
                        p.rows = np.empty((len(own), self.layout.bytes_per_block), dtype=np.uint8)
                        t = self.store.read_rows_async([ld.slots[i] for i in own], [ld.hashes[i] for i in own],
                                                       p.rows, list(range(len(own))))
                        p.tickets[t] = own
                except Exception:
                    logger.exception("kvslots disk tier: cannot start the read for %s", ld.req_id)
                    p.failed = True
            else:
                p.failed = True
            for t in p.tickets:
                self._by_ticket[t] = p
            self._pending.append(p)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self, load_errors: set[int], corrupt: set[int], wait_s: float = 0.0) -> list[tuple[str, int]]:
        """Finishes the reads that are done (waiting up to ``wait_s`` for all of them): device
        copies, load errors for blocks not read (vLLM recomputes from the first), corrupt
        records invalidated. Returns [(request id, blocks loaded)]."""
        if wait_s > 0 and self._by_ticket:
            self.store.wait_reads(wait_s)  # the GIL released
        for t, bad, err in self.store.take_reads():
            p = self._by_ticket.pop(t, None)
            if p is None:
                continue
            idx = p.tickets.pop(t)
            if err is not None:
                logger.error("kvslots disk tier: read for %s failed: %s", p.load.req_id, err)
                p.failed = True
                # Its blocks are as unreadable as corrupt ones (the file cut short, a bad
                # sector): the first leaves the index (those after it are no prefix then), or
                # every later hit of this prefix would read and fail again.
                p.bad.append((min(idx), f"read failed: {err}"))
            p.bad += [(idx[j], why) for j, why in bad]
        out: list[tuple[str, int]] = []
        still = []
        for p in self._pending:
            if p.tickets:
                still.append(p)
                continue
            ld = p.load
            bad = [min(p.bad)] if p.bad else []  # vLLM recomputes from the first bad block on
            good = 0 if p.failed else (bad[0][0] if bad else len(ld.device_blocks))
            if good:
                try:
                    self._to_device(ld, good, p.rows)
                except Exception:
                    logger.exception("kvslots disk tier: device copy for %s failed", ld.req_id)
                    good = 0
            for i, why in bad:
                h = ld.hashes[i]
                corrupt.add(h)
                self.store.invalidate(ld.slots[i])  # still pinned: not reused before this
                if h not in self._warned:
                    self._warned.add(h)
                    logger.warning("kvslots disk tier: block %#x of %s not loaded (%s); recomputed",
                                   h, ld.req_id, why)
            load_errors.update(ld.device_blocks[good:])
            out.append((ld.req_id, good))
        self._pending = still
        return out

    def _to_device(self, ld: DiskLoad, good: int, rows: Any) -> None:
        host = [(hb, d) for hb, d in zip(ld.host_blocks[:good], ld.device_blocks[:good]) if hb >= 0]
        if host:
            self.copier.load([h for h, _ in host], [d for _, d in host])
            self.copier.synchronize()
        own = [d for hb, d in zip(ld.host_blocks[:good], ld.device_blocks[:good]) if hb < 0]
        n_stage = self.STAGING_BLOCKS
        for lo in range(0, len(own), n_stage):
            m = min(n_stage, len(own) - lo)
            self.staging_np[:m] = rows[lo:lo + m]
            self.staging.load(list(range(m)), own[lo:lo + m])
            self.staging.synchronize()  # the staging rows are written again next

    #: Write failures (a full, read-only or failing disk) are logged at most this often.
    FAILURE_LOG_S = 60.0

    def take_done(self) -> list[tuple[int, bool]]:
        """Writes finished since the last call, [(slot, written)], with the spills that could
        not be queued (not written). Never raises: a store this process cannot use (opened
        before a fork: its writer thread is not here) raised InvalidStateError at every step,
        and the refused spills were never reported; now those are, and the cause is logged once."""
        try:
            done = self.store.take_done()
        except Exception as e:
            done = []
            self._unusable(e)
        if self._not_queued:
            done = self._not_queued + done
            self._not_queued = []
        if done and not all(ok for _, ok in done):
            self._tell_failures()
        if self._watch_wipe:
            why = self.store.out_of_use  # a getter that asks the file only
            if why is not None:  # said once: the store stays out of use until a restart
                self._watch_wipe = False
                logger.warning("kvslots disk tier: %s is out of use until a restart (%s); its blocks are "
                               "recomputed, its writes dropped", self.path, why)
        return done

    def _tell_failures(self) -> None:
        # A spill not written (the writer's queue full: the disk slower than the spills; or the
        # write failed: ENOSPC, EROFS, EIO) is only a block not kept, counted in the
        # disk_worker_dropped_full / disk_worker_write_failures metrics; but a disk that stays
        # full or slow drops every spill, and the counters alone say neither that nor why: a
        # warning, at most one a minute. (A store out of use was told at its wipe.)
        now = time.monotonic()
        if now - self._failures_told_at < self.FAILURE_LOG_S:  # first: a failing disk fails every step
            return
        st = self.stats()
        if not st:
            return
        full, failed = st["dropped_full"], st["write_failures"]
        if full + failed > sum(self._failures_told) and self.store.out_of_use is None:
            logger.warning("kvslots disk tier: spills not written to %s (those blocks are not kept on disk): "
                           "%d failed (last error: %s), %d dropped with the writer's queue full (the disk is "
                           "slower than the spills); since start %d and %d", self.path,
                           failed - self._failures_told[1], self.store.last_write_error,
                           full - self._failures_told[0], failed, full)
            self._failures_told, self._failures_told_at = (full, failed), now

    def stats(self) -> dict[str, int]:
        """The store's counters; {} where the store cannot be asked (see :meth:`take_done`)."""
        try:
            return dict(self.store.stats())
        except Exception as e:
            self._unusable(e)
            return {}

    def _unusable(self, e: Exception) -> None:
        if not self._unusable_told:
            self._unusable_told = True
            logger.error("kvslots disk tier: %s cannot be used in this process (%s: %s); its spills are "
                         "reported not written", self.path, type(e).__name__, e)

    def close(self) -> None:
        self.store.wait_reads(60.0)  # the reads write into the host region: let them end
