"""Dynamic speculative decoding: the number of draft tokens K as a function of the batch size.

vLLM 0.32 takes the schedule as ``speculative_config.num_speculative_tokens_per_batch_size``: a
list of ``[range_start, range_end, K]`` rows with inclusive batch-size ranges. Its scheduler looks
up K by the number of requests scheduled in the step (``len(num_scheduled_tokens)``, prefills
included), but it keeps reserving KV slots for the *maximum* K (``num_lookahead_tokens`` is
``num_speculative_tokens``). A slot manager that follows the K in force instead returns the
surplus lookahead blocks as soon as K drops; :func:`apply_lookahead` does that for a batch and
:func:`lookahead_array` gives the per-request ``lookahead`` for :meth:`SlotManager.step`.

kvslots validates schedules more strictly than vLLM, so a schedule is unambiguous to read:

* rows are ``[start, end, K]`` with integers, ``1 <= start <= end`` and ``0 <= K <= num_speculative_tokens``
  (vLLM silently clamps a larger K to ``num_speculative_tokens``; kvslots rejects it);
* the first row starts at batch size 1 and each next row starts right after the previous one
  ends (vLLM sorts the rows and fills a gap with the previous K; kvslots rejects unsorted rows,
  gaps and overlaps);
* batch sizes beyond the last row keep the last row's K (as in vLLM).

K = 0 turns speculation off at those batch sizes. Every error is a :class:`~kvslots.ConfigError`
whose ``field`` names the row (``...num_speculative_tokens_per_batch_size[2]``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import ArgumentTypeError, ConfigError
from .loader import INT_MAX, MAX_NODES, brief

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
DEFAULT_FIELD = f"speculative_config.{SCHEDULE_KEY}"

Row = tuple[int, int, int]

#: Batch-size bounds of the per-step queries: a C int of requests; a dense table of at most 2**24.
MAX_BATCH = 2**31 - 1
MAX_DENSE = 2**24
UINT32_MAX = 2**32 - 1
#: Most rows (or draft_len_schedule entries) of a schedule: a file holds fewer (loader.MAX_NODES
#: values); an iterator passed in code is not read past it.
MAX_ROWS = MAX_NODES


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {brief(value)}"


def _strict_int(value: Any, field: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {_describe(value)}", field)
    return int(value)


@dataclass(frozen=True)
class DynamicSDSchedule:
    """A validated batch-size -> K schedule (build it with :meth:`parse` or the ``from_*`` helpers)."""

    rows: tuple[Row, ...]
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        # Direct construction is validated too, types included (a str in a row is a ConfigError).
        rows, nst = _typed(self.rows, self.num_speculative_tokens, DEFAULT_FIELD)
        _validate(rows, nst, DEFAULT_FIELD)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "num_speculative_tokens", nst)
        object.__setattr__(self, "_starts", [r[0] for r in rows])

    # ---------------------------------------------------------------- construction

    @classmethod
    def parse(
        cls, rows: Any, num_speculative_tokens: Any, *, field: str = DEFAULT_FIELD
    ) -> DynamicSDSchedule:
        """Validates ``rows`` (a list of ``[start, end, K]``) against ``num_speculative_tokens``.

        ``field`` is the dotted path used in error messages.
        """
        parsed, nst = _typed(rows, num_speculative_tokens, field)
        _validate(parsed, nst, field)
        return cls(parsed, nst)

    @classmethod
    def from_speculative_config(
        cls, spec: Mapping[str, Any], *, field_prefix: str = "speculative_config"
    ) -> DynamicSDSchedule | None:
        """The schedule in a vLLM speculative config dict, or ``None`` when it has none."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"must be a mapping, got {_describe(spec)}", field_prefix)
        try:  # a Mapping passed in code whose own get / __getitem__ raises
            rows = spec.get(SCHEDULE_KEY)
            nst = spec.get("num_speculative_tokens")
        except Exception as e:
            raise ConfigError(f"cannot be read as a mapping (reading it raised {type(e).__name__})",
                              field_prefix) from None
        if rows is None:
            return None
        if nst is None:
            raise ConfigError(
                f"a {SCHEDULE_KEY} schedule needs num_speculative_tokens (its maximum K)",
                f"{field_prefix}.num_speculative_tokens",
            )
        return cls.parse(rows, nst, field=f"{field_prefix}.{SCHEDULE_KEY}")

    @classmethod
    def from_draft_len_schedule(
        cls,
        schedule: Any,
        max_draft_len: int,
        *,
        max_batch_size: int | None = None,
        field: str = "speculative_config.draft_len_schedule",
    ) -> DynamicSDSchedule:
        """Converts TensorRT-LLM's ``draft_len_schedule`` (``{batch_size_threshold: draft_len}``).

        TRT-LLM uses K = ``schedule[t]`` for batch sizes in ``(previous threshold, t]`` and turns
        speculation off (K = 0) above the largest threshold; the smallest threshold must map to
        ``max_draft_len`` and no draft length may exceed it. The result ends with a K = 0 row
        reaching ``max_batch_size`` (or the largest threshold + 1).
        """
        try:  # a hostile __len__ / items() of a Mapping passed in code; an endless one is not read
            entries = list(schedule.items()) if isinstance(schedule, Mapping) and len(schedule) <= MAX_ROWS else None
        except Exception as e:
            raise ConfigError(f"cannot be read as a mapping: {type(e).__name__}: {brief(str(e))}", field) from None
        if isinstance(schedule, Mapping) and entries is None:
            raise ConfigError(f"more than {MAX_ROWS} batch-size thresholds", field)
        if not entries:
            raise ConfigError(
                f"must be a non-empty mapping of batch-size threshold -> draft length, got {_describe(schedule)}",
                field,
            )
        max_draft_len = _strict_int(max_draft_len, _sibling(field, "max_draft_len"), "max_draft_len")
        from .speculative import check_num_speculative_tokens  # see _typed

        # Named as the key it is read from, before parse names it num_speculative_tokens.
        check_num_speculative_tokens(max_draft_len, _sibling(field, "max_draft_len"))
        if max_batch_size is not None:
            max_batch_size = _strict_int(max_batch_size, "max_batch_size", "max_batch_size")
            if not 0 <= max_batch_size <= INT_MAX:
                raise ConfigError(f"must be in [0, 2**63-1], got {max_batch_size}", "max_batch_size")
        items: list[tuple[int, int]] = []
        for key, value in entries:
            where = f"{field}.{key}"
            threshold = _strict_int(key, where, "batch-size threshold")
            draft_len = _strict_int(value, where, "draft length")
            if threshold < 1:
                raise ConfigError(f"batch-size threshold must be >= 1, got {threshold}", where)
            if threshold >= INT_MAX:  # the K = 0 row after it starts at threshold + 1
                raise ConfigError(f"batch-size threshold must be < 2**63-1, got {threshold}", where)
            if draft_len < 0:
                raise ConfigError(f"draft length must be >= 0, got {draft_len}", where)
            if draft_len > max_draft_len:
                raise ConfigError(
                    f"draft length {draft_len} exceeds max_draft_len {max_draft_len}", where
                )
            items.append((threshold, draft_len))
        items.sort()
        smallest, first_len = items[0]
        if first_len != max_draft_len:
            raise ConfigError(
                f"the smallest threshold ({smallest}) must map to max_draft_len ({max_draft_len}), "
                f"got {first_len}",
                f"{field}.{smallest}",
            )
        rows: list[Row] = []
        start = 1
        for threshold, draft_len in items:
            rows.append((start, threshold, draft_len))
            start = threshold + 1
        tail_end = max(max_batch_size or 0, start)
        rows.append((start, tail_end, 0))
        return cls.parse(_merge_equal(rows), max_draft_len, field=field)

    @classmethod
    def from_max_concurrency(
        cls, max_concurrency: int, max_draft_len: int, *, max_batch_size: int | None = None
    ) -> DynamicSDSchedule:
        """TensorRT-LLM's ``max_concurrency``: speculate with ``max_draft_len`` up to that many
        requests, not at all above."""
        field = "speculative_config.max_concurrency"
        n = _strict_int(max_concurrency, field, "max_concurrency")
        if not 1 <= n < INT_MAX:  # the K = 0 row after it starts at n + 1
            raise ConfigError(f"must be in [1, 2**63-1), got {n}", field)
        return cls.from_draft_len_schedule({n: max_draft_len}, max_draft_len, max_batch_size=max_batch_size,
                                           field=field)

    # ---------------------------------------------------------------- queries

    def k_for_batch_size(self, batch_size: int) -> int:
        """K in force for ``batch_size`` running requests (beyond the last row: the last row's K;
        0 requests: the first row's K)."""
        n = _strict_int(batch_size, "batch_size", "batch_size")
        if n < 0:
            raise ConfigError(f"must be >= 0, got {n}", "batch_size")
        if n == 0:
            return self.rows[0][2]
        i = bisect.bisect_right(self._starts, n) - 1  # type: ignore[attr-defined]
        return self.rows[i][2]

    def dense(self, max_batch_size: int) -> list[int]:
        """``[unused, K(1), K(2), ..., K(max_batch_size)]``: the lookup table vLLM's scheduler builds."""
        n = _strict_int(max_batch_size, "max_batch_size", "max_batch_size")
        if not 1 <= n <= MAX_DENSE:
            raise ConfigError(f"must be in [1, {MAX_DENSE}], got {n}", "max_batch_size")
        return [0] + [self.k_for_batch_size(b) for b in range(1, n + 1)]

    @property
    def max_k(self) -> int:
        return max(r[2] for r in self.rows)

    def to_list(self) -> list[list[int]]:
        """The rows as vLLM's ``num_speculative_tokens_per_batch_size`` value."""
        return [list(r) for r in self.rows]

    def __str__(self) -> str:
        return ", ".join(f"{s}-{e}: K={k}" for s, e, k in self.rows) + f" (max {self.num_speculative_tokens})"


def _sibling(field: str, name: str) -> str:
    if not isinstance(field, str):  # a public keyword: an int was an AttributeError here
        raise ArgumentTypeError(f"field must be a str (a dotted path), got {_describe(field)}")
    head, _, _ = field.rpartition(".")
    return f"{head}.{name}" if head else name


def _merge_equal(rows: list[Row]) -> list[Row]:
    merged: list[Row] = []
    for s, e, k in rows:
        if merged and merged[-1][2] == k and merged[-1][1] + 1 == s:
            merged[-1] = (merged[-1][0], e, k)
        else:
            merged.append((s, e, k))
    return merged


def _typed(rows: Any, nst: Any, field: str) -> tuple[tuple[Row, ...], int]:
    """``rows`` as a tuple of integer triples and ``nst`` as an int in [1, 128]; a ConfigError
    naming the row otherwise."""
    nst_field = _sibling(field, "num_speculative_tokens")
    n = _strict_int(nst, nst_field, "num_speculative_tokens")
    if n < 1:
        raise ConfigError(f"num_speculative_tokens must be >= 1, got {n}", nst_field)
    # The bound a file's K has, for a schedule built in code too (2**63-1 was taken). Imported
    # here: kvslots.config.speculative imports this module.
    from .speculative import check_num_speculative_tokens

    check_num_speculative_tokens(n, nst_field)
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise ConfigError(
            f"must be a list of [start, end, num_speculative_tokens] rows, got {_describe(rows)}", field)
    parsed: list[Row] = []
    try:
        for i, row in enumerate(rows):
            where = f"{field}[{i}]"
            if i == MAX_ROWS:  # an iterator without end was read until memory ran out
                raise ConfigError(f"more than {MAX_ROWS} rows", field)
            if isinstance(row, (str, bytes, Mapping)) or not isinstance(row, Sequence) or len(row) != 3:
                raise ConfigError(f"row must be [start, end, num_speculative_tokens], got {_describe(row)}", where)
            start = _strict_int(row[0], where, "start")
            end = _strict_int(row[1], where, "end")
            k = _strict_int(row[2], where, "num_speculative_tokens")
            parsed.append((start, end, k))
    except ConfigError:
        raise
    except Exception as e:  # a hostile __iter__, __len__ or __getitem__ of the rows or a row
        raise ConfigError(f"cannot be read as rows: {type(e).__name__}: {brief(str(e))}", field) from None
    return tuple(parsed), n


def _validate(rows: tuple[Row, ...], nst: int, field: str) -> None:
    if not rows:
        raise ConfigError("must contain at least one [start, end, num_speculative_tokens] row", field)
    prev_end = 0
    for i, (start, end, k) in enumerate(rows):
        where = f"{field}[{i}]"
        text = f"row [{start}, {end}, {k}]"
        if start < 1:
            raise ConfigError(f"{text}: start must be >= 1", where)
        if end < start:
            raise ConfigError(f"{text}: end must be >= start", where)
        if end > INT_MAX:  # vLLM's and every engine argument's integers are 64-bit
            raise ConfigError(f"{text}: end must be <= 2**63-1", where)
        if k < 0:
            raise ConfigError(f"{text}: num_speculative_tokens must be >= 0", where)
        if k > nst:
            raise ConfigError(
                f"{text}: num_speculative_tokens {k} exceeds the maximum num_speculative_tokens {nst}",
                where,
            )
        if i == 0 and start != 1:
            raise ConfigError(f"{text}: the first row must start at batch size 1", where)
        if i > 0:
            if start <= prev_end:
                raise ConfigError(
                    f"{text}: overlaps or precedes the previous row, which ends at {prev_end} "
                    "(rows must be ascending and non-overlapping)",
                    where,
                )
            if start != prev_end + 1:
                raise ConfigError(
                    f"{text}: leaves batch sizes {prev_end + 1}..{start - 1} without a K "
                    f"(rows must be contiguous: this row must start at {prev_end + 1})",
                    where,
                )
        prev_end = end


# -------------------------------------------------------------------- slot manager side


class _LookaheadTarget(Protocol):
    def set_lookahead(self, request_id: str, lookahead: int) -> Any: ...
    def slot_info(self, request_id: str) -> Any: ...


@dataclass(frozen=True)
class LookaheadUpdate:
    """What :func:`apply_lookahead` did: the batch size it looked up, the K it set on every
    request, and the surplus lookahead blocks given back."""

    batch_size: int
    k: int
    freed_blocks: int
    #: Block ids released, for a :class:`~kvslots.SlotTracker` (whose caller owns the blocks);
    #: empty for a :class:`~kvslots.SlotManager`, which returns them to its own pool.
    freed_block_ids: tuple[int, ...] = ()


def _lookahead(schedule: DynamicSDSchedule | int, batch_size: int) -> int:
    """K for ``batch_size``: from the schedule, or the fixed K (an integer >= 0)."""
    if isinstance(schedule, DynamicSDSchedule):
        return schedule.k_for_batch_size(batch_size)
    k = _strict_int(schedule, "lookahead", "lookahead")
    if k < 0:
        raise ConfigError(f"must be >= 0, got {k}", "lookahead")
    return k


def apply_lookahead(
    target: _LookaheadTarget,
    request_ids: Sequence[str],
    schedule: DynamicSDSchedule | int,
    *,
    batch_size: int | None = None,
) -> LookaheadUpdate:
    """Sets every running request's lookahead to the K in force for the batch size.

    ``target`` is a :class:`~kvslots.SlotManager` or a :class:`~kvslots.SlotTracker`;
    ``schedule`` a :class:`DynamicSDSchedule` or a fixed K. ``batch_size`` defaults to
    ``len(request_ids)``; pass the number of requests vLLM schedules in the step when that
    differs. When K drops, every request's preallocated blocks beyond
    ``committed + pending + K`` are released at once (the manager's ``num_free`` grows by
    ``freed_blocks``); when K grows the next reserve allocates the extra room.

    Atomic: an unknown request id raises :class:`~kvslots.UnknownRequestError` before any
    lookahead changes.
    """
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
        raise ArgumentTypeError(f"request_ids must be a sequence of request ids, got {type(request_ids).__name__}")
    if not (callable(getattr(target, "slot_info", None)) and callable(getattr(target, "set_lookahead", None))):
        raise ArgumentTypeError(f"target must be a SlotManager or a SlotTracker, got {type(target).__name__}")
    # Checked whatever the schedule: with a fixed K it was never read, and 'x' or -1 came
    # back as the update's batch_size.
    n = len(request_ids) if batch_size is None else _count(batch_size, "batch_size")
    k = _lookahead(schedule, n)
    for rid in request_ids:  # fail before changing anything
        target.slot_info(rid)
    freed = 0
    freed_ids: list[int] = []
    for rid in request_ids:
        out = target.set_lookahead(rid, k)
        if isinstance(out, int):
            freed += out
        else:
            ids = list(out)
            freed += len(ids)
            freed_ids.extend(int(b) for b in ids)
    return LookaheadUpdate(batch_size=n, k=k, freed_blocks=freed, freed_block_ids=tuple(freed_ids))


def lookahead_array(
    schedule: DynamicSDSchedule | int, batch_size: int, num_requests: int | None = None
) -> np.ndarray:
    """The ``lookahead`` argument for :meth:`SlotManager.step`: K for ``batch_size``, repeated
    for ``num_requests`` (default ``batch_size``) requests, as uint32."""
    n = _count(batch_size, "batch_size")
    count = n if num_requests is None else _count(num_requests, "num_requests")
    k = _lookahead(schedule, n)
    if k > UINT32_MAX:
        raise ConfigError(f"K {k} does not fit the slot manager's uint32 lookahead", "lookahead")
    return np.full(count, k, dtype=np.uint32)


def _count(value: Any, name: str) -> int:
    n = _strict_int(value, name, name)
    if not 0 <= n <= MAX_BATCH:
        raise ConfigError(f"must be in [0, {MAX_BATCH}], got {n}", name)
    return n


__all__ = [
    "SCHEDULE_KEY",
    "DynamicSDSchedule",
    "LookaheadUpdate",
    "apply_lookahead",
    "lookahead_array",
]
