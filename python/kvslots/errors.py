"""Typed exceptions raised by kvslots.

Every error carries the request it is about (``request_id``, ``None`` when the error concerns no
single request) and the numbers involved as attributes; the message names them too. A call that
raises has changed nothing.
"""

from __future__ import annotations

from typing import Any


class SlotError(Exception):
    """Root of every kvslots error."""

    request_id: str | None
    details: dict[str, int]

    def __init__(self, message: str, request_id: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.details = dict(details or {})
        for key, value in self.details.items():
            setattr(self, key, value)


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


class EventDecodeError(InvalidArgumentError):
    """A KV event payload that is not a msgpack ``KVEventBatch``; nothing of it was applied."""


class UnknownWorkerError(SlotError, KeyError):
    """The prefix index has no worker of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateWorkerError(SlotError):
    """The prefix index already has a worker of that name."""


__all__ = [
    "SlotError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocksError",
    "InvalidRollbackError",
    "CapacityExceededError",
    "InvalidArgumentError",
    "EventDecodeError",
    "UnknownWorkerError",
    "DuplicateWorkerError",
]
