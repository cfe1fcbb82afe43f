"""Typed exceptions raised by kvslots: one root, :class:`KVSlotsError`, and a subclass per kind.

    KVSlotsError
    ├── SlotError                  the slot core (request and block bookkeeping)
    │   ├── UnknownRequestError, DuplicateRequestError, OutOfBlocksError,
    │   │   InvalidRollbackError, CapacityExceededError
    │   ├── InvalidArgumentError   a malformed argument (also a ValueError)
    │   │   ├── ArgumentTypeError  an argument of the wrong type (also a TypeError)
    │   │   └── EventDecodeError   a KV event payload that does not decode
    │   ├── ConcurrentUseError     an object already in use by a call of this or another thread
    │   └── UnknownWorkerError, DuplicateWorkerError   the prefix index's or an event subscriber's
    │                              workers (also a KeyError, a ValueError)
    ├── InvalidStateError          an object shut down, stopped or already started (also a RuntimeError)
    ├── NotCopyableError           pickling or copying an object holding live state (also a TypeError)
    ├── ConfigError                a configuration kvslots cannot accept (also a ValueError)
    │   ├── ConnectorConfigError   the connector's kv_connector_extra_config
    │   └── UnsupportedVLLMVersionError   not vLLM 0.32.x or 0.33.x (kvslots.vllm.compat)
    ├── DiskTierError              the disk tier's file (I/O)
    ├── OutOfDescriptorsError      too few file descriptors left for a call's sockets (also an OSError)
    ├── TransferError              a KV transfer between prefill and decode workers (Mooncake)
    └── ServeError                 ``kvslots serve`` cannot build or run the vLLM command

Every error carries the request it is about (``request_id``, ``None`` when the error concerns no
single request) and the numbers involved as attributes, exact ints (a count of tokens or blocks
can pass 2**64); the message names them too. A call that raises has changed nothing. Every class
pickles (exceptions cross vLLM's process boundaries), attributes included.
"""

from __future__ import annotations

import reprlib
from typing import Any


#: Longest message an error keeps: a longer one keeps its start and end (a value quoted whole,
#: a 1 MB path say, made a 1 MB message). The CLI cuts its lines shorter (``cli.one_line``).
MAX_MESSAGE_CHARS = 4096


def _bounded(message: Any) -> Any:
    if not isinstance(message, str) or len(message) <= MAX_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_MESSAGE_CHARS
    return f"{message[:3 * MAX_MESSAGE_CHARS // 4]} ... ({cut} characters cut) ... {message[-MAX_MESSAGE_CHARS // 4:]}"


class KVSlotsError(Exception):
    """Root of every kvslots error."""

    request_id: str | None
    details: dict[str, int]

    def __init__(self, message: str, request_id: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(_bounded(message))
        self.request_id = request_id
        self.details = dict(details or {})
        for key, value in self.details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without calling __init__ (subclasses take other arguments, some keyword-only):
        # the args as given, then every attribute from __dict__.
        return _rebuild, (type(self), self.args), self.__dict__


def _rebuild(cls: type[KVSlotsError], args: tuple[Any, ...]) -> KVSlotsError:
    return cls.__new__(cls, *args)


class SlotError(KVSlotsError):
    """An error of the slot core: a request, block or argument it cannot accept."""


class UnknownRequestError(SlotError, KeyError):
    """The request has no slot."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(SlotError):
    """The request already has a slot."""


class OutOfBlocksError(SlotError):
    """Not enough free or evictable blocks; attributes ``needed``, ``available``, ``total``."""

    needed: int
    available: int
    total: int


class InvalidRollbackError(SlotError):
    """Rolling back more tokens than are pending (into committed ones); attributes
    ``requested``, ``pending``, ``committed``."""

    requested: int
    pending: int
    committed: int


class CapacityExceededError(SlotError):
    """More tokens than reserved, or than the per-slot limit; attributes ``requested``, ``limit``."""

    requested: int
    limit: int


class InvalidArgumentError(SlotError, ValueError):
    """A malformed argument (negative count, wrong length, out-of-range token id, ...)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a float, bool or str where an int is expected, a
    non-sequence where a sequence is, a numpy array of a non-integer dtype or of the wrong
    shape). Also a :class:`TypeError`, so ``except TypeError`` still catches it."""


class ConcurrentUseError(SlotError, RuntimeError):
    """The object is in the middle of another call: a re-entrant call (an argument's
    ``__index__`` or ``__iter__`` calling back into the same object) or, where an object does
    not serialize its callers, a call from another thread. Nothing was changed; retry once the
    other call has returned."""


class ConfigError(KVSlotsError, ValueError):
    """A configuration kvslots cannot accept: a TRT-LLM engine YAML, a speculators checkpoint's
    config.json or a dynamic speculative-decoding schedule.

    ``field`` is the dotted path of the offending key (``speculative_config.max_draft_len``,
    ``num_speculative_tokens_per_batch_size[2]``), ``None`` when the document as a whole is bad;
    ``source`` names the file when there is one. The message starts with both.
    """

    field: str | None
    source: str | None

    def __init__(self, message: str, field: str | None = None, source: str | None = None):
        text = f"{field}: {message}" if field else message
        if source:
            text = f"{source}: {text}"
        super().__init__(text)
        self.field = field
        self.source = source
        self.reason = message


class ConnectorConfigError(ConfigError):
    """A bad ``kv_connector_extra_config`` of the KVSlotsConnector; the message names the key and
    the value, and stops vLLM at start-up."""


class UnsupportedVLLMVersionError(ConfigError):
    """The installed vLLM is not one kvslots supports; attribute ``version`` (the string)."""

    version: str

    def __init__(self, message: str, *, version: str) -> None:
        super().__init__(message)
        self.version = version


class ServeError(KVSlotsError):
    """``kvslots serve`` cannot build or run the vLLM command (bad flags, a missing model
    directory, conflicting options); the message says which."""


class DiskTierError(KVSlotsError):
    """The disk tier's file cannot be read or written (an I/O error); the message names the
    file. A corrupt record is not an error: it is reported and recomputed."""


class TransferError(KVSlotsError):
    """A KV block transfer between a prefill and a decode worker failed: ``kind`` says why
    (``"timeout"``, ``"peer"``: the remote engine is gone or refused, ``"layout"``: the two
    workers' block layouts or models differ, ``"engine"``: the transfer engine itself failed).
    The destination blocks hold undefined bytes; the request is recomputed or fails."""

    kind: str


class EventDecodeError(InvalidArgumentError):
    """A KV event payload that is not a msgpack ``KVEventBatch``; nothing of it was applied."""


class UnknownWorkerError(SlotError, KeyError):
    """The prefix index, or an event subscriber, has no worker (publisher) of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateWorkerError(SlotError, ValueError):
    """The prefix index, or an event subscriber, already has a worker (publisher) of that name.
    Also a :class:`ValueError` (what the subscriber raised before)."""


class InvalidStateError(KVSlotsError, RuntimeError):
    """The object cannot take the call in its state: it was shut down or stopped (an event
    publisher or subscriber), or it is already started. Nothing was changed. Also a
    :class:`RuntimeError`."""


class OutOfDescriptorsError(KVSlotsError, OSError):
    """Too few file descriptors are left under the process's limit (``RLIMIT_NOFILE``, ``ulimit
    -n``) for the ZMQ context and sockets a call would open (an event publisher or subscriber).
    Nothing was opened. Attributes ``needed``, ``available``, ``limit`` and ``errno``
    (``EMFILE``). Also an :class:`OSError`. Checked beforehand because libzmq aborts the process,
    rather than failing the call, when it cannot open its own threads' descriptors."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt through __init__: OSError keeps its args and errno outside __dict__.
        return type(self), (self.args[0] if self.args else "", self.request_id, self.details)


class NotCopyableError(KVSlotsError, TypeError):
    """``pickle``, ``copy.copy`` or ``copy.deepcopy`` of an object holding live state: of the Rust
    extension (``kvslots._core``: a slot manager, a cache, an index, a disk store, a memory
    region, ...; its plain values ``SlotInfo``, ``ApplyStats`` and ``KVBlocks`` do copy), an
    event publisher or subscriber, the reference slot manager. They hold native state (memory,
    locks, open files, sockets, threads, the Python objects they were built from) that a copy
    would silently duplicate or detach, so every one refuses; the message names the class and
    why. The object is unchanged and stays usable. Also a
    :class:`TypeError` (what pickling raised before)."""


class NoCopy:
    """Base of the package's Python classes that hold live state (sockets, threads, locks, file
    descriptors): ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise :class:`NotCopyableError`
    naming the class and :attr:`_copy_refusal`, as the extension's objects do
    (``errors::refuse_copy``). ``copy.copy`` made a second object sharing the first one's
    sockets and thread (its ``shutdown`` closed them under the original), ``pickle`` and
    ``deepcopy`` failed on whichever lock came first with a builtin error."""

    __slots__ = ()
    _copy_refusal = "it holds live state"

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle, copy.copy and copy.deepcopy all ask it
        cls = type(self)
        raise NotCopyableError(f"cannot pickle or copy {cls.__module__}.{cls.__qualname__}: {self._copy_refusal}")

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr (a container's first items and levels, a str's start and end), with
    bytes cut before they are printed too."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 80, 80

    # As a str: the repr of its first maxstring items only.
    repr_bytes = repr_bytearray = reprlib.Repr.repr_str


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any) -> str:
    """``value`` as an error message shows it: at most about 80 characters, made without
    printing the whole of a huge argument (the repr of 10**8 bytes cost 760 MB and 1.4 s, of
    10**7 lists 3 s, before the message cut it) or recursing through a deep one; an object
    whose own ``__repr__`` raises is shown by its type. The extension's messages use it too."""
    try:
        r = _SHORT_REPR.repr(value)
    except Exception:  # a container item's __repr__ raising is caught by reprlib itself
        return f"<{type(value).__name__} object>"
    return r if len(r) <= 80 else r[:77] + "..."


__all__ = [
    "KVSlotsError",
    "SlotError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocksError",
    "InvalidRollbackError",
    "CapacityExceededError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "ConcurrentUseError",
    "ConfigError",
    "ConnectorConfigError",
    "UnsupportedVLLMVersionError",
    "ServeError",
    "DiskTierError",
    "TransferError",
    "EventDecodeError",
    "UnknownWorkerError",
    "DuplicateWorkerError",
    "InvalidStateError",
    "NotCopyableError",
    "OutOfDescriptorsError",
]
