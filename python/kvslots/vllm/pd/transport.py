"""Block transfers between a prefill and a decode worker over Mooncake's transfer engine.

We do not run our own sockets: Mooncake's ``TransferEngine`` moves the bytes (TCP here, RDMA where
the NIC and libibverbs have it), with its peer-to-peer handshake so no metadata service is needed.
Each worker builds one :class:`MooncakeTransport`, registers its KV cache once
(:meth:`MooncakeTransport.register`, every segment of every layer of a :class:`BlockLayout`,
target and draft layers alike) and publishes its ``session_id`` and layout. The decode worker
then *pulls*: :meth:`MooncakeTransport.read_blocks` copies a list of the prefill worker's blocks
into a list of its own blocks, every segment, in one batched Mooncake call. Runs of consecutive
ids on both sides become one entry per segment, so a prompt's blocks usually move as one entry
per layer.

Failures are :class:`kvslots.errors.TransferError` with ``kind``: ``"peer"`` (the remote engine is
gone, refused, or the transfer failed), ``"timeout"``, ``"layout"`` (the layouts differ) or
``"engine"`` (Mooncake missing or failing locally). A failed read leaves the destination blocks
undefined and nothing else changed.

Timeouts: Mooncake's own synchronous batch gives up on a silent peer after its transfer timeout
(:data:`MOONCAKE_TRANSFER_TIMEOUT_S`; ``MC_TRANSFER_TIMEOUT``, whole seconds, read when an engine
is made; ``transfer_timeout_s`` gives one engine its own unless the operator set the variable).
:meth:`MooncakeTransport.submit_read` runs the batch on a worker thread and
:meth:`PendingRead.result` raises ``kind="timeout"`` at the caller's deadline; the destination
blocks must still not be reused until :meth:`PendingRead.settled` is true, because Mooncake may
still be writing into them until it gives up itself.

First contact: before its first read from a peer, Mooncake exchanges metadata with it over the
peer's RPC port, and it waits a fixed 60 s for an answer (not configurable) from a peer that
accepts the connection but stays silent (stopped, hung, or no Mooncake engine at all). So the
first read from each session is preceded by Mooncake's own probe (``send_probe``, on a daemon
thread) that must answer within ``handshake_timeout_s`` (:data:`DEFAULT_HANDSHAKE_TIMEOUT_S`):
otherwise a ``kind="timeout"`` TransferError, and Mooncake never starts the read, so no block is
touched. The probe thread itself ends when Mooncake gives up (at most 60 s) or the peer answers;
a second read from that peer meanwhile waits on the same probe, and a failed read makes the next
one probe again.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, cast

import numpy as np

from ..._args import number, text
from ..._args import timeout as _timeout
from ...errors import ArgumentTypeError, InvalidArgumentError, InvalidStateError, TransferError
from .layout import BlockLayout, _as_ids

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT_S", "MOONCAKE_TRANSFER_TIMEOUT_S", "MooncakeTransport", "PendingRead",
           "load_transfer_engine"]

#: Mooncake's own transfer timeout (0.3.13), when ``MC_TRANSFER_TIMEOUT`` is not set.
MOONCAKE_TRANSFER_TIMEOUT_S = 30.0
_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
#: How long a first read from a peer waits for it to answer Mooncake's probe (Mooncake itself
#: waits 60 s in its hand-shake).
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
#: Probes of peers that have not answered yet, running at once (each a daemon thread for at most
#: Mooncake's 60 s); a read from yet another silent peer fails at once.
MAX_PENDING_PROBES = 16
_DEFAULT = object()  # handshake_timeout_s not given
#: Sessions remembered as having answered; past it the memory starts over (they probe again).
MAX_KNOWN_SESSIONS = 4096


def load_transfer_engine() -> Any:
    """Mooncake's ``TransferEngine`` class; a :class:`TransferError` (kind ``"engine"``) saying
    what to install when it does not import."""
    # Mooncake logs every connection at INFO through glog; keep warnings and errors only unless
    # the user asked for more. glog reads this when the library loads.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransferError(
            f"Mooncake's transfer engine does not import ({e}); install the wheel of "
            "requirements/pd.txt (mooncake-transfer-engine-non-cuda) and Debian's libibverbs1, "
            "as scripts/setup.sh does",
            details={"kind": "engine"},
        ) from None
    return TransferEngine


def _check_session(session: Any) -> None:
    """``host:port`` as Mooncake names a peer; a TransferError (kind ``"peer"``) otherwise. A
    lone surrogate was pybind's TypeError; a NUL, no host or a port out of range went to Mooncake."""
    ok = isinstance(session, str) and session.count(":") == 1
    if ok:
        host, _, port = session.partition(":")
        ok = (bool(host) and host.isprintable() and not any(c.isspace() for c in host)
              and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536)
        try:
            session.encode("utf-8")
        except UnicodeEncodeError:
            ok = False
    if not ok:
        shown = repr(session) if len(repr(session)) <= 80 else repr(session)[:77] + "..."
        raise TransferError(f"bad remote session {shown} (expected host:port)", details={"kind": "peer"})


class PendingRead:
    """One read submitted with :meth:`MooncakeTransport.submit_read`."""

    __slots__ = ("_future", "nbytes", "num_blocks")

    def __init__(self, future: Future[None], nbytes: int, num_blocks: int):
        self._future = future
        self.nbytes = nbytes
        self.num_blocks = num_blocks

    def done(self) -> bool:
        """True once the read finished, successfully or not (never blocks)."""
        return self._future.done()

    def settled(self) -> bool:
        """True once Mooncake no longer touches the destination blocks (same as :meth:`done`;
        named for the caller that gave up at a timeout and waits to reuse its blocks)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> int:
        """Waits up to ``timeout`` seconds (``None``: until Mooncake finishes or gives up);
        returns the bytes moved or raises :class:`TransferError`. A negative timeout does not
        wait; infinity waits as None does."""
        # The one rule of a timeout argument: a str was a TypeError, inf an OverflowError, NaN
        # a "not done after nan s" whether done or not.
        timeout = _timeout(timeout, "timeout")
        try:
            self._future.result(timeout)
        except FutureTimeout:
            raise TransferError(
                f"transfer of {self.num_blocks} blocks ({self.nbytes} bytes) not done after {timeout} s",
                details={"kind": "timeout", "num_blocks": self.num_blocks},
            ) from None
        return self.nbytes


class MooncakeTransport:
    """One Mooncake transfer engine for one worker, with its KV cache registered.

    ``hostname``: the address peers reach this worker at (``127.0.0.1`` on loopback).
    ``protocol``: ``"tcp"`` or ``"rdma"``. ``device_name``: Mooncake's NIC filter (RDMA).
    ``transfer_timeout_s``: how long a read may wait on a silent peer (rounded up to whole
    seconds); None keeps Mooncake's default. Mooncake reads it from the process environment
    (``MC_TRANSFER_TIMEOUT``) when the engine is made, so it is set there for that moment only;
    an ``MC_TRANSFER_TIMEOUT`` the operator set wins. ``handshake_timeout_s``: how long the first
    read from a peer waits for it to answer Mooncake's probe (see the module's "First contact");
    by default :data:`DEFAULT_HANDSHAKE_TIMEOUT_S`, or ``transfer_timeout_s`` when that is
    shorter; None leaves it to Mooncake's own 60 s hand-shake.
    """

    def __init__(self, hostname: str = "127.0.0.1", *, protocol: str = "tcp", device_name: str = "",
                 threads: int = 1, transfer_timeout_s: float | None = None,
                 handshake_timeout_s: float | None | object = _DEFAULT):
        if not isinstance(hostname, str) or not hostname or ":" in hostname:
            raise InvalidArgumentError(f"hostname must be a host name or address without a port, got {hostname!r}")
        # Text Mooncake can take: a lone surrogate (in hostname or device_name) or a device_name
        # that is no str was pybind's TypeError; a NUL or blank made a session id peers cannot use.
        hostname = text(hostname, "hostname")
        if not hostname.isprintable() or any(c.isspace() for c in hostname):
            raise InvalidArgumentError(f"hostname must be a host name or address, got {hostname!r}")
        device_name = text(device_name, "device_name")
        if "\0" in device_name:
            raise InvalidArgumentError(f"device_name must not hold a NUL, got {device_name!r}")
        if protocol not in ("tcp", "rdma"):
            raise InvalidArgumentError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidArgumentError(f"threads must be an int >= 1, got {threads!r}")
        if transfer_timeout_s is not None:
            if (isinstance(transfer_timeout_s, bool) or not isinstance(transfer_timeout_s, (int, float))
                    or not math.isfinite(transfer_timeout_s) or not 0 < transfer_timeout_s <= 86_400):
                raise InvalidArgumentError(f"transfer_timeout_s must be a number of seconds in (0, 86400], got "
                                           f"{transfer_timeout_s!r}")
        if handshake_timeout_s is _DEFAULT:
            # Not given: no longer than a read may wait on a silent peer either (the P/D consumer
            # caps that at its pd_timeout_s, past which the producer's hold has expired anyway).
            handshake_timeout_s = min(DEFAULT_HANDSHAKE_TIMEOUT_S, transfer_timeout_s or math.inf)
        elif handshake_timeout_s is not None:
            handshake_timeout_s = number(handshake_timeout_s, "handshake_timeout_s", hi=86_400, positive=True)
        engine_cls = load_transfer_engine()
        # Mooncake reads the variable when the engine is made: set for that moment only, so that
        # neither this process's later engines nor its child processes inherit it.
        scoped = transfer_timeout_s is not None and _TIMEOUT_ENV not in os.environ
        if scoped:
            os.environ[_TIMEOUT_ENV] = str(math.ceil(cast(float, transfer_timeout_s)))
        try:
            self._engine = engine_cls()
            rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        finally:
            if scoped:
                os.environ.pop(_TIMEOUT_ENV, None)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({hostname!r}, {protocol!r}) failed with {rc}",
                                details={"kind": "engine", "code": rc})
        self.hostname = hostname
        self.protocol = protocol
        self.rpc_port = int(self._engine.get_rpc_port())
        self.layout: BlockLayout | None = None
        self._regions: list[int] = []
        self._lock = threading.Lock()
        # Reads between their start and their end, on any thread: each writes into the
        # registered memory, so register() refuses and close() waits while there is one.
        self._reads = 0
        self._reads_ended = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvslots-pd-xfer")
        self._closed = False
        self.handshake_timeout_s = handshake_timeout_s
        self._probe_lock = threading.Lock()
        self._probes: dict[str, Future[int]] = {}  # session -> its probe still running
        self._answered: set[str] = set()  # sessions that answered a probe since their last failure

    @property
    def session_id(self) -> str:
        """What a peer names this worker by (``host:rpc_port``)."""
        return f"{self.hostname}:{self.rpc_port}"

    @property
    def engine(self) -> Any:
        """The underlying Mooncake ``TransferEngine`` (benches compare against it directly)."""
        return self._engine

    def register(self, layout: BlockLayout) -> None:
        """Registers every region of ``layout`` with Mooncake (once; a second layout replaces the
        first). The memory must stay allocated until :meth:`close` or the next ``register``.
        While a read is in flight (:meth:`read_blocks` on another thread, or a
        :meth:`submit_read` not settled) an :class:`~kvslots.errors.InvalidStateError`, nothing
        changed: Mooncake writes into the registered memory until the read ends."""
        if not isinstance(layout, BlockLayout):
            raise ArgumentTypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
        with self._lock:
            self._check_open()
            if self._reads:
                # Unregistered under a running read, the old regions went on being written into.
                raise InvalidStateError(f"{self._reads} read(s) in flight write into the registered memory; "
                                        "register a new layout once they ended")
            self._unregister_all()
            done: list[int] = []
            for addr, nbytes in layout.regions():
                rc = self._engine.register_memory(addr, nbytes)
                if rc != 0:
                    for a in done:
                        self._engine.unregister_memory(a)
                    raise TransferError(f"Mooncake register_memory({addr:#x}, {nbytes}) failed with {rc}",
                                        details={"kind": "engine", "code": rc})
                done.append(addr)
            self._regions = done
            self.layout = layout

    def plan(self, remote_layout: BlockLayout, remote_ids: Sequence[int] | np.ndarray,
             local_ids: Sequence[int] | np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths) of the batch that copies remote block
        ``remote_ids[i]`` into local block ``local_ids[i]`` for every segment. Validates ids and
        layouts; changes nothing."""
        local = self.layout
        if local is None:
            raise TransferError("no KV layout registered with this transport", details={"kind": "engine"})
        if not isinstance(remote_layout, BlockLayout):
            raise ArgumentTypeError(f"remote_layout must be a BlockLayout, got {type(remote_layout).__name__}")
        local.check_compatible(remote_layout)
        # Local ids are distinct, so there are at most as many as local blocks, and as many
        # remote ids as local ones.
        r = _as_ids("remote_ids", remote_ids, remote_layout.num_blocks, local.num_blocks)
        l_ = _as_ids("local_ids", local_ids, local.num_blocks, local.num_blocks)
        if len(r) != len(l_):
            raise InvalidArgumentError(f"remote_ids has {len(r)} ids, local_ids {len(l_)}")
        if len(np.unique(l_)) != len(l_):
            raise InvalidArgumentError("local_ids holds a block id twice (two blocks cannot land in one)")
        if not len(r):
            return [], [], []
        order = np.argsort(l_, kind="stable")
        l_, r = l_[order], r[order]
        # A run: consecutive local ids whose remote ids are consecutive too.
        brk = np.flatnonzero((np.diff(l_) != 1) | (np.diff(r) != 1)) + 1
        starts = np.concatenate(([0], brk))
        lens = np.diff(np.concatenate((starts, [len(l_)])))
        l0, r0 = l_[starts], r[starts]
        lp: list[np.ndarray] = []
        rp: list[np.ndarray] = []
        ln: list[np.ndarray] = []
        for ls, rs in zip(local.segments, remote_layout.segments):
            if ls.stride == ls.block_bytes and rs.stride == rs.block_bytes:
                lp.append(ls.addr + l0 * ls.stride)
                rp.append(rs.addr + r0 * rs.stride)
                ln.append(lens * ls.block_bytes)
            else:  # strided blocks: one entry per block
                lp.append(ls.addr + l_ * ls.stride)
                rp.append(rs.addr + r * rs.stride)
                ln.append(np.full(len(l_), ls.block_bytes, dtype=np.int64))
        return (np.concatenate(lp).tolist(), np.concatenate(rp).tolist(), np.concatenate(ln).tolist())

    def read_blocks(self, remote_session: str, remote_layout: BlockLayout, remote_ids: Sequence[int] | np.ndarray,
                    local_ids: Sequence[int] | np.ndarray) -> int:
        """Copies the remote blocks into the local ones (all segments) and returns the bytes
        moved; blocks the calling thread until Mooncake finishes or gives up."""
        _check_session(remote_session)
        self._begin_read()
        try:
            lp, rp, ln = self.plan(remote_layout, remote_ids, local_ids)
            self._run(remote_session, lp, rp, ln)
        finally:
            self._end_read()
        return int(sum(ln))

    def submit_read(self, remote_session: str, remote_layout: BlockLayout, remote_ids: Sequence[int] | np.ndarray,
                    local_ids: Sequence[int] | np.ndarray) -> PendingRead:
        """As :meth:`read_blocks`, on the transport's worker thread; argument errors raise here,
        transfer errors from :meth:`PendingRead.result`."""
        _check_session(remote_session)
        self._begin_read()
        try:
            lp, rp, ln = self.plan(remote_layout, remote_ids, local_ids)
            fut = self._pool.submit(self._run_counted, remote_session, lp, rp, ln)
        except BaseException:
            self._end_read()
            raise
        return PendingRead(fut, int(sum(ln)), len(np.asarray(local_ids)))

    def _begin_read(self) -> None:
        with self._lock:
            self._check_open()
            self._reads += 1

    def _end_read(self) -> None:
        with self._lock:
            self._reads -= 1
            if not self._reads:
                self._reads_ended.notify_all()

    def _run_counted(self, remote_session: str, lp: list[int], rp: list[int], ln: list[int]) -> None:
        # Ended here, not in a done-callback: those run after result() returns, and a register()
        # right after it found the read still counted.
        try:
            self._run(remote_session, lp, rp, ln)
        finally:
            self._end_read()

    def _run(self, remote_session: str, lp: list[int], rp: list[int], ln: list[int]) -> None:
        if not lp:
            return
        _check_session(remote_session)
        self._first_contact(remote_session)
        rc = self._engine.batch_transfer_sync_read(remote_session, lp, rp, ln)
        if rc != 0:
            with self._probe_lock:  # gone or restarted: the next read probes it again
                self._answered.discard(remote_session)
            raise TransferError(
                f"Mooncake read of {len(lp)} entries ({sum(ln)} bytes) from {remote_session} failed with {rc} "
                "(peer gone, unreachable, or silent past Mooncake's transfer timeout)",
                details={"kind": "peer", "code": rc},
            )

    def _first_contact(self, session: str) -> None:
        """Returns once ``session`` answered Mooncake's probe (at once if it did before); a
        TransferError if it does not within ``handshake_timeout_s``. Mooncake's own hand-shake
        waited 60 s for a peer that accepts the connection and stays silent."""
        timeout = self.handshake_timeout_s
        probe = getattr(self._engine, "send_probe", None)
        if timeout is None or probe is None:  # asked for Mooncake's own wait, or a Mooncake without probes
            return
        with self._probe_lock:
            if session in self._answered:
                return
            fut = self._probes.get(session)
            if fut is None:
                if len(self._probes) >= MAX_PENDING_PROBES:
                    raise TransferError(f"{len(self._probes)} Mooncake peers have not answered yet; not contacting "
                                        f"another ({session})", details={"kind": "timeout"})
                fut = Future()
                self._probes[session] = fut
                # A daemon thread, not the pool: it may outlive this call by Mooncake's 60 s, and
                # must neither hold up the reads nor process exit.
                threading.Thread(target=self._probe, args=(probe, session, fut), name="kvslots-pd-probe",
                                 daemon=True).start()
        try:
            rc = fut.result(timeout)
        except FutureTimeout:
            raise TransferError(
                f"Mooncake peer {session} did not answer within {timeout:g} s (handshake_timeout_s): stopped, hung, "
                "or no Mooncake engine; nothing was read", details={"kind": "timeout"}) from None
        if rc != 0:
            raise TransferError(f"Mooncake peer {session} is unreachable or refused the hand-shake ({rc})",
                                details={"kind": "peer", "code": rc})

    def _probe(self, probe: Any, session: str, fut: Future[int]) -> None:
        try:
            rc = int(probe(session))
        except Exception:  # noqa: BLE001 - any failure of the probe is a peer that did not answer
            rc = -1
        with self._probe_lock:
            self._probes.pop(session, None)
            if rc == 0:
                if len(self._answered) >= MAX_KNOWN_SESSIONS:
                    self._answered.clear()
                self._answered.add(session)
        fut.set_result(rc)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transport is closed", details={"kind": "engine"})

    def _unregister_all(self) -> None:
        for addr in self._regions:
            self._engine.unregister_memory(addr)
        self._regions = []

    def close(self) -> None:
        """Refuses new reads, waits for those in flight (submitted, or running on other
        threads; each ends by Mooncake's transfer timeout at most), unregisters the memory.
        Idempotent."""
        with self._lock:
            first, self._closed = not self._closed, True
            # A read_blocks on another thread had its memory unregistered under it. A second
            # close waits too: its caller may free the memory once it returns.
            while self._reads:
                self._reads_ended.wait()
        if not first:
            return
        self._pool.shutdown(wait=True)
        with self._lock:
            self._unregister_all()
            self.layout = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
