"""Disaggregated prefill/decode roles of the KVSlotsConnector (``kv_role`` ``kv_producer`` /
``kv_consumer``), with vLLM's ``kv_transfer_params`` hand-off.

Producer (prefill worker). A request sent with ``kv_transfer_params: {"do_remote_decode": true}``
runs its prompt (``max_tokens`` 1). When it finishes, :meth:`PDScheduler.request_finished` keeps
its blocks (returns True) and answers with the parameters the decode worker needs::

    {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port",
     "remote_block_ids", "remote_block_size", "num_tokens", "remote_hold"}

``remote_hold`` ([producer life, hold number]) comes back with the consumer's ``done``: the
producer tells an ack for a hold that came and went (acked already, or timed out and forgotten)
from an early one, with no list of past holds to keep.

The blocks hold the prompt's KV in every registered layer: the target's and the drafter's (vLLM
registers the EAGLE / draft model layers with the connector like any other attention layer).
The producer's worker keeps them until the consumer says ``done`` on the control channel
(:mod:`kvslots.vllm.pd.control`) or ``pd_timeout_s`` passes, then reports the request in
``finished_sending`` and vLLM frees them.

Consumer (decode worker). A request arriving with those parameters is matched for all its prompt
tokens not already in the local prefix cache, asynchronously (``get_num_new_matched_tokens``
returns ``(n, True)``): the request waits in ``WAITING_FOR_REMOTE_KVS``, the batch does not. The
worker pulls the blocks (all layers, :class:`~kvslots.vllm.pd.transport.MooncakeTransport`) on a
background thread, acks the producer, and reports the request in ``finished_recving``. vLLM then
recomputes the last prompt token itself (the scheduler sets ``num_computed_tokens`` to the prompt
length minus one after a full remote load): its target KV and, for EAGLE, the drafter's KV at the
last position, the one that depends on the token after the prompt (the successor rule of the
EAGLE last block). So the decode worker computes one prompt token, not a block.

Only verified KV is shipped: a prefill request's blocks hold its prompt, which is never
speculative; drafts the prefill step proposed beyond the prompt are not sent (they lie past
``num_tokens``, and the decode worker recomputes from there).

Failures (prefill worker killed, restarted or silent, layouts or block sizes that differ, a
hold that timed out): the request is reported in ``failed_recving`` as well as
``finished_recving``; vLLM then recomputes it (``kv_load_failure_policy: "recompute"``) or fails
it with an error (``"fail"``, vLLM's default). A pull takes at most two Mooncake transfer
timeouts (each capped at ``pd_timeout_s`` by the consumer) and two control calls (a hello and
the ack, each two tries of the control timeout, ``min(10 s, pd_timeout_s)``); it reads twice
only when the first read failed and a new hello shows a restarted producer. A
producer whose control channel stops answering costs one call, not the ack too: its pull
fails after one transfer timeout (if a read was under way) and one call; a first
contact with a producer is probed first and fails after 10 s or ``pd_timeout_s``, whichever is
shorter (Mooncake's own hand-shake would wait 60 s; see ``pd/transport.py``). The producer frees
every held block at ack or timeout.

The control channel is authenticated when the workers share a secret, in the environment
variable ``KVSLOTS_PD_SECRET`` (or the one ``pd_secret_env`` names): see
:mod:`kvslots.vllm.pd.control`.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import secrets
from collections import OrderedDict, deque
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidStateError, TransferError, short_repr

logger = logging.getLogger(__name__)

__all__ = ["PDScheduler", "PDWorker", "PDStepMeta", "RecvSpec", "parse_remote_params"]

#: Acks kept for holds whose metadata has not reached the producer yet (normally a step's worth).
MAX_EARLY_ACKS = 65_536
#: Timed-out holds remembered for their late acks (the oldest forgotten first).
MAX_EXPIRED = 100_000
#: Longest id or host name of a hand-off, and so of a request id a ``done`` ack may name (vLLM's
#: ids are some dozen characters). Bounds the early-ack store to MAX_EARLY_ACKS such ids: a
#: control frame may hold 64 KiB, and 65,536 ids of that size were 4 GiB.
MAX_ID_CHARS = 512
#: Pulls running at once (threads, made as needed), over all prefill workers.
PULL_THREADS = 32
#: Of those, at most this many for prefill workers never contacted yet (one each), and at most
#: FAILING_THREADS for those whose last contact got no answer (gone, blackholed, hung): each
#: pull to such a host holds its thread for the control timeouts, so a few dead hosts held
#: every thread (two, all of them) and pulls from live ones waited behind them.
NEW_HOST_THREADS = 8
FAILING_THREADS = 2
#: Pulls from one prefill worker at once, once it answered (one at a time before).
PULLS_PER_HOST = 4
#: Prefill workers whose last contact is remembered (the oldest forgotten first: then new).
MAX_KNOWN_HOSTS = 4096


@dataclass
class RecvSpec:
    """Pull ``remote_block_ids`` of the producer into ``local_block_ids`` (may be empty: then
    only tell the producer it may free the request's blocks)."""

    req_id: str
    remote_req_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    local_block_ids: list[int]
    #: The hand-off's ``remote_hold`` (producer life, hold number), sent back with the ack.
    remote_hold: tuple[int, int] | None = None


@dataclass
class _Lane:
    """The pulls of one prefill worker (host, port): waiting, oldest first, and running."""

    queue: deque[RecvSpec] = field(default_factory=deque)
    running: int = 0


@dataclass
class PDStepMeta:
    #: producer: requests whose blocks the worker now holds for a consumer, with the hold in s
    holds: dict[str, float] = field(default_factory=dict)
    #: consumer: reads to start (or releases, with no blocks)
    recvs: list[RecvSpec] = field(default_factory=list)
    #: producer: the number of each hold (its hand-off's ``remote_hold``), increasing
    hold_seqs: dict[str, int] = field(default_factory=dict)
    #: producer: this producer's life (random, made at start; sent in the first step's metadata
    #: and with every hold), 0: not told
    hold_epoch: int = 0

    def __bool__(self) -> bool:
        return bool(self.holds or self.recvs or self.hold_epoch)


#: A hold number or producer life: a positive int msgpack carries.
_HOLD_MAX = (1 << 63) - 1


def _hold(v: Any) -> tuple[int, int] | None:
    """``remote_hold`` as (life, number), or None when it is not two ints in 1..2**63-1."""
    if (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= _HOLD_MAX for x in v)):
        return int(v[0]), int(v[1])
    return None


def parse_remote_params(params: Any, num_prompt_tokens: int | None = None) -> dict[str, Any] | None:
    """The producer's hand-off, checked; None when ``params`` ask for no remote prefill. A
    malformed hand-off is a :class:`TransferError` (kind ``"layout"``) naming the field.

    Only the ``remote_block_ids`` of the prompt's blocks are checked and kept: those of
    ``num_tokens`` tokens, and of at most ``num_prompt_tokens`` (the request's prompt) when
    given; a producer's list may go on (a request's lookahead blocks), and nothing past them is
    pulled."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None

    def bad(key: str) -> TransferError:
        # Bounded: the full repr of a client's 2**24 ids or 100 MB host went into the log line.
        return TransferError(f"kv_transfer_params.{key}={short_repr(params.get(key))} is not valid",
                             details={"kind": "layout"})

    out: dict[str, Any] = {}
    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        v = params.get(key)
        if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
            raise bad(key)
        out[key] = v
    for key, lo, hi in (("remote_port", 1, 65535), ("remote_block_size", 1, 1 << 20), ("num_tokens", 1, 1 << 31)):
        v = params.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad(key)
        out[key] = v
    # Absent from an older producer's hand-off: its ack is then taken as before.
    if "remote_hold" in params and params["remote_hold"] is not None:
        out["remote_hold"] = _hold(params["remote_hold"])
        if out["remote_hold"] is None:
            raise bad("remote_hold")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or not ids or len(ids) > 1 << 24:
        raise bad("remote_block_ids")
    # The prompt's blocks only: every id was checked, 2.8 s of the scheduler's thread (every
    # request waits) for a client's list of 2**24, again at each scheduling attempt.
    tokens = out["num_tokens"] if num_prompt_tokens is None else min(out["num_tokens"], max(1, num_prompt_tokens))
    ids = ids[:-(-tokens // out["remote_block_size"])]
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 40 for b in ids):
        raise bad("remote_block_ids")
    out["remote_block_ids"] = ids
    return out


class PDScheduler:
    """The scheduler side of both roles."""

    def __init__(self, *, engine_id: str, host: str, port: int, block_size: int, timeout_s: float,
                 producer: bool, consumer: bool):
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.producer = producer
        self.consumer = consumer
        self._matched: dict[str, tuple[int, dict[str, Any]]] = {}  # req -> (local hit tokens, params)
        self._recvs: list[RecvSpec] = []
        self._holds: dict[str, float] = {}
        self._hold_seqs: dict[str, int] = {}
        # This life's (a restarted producer's differs); under 2**53, as the hand-off may pass
        # through JSON readers that keep numbers as doubles.
        self._hold_epoch = secrets.randbits(52) + 1
        self._hold_seq = 0
        self._epoch_sent = False
        self.stats = {"remote_prefills": 0, "remote_tokens": 0, "bad_params": 0, "holds": 0}

    # ---- consumer ----
    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        """``(tokens to load, True)`` for a remote-prefilled request, None otherwise."""
        if not self.consumer:
            return None
        params = request.kv_transfer_params
        try:
            p = parse_remote_params(params, len(request.prompt_token_ids or ()))
        except TransferError as e:
            self.stats["bad_params"] += 1
            logger.warning("kvslots P/D: request %s: %s; computing it here", request.request_id, e)
            params["do_remote_prefill"] = False
            self._release_if_known(request.request_id, params)
            return 0, False
        if p is None:
            return None
        n_prompt = len(request.prompt_token_ids or ())
        need = math.ceil(n_prompt / self.block_size)
        why = None
        if p["remote_block_size"] != self.block_size:
            why = f"block size {p['remote_block_size']} on the prefill worker, {self.block_size} here"
        elif p["num_tokens"] != n_prompt:
            why = f"the prefill worker computed {p['num_tokens']} tokens, the prompt has {n_prompt}"
        elif len(p["remote_block_ids"]) < need:
            why = f"{len(p['remote_block_ids'])} remote blocks for a prompt of {need} blocks"
        if why is not None:
            self.stats["bad_params"] += 1
            logger.warning("kvslots P/D: request %s: %s; computing it here", request.request_id, why)
            params["do_remote_prefill"] = False
            self._recvs.append(self._spec(request.request_id, p, [], []))
            return 0, False
        count = n_prompt - num_computed_tokens
        logger.debug("kvslots P/D: request %s: %d prompt tokens, %d local, %d to pull from %s:%d",
                     request.request_id, n_prompt, num_computed_tokens, count, p["remote_host"], p["remote_port"])
        if count <= 0:
            return None
        self._matched[request.request_id] = (num_computed_tokens, p)
        return count, True

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> bool:
        """Plans the pull once vLLM allocated the blocks; True when the request is ours."""
        entry = self._matched.pop(request.request_id, None)
        if entry is None:
            return False
        local_hit, p = entry
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            self._recvs.append(self._spec(request.request_id, p, [], []))  # nothing to load: release
            return True
        n_prompt = len(request.prompt_token_ids or ())
        skip = local_hit // self.block_size
        need = math.ceil(n_prompt / self.block_size)
        local = list(block_ids[skip:need])
        remote = list(p["remote_block_ids"][skip:need])
        self._recvs.append(self._spec(request.request_id, p, remote, local))
        self.stats["remote_prefills"] += 1
        self.stats["remote_tokens"] += num_external_tokens
        return True

    def _spec(self, req_id: str, p: dict[str, Any], remote: list[int], local: list[int]) -> RecvSpec:
        return RecvSpec(req_id, p["remote_request_id"], p["remote_engine_id"], p["remote_host"], p["remote_port"],
                        remote, local, p.get("remote_hold"))

    def _release_if_known(self, req_id: str, params: Any) -> None:
        # A hand-off we cannot use still names a producer holding blocks: tell it to free them.
        if isinstance(params, dict) and isinstance(params.get("remote_host"), str) and isinstance(
                params.get("remote_port"), int) and isinstance(params.get("remote_request_id"), str):
            engine = params.get("remote_engine_id")  # not used by a release: not made text whatever it is
            self._recvs.append(RecvSpec(req_id, params["remote_request_id"], engine if isinstance(engine, str) else "",
                                        params["remote_host"], params["remote_port"], [], [],
                                        _hold(params.get("remote_hold"))))

    # ---- producer ----
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if self.consumer and isinstance(params, dict) and params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: the producer still holds the blocks.
            params["do_remote_prefill"] = False
            self._matched.pop(request.request_id, None)
            self._release_if_known(request.request_id, params)
            return False, None
        if not self.producer or not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None  # aborted or stopped early: nothing for a decode worker
        self._holds[request.request_id] = self.timeout_s
        self._hold_seq += 1
        self._hold_seqs[request.request_id] = self._hold_seq
        self.stats["holds"] += 1
        logger.debug("kvslots P/D: request %s: holding %d blocks for a decode worker", request.request_id,
                     len(block_ids))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_block_size": self.block_size,
            "num_tokens": len(request.prompt_token_ids or ()),
            "remote_hold": [self._hold_epoch, self._hold_seq],
        }

    def build(self) -> PDStepMeta | None:
        # The first step tells the worker this life's number, before any hand-off can be acked.
        first = self.producer and not self._epoch_sent
        if not self._recvs and not self._holds and not first:
            return None
        self._epoch_sent = True
        meta = PDStepMeta(holds=self._holds, recvs=self._recvs, hold_seqs=self._hold_seqs,
                          hold_epoch=self._hold_epoch if self.producer else 0)
        self._holds, self._recvs, self._hold_seqs = {}, [], {}
        return meta

    def has_pending(self) -> bool:
        return bool(self._recvs or self._holds or (self.producer and not self._epoch_sent))


class PDWorker:
    """The worker side of both roles: the Mooncake transport over this rank's KV cache, the
    producer's control server and held requests, the consumer's background pulls."""

    def __init__(self, *, engine_id: str, host: str, port: int, block_size: int, model: str, timeout_s: float,
                 producer: bool, consumer: bool, control_timeout_s: float = 10.0, secret: bytes | None = None):
        from ..pd.control import _secret

        self._secret = _secret(secret)  # the control channel's shared secret (None: not authenticated)
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.block_size = block_size
        self.model = model
        self.timeout_s = timeout_s
        self.control_timeout_s = min(control_timeout_s, timeout_s)
        self.producer = producer
        self.consumer = consumer
        self.transport: Any = None
        self.layout: Any = None
        self._server: Any = None
        self._lock = threading.Lock()
        # producer: req -> (deadline (monotonic), hold number; 0: not told)
        self._held: dict[str, tuple[float, int]] = {}
        # (deadline, req) of the holds, soonest first; an entry whose hold was acked (or held
        # again) is skipped when it comes up. Every step scanned every hold: 8 ms a step with
        # 50,000 held, on the worker's thread.
        self._deadlines: list[tuple[float, str]] = []
        self._early_acks: OrderedDict[str, float] = OrderedDict()  # acks that came before the hold's metadata
        # Holds that timed out, oldest first, for the late consumer's ack (answered held: False).
        self._expired: OrderedDict[str, int | None] = OrderedDict()  # -> its hold number (0, None: not told)
        self._hold_epoch = 0  # this producer's life (from the scheduler's first step), 0: not told yet
        self._hold_seen = 0  # the highest hold number whose metadata came: every lower one came too
        self._sending_done: set[str] = set()
        self._recving_done: set[str] = set()
        self._recving_failed: set[str] = set()
        self._peers: dict[tuple[str, int], dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(max_workers=PULL_THREADS, thread_name_prefix="kvslots-pd-pull") \
            if consumer else None
        # Pulls wait in one lane per prefill worker and start within the thread budgets above
        # (the pool never queues): a host that does not answer holds at most its budget's threads.
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._answers: OrderedDict[tuple[str, int], bool] = OrderedDict()  # host -> its last contact answered
        # host -> the start of the pull that last set its _answers: an older pull's answer is
        # stale (one timing out after a newer one succeeded marked a live host failing).
        self._answered_at: dict[tuple[str, int], float] = {}
        self._running = {"live": 0, "new": 0, "failing": 0}
        self._closing = False
        self.stats = {"pulled_blocks": 0, "pulled_bytes": 0, "failed_pulls": 0, "acks": 0, "bad_acks": 0,
                      "expired": 0, "unknown_acks": 0}

    # ---- set-up ----
    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        from ..pd import BlockLayout, MooncakeTransport
        from ..pd.transport import MOONCAKE_TRANSFER_TIMEOUT_S

        self.layout = BlockLayout.from_tensors(kv_caches, num_blocks)
        # A pull still running after pd_timeout_s is useless (the producer's hold has expired and
        # the ack says so), so a consumer gives a silent producer no longer than that.
        cap = min(self.timeout_s, MOONCAKE_TRANSFER_TIMEOUT_S) if self.consumer else None
        self.transport = MooncakeTransport(self.host, transfer_timeout_s=cap)
        self.transport.register(self.layout)
        if self.producer:
            from ..pd.control import ControlServer

            self._server = ControlServer(self.host, self.port, self._handle, secret=self._secret)
        logger.info("kvslots P/D worker (%s%s): %d segments (%d layers incl. draft), %d bytes per block, "
                    "Mooncake session %s", "producer" if self.producer else "", " consumer" if self.consumer else "",
                    len(self.layout.segments), len(kv_caches), self.layout.bytes_per_block, self.transport.session_id)

    # ---- producer ----
    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "hello":
            return {"session": self.transport.session_id, "layout": self.layout.to_wire(), "engine_id": self.engine_id,
                    "block_size": self.block_size, "model": self.model}
        if op == "done":
            req = msg.get("req")
            if not isinstance(req, str):
                raise ValueError("done needs req")
            if len(req) > MAX_ID_CHARS:  # no hand-off of ours names such an id (parse_remote_params)
                with self._lock:
                    self.stats["bad_acks"] += 1
                raise ValueError(f"done: req of {len(req)} characters (at most {MAX_ID_CHARS})")
            hold = _hold(msg.get("hold"))  # None from a consumer that does not send it
            now = time.monotonic()
            with self._lock:
                self.stats["acks"] += 1
                # An ack names a hold by its id and number: ids repeat (a replayed ack, or
                # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION), and an earlier hold's ack released the
                # current one and was answered held: True. Only by the id when either has no number.
                def this(number: int | None) -> bool:
                    return hold is None or not number or hold == (self._hold_epoch, number)

                if req in self._expired and this(self._expired[req]):
                    del self._expired[req]
                    return {"held": False}
                if req in self._held and this(self._held[req][1]):
                    del self._held[req]
                    self._sending_done.add(req)
                elif hold is not None and (hold[0] != self._hold_epoch or hold[1] <= self._hold_seen):
                    # Not held and not early: its hold's metadata came (holds come in number
                    # order) and went (acked already, or timed out and forgotten past
                    # MAX_EXPIRED), or it is of another life of this producer (restarted; the
                    # first step tells the life before any hand-off can exist). Answered held
                    # before: the consumer used blocks the producer had freed.
                    self.stats["unknown_acks"] += 1
                    return {"held": False, "unknown": True}
                else:  # the hold's metadata is not here yet: vLLM still holds the blocks
                    self._early_acks[req] = now
                    self._early_acks.move_to_end(req)  # oldest first, for the trims below
                    # Bounded: a peer acking ids that never come would grow this for 10 minutes.
                    # Dropping the oldest only makes its hold (if it ever comes) wait for its timeout.
                    while len(self._early_acks) > MAX_EARLY_ACKS:
                        self._early_acks.popitem(last=False)
            return {"held": True}
        raise ValueError(f"unknown op {op!r}")

    def on_step(self, meta: PDStepMeta | None) -> None:
        if meta is None:
            return
        if meta.hold_epoch or meta.holds:
            now = time.monotonic()
            # One locked section, the holds before the number that says they came: an ack
            # between the two (in two sections) found its number seen and its hold not held,
            # and was answered unknown (the consumer dropped a good pull, the blocks waited
            # for pd_timeout_s).
            with self._lock:
                if meta.hold_epoch and meta.hold_epoch != self._hold_epoch:
                    self._hold_epoch, self._hold_seen = meta.hold_epoch, 0
                for req, hold_s in meta.holds.items():
                    if self._early_acks.pop(req, None) is not None:
                        self._sending_done.add(req)
                    else:
                        self._held[req] = (now + hold_s, meta.hold_seqs.get(req, 0) if meta.hold_epoch else 0)
                        heapq.heappush(self._deadlines, (now + hold_s, req))
                if meta.hold_epoch and meta.hold_seqs:
                    self._hold_seen = max(self._hold_seen, max(meta.hold_seqs.values()))
        if meta.recvs:
            if self._pool is None:
                raise InvalidStateError("kvslots P/D: pulls in the step of a worker that is not a consumer")
            with self._lock:
                if self._closing:
                    return
                for spec in meta.recvs:
                    key = (spec.remote_host, spec.remote_port)
                    self._lanes.setdefault(key, _Lane()).queue.append(spec)
                self._dispatch()

    def _kind(self, key: tuple[str, int]) -> str:
        answered = self._answers.get(key)
        return "new" if answered is None else "live" if answered else "failing"

    def _dispatch(self) -> None:
        """Starts the waiting pulls the budgets allow (under ``_lock``)."""
        budget = {"live": PULL_THREADS, "new": NEW_HOST_THREADS, "failing": FAILING_THREADS}
        # Round-robin, one pull per lane a round, and a lane goes to the back when one of its
        # pulls starts or ends: walked from the start, each lane filled, 8 busy prefill workers
        # took every thread and a 9th waited until they drained. A lane that could start
        # nothing cannot later in the same call (the budgets only fill): each round walks the
        # lanes that started one in the round before.
        keys = list(self._lanes)
        while keys:
            again = []
            for key in keys:
                lane = self._lanes[key]
                kind = self._kind(key)
                per_host = PULLS_PER_HOST if kind == "live" else 1
                if (lane.queue and lane.running < per_host and sum(self._running.values()) < PULL_THREADS
                        and self._running[kind] < budget[kind]):
                    spec = lane.queue.popleft()
                    lane.running += 1
                    self._running[kind] += 1
                    assert self._pool is not None
                    self._pool.submit(self._run_pull, key, kind, spec)
                    self._lanes[key] = self._lanes.pop(key)
                    again.append(key)
                elif not lane.queue and not lane.running:
                    del self._lanes[key]
            keys = again

    def _run_pull(self, key: tuple[str, int], kind: str, spec: RecvSpec) -> None:
        answered: bool | None = None
        started = time.monotonic()
        try:
            answered = self._pull(spec)
        finally:
            gave_up: list[RecvSpec] = []
            with self._lock:
                lane = self._lanes.pop(key, None) or _Lane()
                self._lanes[key] = lane  # to the back (round-robin: see _dispatch)
                lane.running -= 1
                self._running[kind] -= 1
                if answered is not None and started < self._answered_at.get(key, started):
                    answered = None  # a newer pull's answer is more recent news of this host
                if answered is not None:
                    self._answers[key] = answered
                    self._answered_at[key] = started
                    self._answers.move_to_end(key)
                    while len(self._answers) > MAX_KNOWN_HOSTS:
                        self._answered_at.pop(self._answers.popitem(last=False)[0], None)
                if answered is False:
                    # Those waiting for a host that just did not answer fail now (recomputed),
                    # each would wait the same timeouts; later ones try it again, one at a time.
                    gave_up, lane.queue = list(lane.queue), deque()
                if not self._closing:
                    self._dispatch()
            for s in gave_up:
                self._finish(s, False)
            if gave_up:
                logger.warning("kvslots P/D: prefill worker %s:%d did not answer; %d pull(s) waiting for it failed "
                               "without trying it", key[0], key[1], len(gave_up))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, req = heapq.heappop(self._deadlines)
                entry = self._held.get(req)
                if entry is not None and entry[0] == deadline:
                    del self._held[req]
                    self._expired[req] = entry[1]
                    self._sending_done.add(req)
                    self.stats["expired"] += 1
                    logger.warning("kvslots P/D: no decode worker took request %s within %.0f s; freeing its blocks",
                                   req, self.timeout_s)
            if len(self._deadlines) > 2 * len(self._held) + 1024:
                # Mostly acked holds waiting for their deadline (a day at most): rebuilt from
                # the held ones, so the heap stays within twice them (amortized linear).
                self._deadlines = [(d, r) for r, (d, _) in self._held.items()]
                heapq.heapify(self._deadlines)
            # Oldest first (OrderedDict: a plain dict's first key, after many deletions from the
            # front, is found by skipping every deleted slot, 1 s for a burst of 50,000 here).
            while self._early_acks and now - next(iter(self._early_acks.values())) > 600:
                self._early_acks.popitem(last=False)
            # The oldest go past MAX_EXPIRED: all were cleared at once, so a late ack for a hold
            # that had just timed out was taken for an early one and answered held: True, and the
            # consumer used blocks the producer had freed.
            while len(self._expired) > MAX_EXPIRED:
                self._expired.popitem(last=False)

    # ---- consumer ----
    def _hello(self, spec: RecvSpec) -> dict[str, Any]:
        from ..pd import BlockLayout
        from ..pd.control import control_call

        key = (spec.remote_host, spec.remote_port)
        info = self._peers.get(key)
        if info is None or info.get("engine_id") != spec.remote_engine_id:  # first time, or a restarted producer
            info = control_call(spec.remote_host, spec.remote_port, {"op": "hello"}, timeout_s=self.control_timeout_s,
                                secret=self._secret)
            info["layout_obj"] = BlockLayout.from_wire(info.get("layout"))
            with self._lock:
                # Bounded: hand-offs (a client's kv_transfer_params) may name any host and port
                # that answers, each kept with its layout (some KiB) for good. A host's new hello
                # replaces its old one (and goes last) without dropping another's.
                self._peers.pop(key, None)
                while len(self._peers) >= MAX_KNOWN_HOSTS:
                    del self._peers[next(iter(self._peers))]
                self._peers[key] = info
        if info.get("engine_id") != spec.remote_engine_id:
            raise TransferError(f"prefill worker {key[0]}:{key[1]} is engine {info.get('engine_id')!r}, the request "
                                f"was prefilled by {spec.remote_engine_id!r} (restarted?)", details={"kind": "peer"})
        if info.get("block_size") != self.block_size or info.get("model") != self.model:
            raise TransferError(f"prefill worker runs model {info.get('model')!r} with block size "
                                f"{info.get('block_size')}, this one {self.model!r} with {self.block_size}",
                                details={"kind": "layout"})
        return info

    def _read(self, info: dict[str, Any], spec: RecvSpec) -> int:
        self.layout.check_compatible(info["layout_obj"])
        return int(self.transport.read_blocks(info["session"], info["layout_obj"], spec.remote_block_ids,
                                              spec.local_block_ids))

    def _pull(self, spec: RecvSpec) -> bool | None:
        """Pulls and acks one request; whether the prefill worker's control channel answered
        (None: not asked)."""
        from ..pd.control import control_call

        from ..pd.control import _unpin_thread

        _unpin_thread()
        ok = True
        answered: bool | None = None
        t0 = time.monotonic()
        logger.debug("kvslots P/D: request %s: pulling %d blocks from %s:%d", spec.req_id, len(spec.local_block_ids),
                     spec.remote_host, spec.remote_port)
        try:
            if spec.local_block_ids:
                key = (spec.remote_host, spec.remote_port)
                cached = key in self._peers
                try:
                    info = self._hello(spec)
                except TransferError as e:
                    # No answer at all (kind "timeout"): the ack would wait as long again for
                    # nothing; the producer's hold expires.
                    answered = e.details.get("kind") != "timeout"
                    raise
                answered = True
                try:
                    nbytes = self._read(info, spec)
                except Exception:
                    # The hello kept from before may be stale: a producer restarted on the same
                    # port under the same engine id (a fixed kv_transfer_config engine_id) has
                    # a new Mooncake session and memory, and every later pull read the old ones
                    # and failed, until this worker restarted. Asked again; read again if new.
                    with self._lock:
                        if self._peers.get(key) is info:
                            del self._peers[key]
                    if not cached:
                        raise
                    try:
                        fresh = self._hello(spec)
                    except TransferError as e:
                        # The last contact is what counts: a producer that answered once and
                        # died since stayed "live" (4 threads, its queue not failed, the ack
                        # waited out as well).
                        answered = e.details.get("kind") != "timeout"
                        raise
                    if fresh["session"] == info["session"] and fresh.get("layout") == info.get("layout"):
                        raise
                    nbytes = self._read(fresh, spec)
                with self._lock:
                    self.stats["pulled_blocks"] += len(spec.local_block_ids)
                    self.stats["pulled_bytes"] += nbytes
        except TransferError as e:
            ok = False
            logger.warning("kvslots P/D: request %s: pulling %d blocks failed: %s", spec.req_id,
                           len(spec.local_block_ids), e)
        except Exception:  # never leave a request waiting on a thread that died
            ok = False
            logger.exception("kvslots P/D: request %s: pull failed", spec.req_id)
        try:
            if answered is False:
                raise TransferError("not tried: the prefill worker's control channel did not answer",
                                    details={"kind": "timeout"})
            ack: dict[str, Any] = {"op": "done", "req": spec.remote_req_id}
            if spec.remote_hold is not None:
                ack["hold"] = list(spec.remote_hold)
            reply = control_call(spec.remote_host, spec.remote_port, ack, timeout_s=self.control_timeout_s,
                                 secret=self._secret)
            answered = True
            if spec.local_block_ids and not reply.get("held", False):
                ok = False
                logger.warning("kvslots P/D: request %s: the prefill worker freed its blocks before the pull ended",
                               spec.req_id)
        except TransferError as e:
            if ok and spec.local_block_ids:
                # The bytes arrived, but the producer could not confirm it still held them.
                ok = False
            answered = e.details.get("kind") != "timeout"  # the last exchange's answer
            logger.warning("kvslots P/D: request %s: ack to the prefill worker failed: %s", spec.req_id, e)
        logger.debug("kvslots P/D: request %s: pull and ack done in %.3f s, ok=%s", spec.req_id,
                     time.monotonic() - t0, ok)
        self._finish(spec, ok)
        return answered

    def _finish(self, spec: RecvSpec, ok: bool) -> None:
        with self._lock:
            if not spec.local_block_ids:
                return  # a release: vLLM is not waiting on it
            if not ok:
                self.stats["failed_pulls"] += 1
                self._recving_failed.add(spec.req_id)
            self._recving_done.add(spec.req_id)

    # ---- per step ----
    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._expire()
        with self._lock:
            out = (self._sending_done, self._recving_done, self._recving_failed)
            self._sending_done, self._recving_done, self._recving_failed = set(), set(), set()
        return out

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        if self._pool is not None:
            with self._lock:
                self._closing = True  # the waiting pulls are dropped (the engine is going)
                for lane in self._lanes.values():
                    lane.queue.clear()
            self._pool.shutdown(wait=True)
        if self._server is not None:
            self._server.close()
        if self.transport is not None:
            self.transport.close()


def make_pd(vllm_config: Any, kv_cache_config: Any, is_scheduler: bool, cfg: Any,
            block_size: int) -> tuple[PDScheduler | None, PDWorker | None]:
    """The P/D halves for this connector instance: none unless ``kv_role`` is ``kv_producer`` or
    ``kv_consumer`` (or ``kv_both`` with ``pd_port`` set: both roles, chosen per request)."""
    from ...config.connector import ConnectorConfigError

    ktc = vllm_config.kv_transfer_config
    role = ktc.kv_role
    producer = role == "kv_producer" or (role == "kv_both" and cfg.pd_port is not None)
    consumer = role == "kv_consumer" or (role == "kv_both" and cfg.pd_port is not None)
    if not (producer or consumer):
        return None, None
    if producer and cfg.pd_port is None:
        raise ConnectorConfigError("kv_connector_extra_config.pd_port: a kv_producer needs the port its decode "
                                   "workers reach it at")
    pc = vllm_config.parallel_config
    if pc.world_size != 1:
        raise ConnectorConfigError(f"disaggregated prefill/decode supports one worker rank for now (world size "
                                   f"{pc.world_size})")
    engine_id = str(ktc.engine_id)
    port = cfg.pd_port or 0
    if is_scheduler:
        return PDScheduler(engine_id=engine_id, host=cfg.pd_host, port=port, block_size=block_size,
                           timeout_s=cfg.pd_timeout_s, producer=producer, consumer=consumer), None
    return None, PDWorker(engine_id=engine_id, host=cfg.pd_host, port=port, block_size=block_size,
                          model=_model_key(vllm_config), timeout_s=cfg.pd_timeout_s, producer=producer,
                          consumer=consumer, secret=pd_secret(cfg.pd_secret_env))


#: The environment variable holding the P/D control channel's shared secret, unless the extra
#: config's ``pd_secret_env`` names another. An environment variable, not a config value: vLLM
#: logs its whole kv_transfer_config at start.
SECRET_ENV = "KVSLOTS_PD_SECRET"


def pd_secret(env: str | None = None) -> bytes | None:
    """The shared secret from the environment variable ``env`` (:data:`SECRET_ENV` when None),
    or None when :data:`SECRET_ENV` is unset or empty; one too short, or a variable ``env``
    names that is unset or empty, is a ConnectorConfigError."""
    from ...config.connector import ConnectorConfigError, check_key
    from ..pd.control import MIN_SECRET_BYTES

    name = SECRET_ENV if env is None else check_key("pd_secret_env", env)
    value = os.environb.get(os.fsencode(name), b"")  # its bytes as given, whatever the locale
    if not value and env is not None:
        # Named on purpose: a typo, or the variable not exported to this worker, turned
        # authentication off without a word.
        raise ConnectorConfigError(f"kv_connector_extra_config.pd_secret_env names ${name}, which is not set or "
                                   "empty on this worker: set the P/D secret there, or drop pd_secret_env")
    if not value:
        return None
    if len(value) < MIN_SECRET_BYTES:
        raise ConnectorConfigError(f"the P/D secret in ${name} has {len(value)} bytes; at least {MIN_SECRET_BYTES} "
                                   "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return value


def _model_key(vllm_config: Any) -> str:
    """What must match between the two workers beyond the layout: the target model's
    architecture and the drafter's method (not the path: the two may load one checkpoint from
    two directories)."""
    hf = vllm_config.model_config.hf_config
    spec = vllm_config.speculative_config
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    draft = str(spec.method) if spec is not None else "none"
    return f"{arch}/{getattr(hf, 'num_hidden_layers', '?')}L/draft={draft}"
