"""Settings of the KVSlotsConnector, read from ``kv_connector_extra_config``.

Every key has a default, so an empty or absent extra config works. An unknown key or a bad value
raises :class:`~kvslots.errors.ConnectorConfigError` (a ``ValueError``) naming it, which stops vLLM
at start-up.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .. import _args
from ..errors import ConnectorConfigError, KVSlotsError
from .loader import brief, expand_home, text_problem


GIB = 1 << 30
#: The most blocks a tier may hold (the core's block ids are below 2^31).
MAX_BLOCKS = (1 << 31) - 1
#: Unknown keys an error names, at most (the rest are counted).
_SHOWN_UNKNOWN = 10
#: The disk tier's file in ``disk_path`` (kvslots.vllm.connector.disk opens it; named here so
#: that check_disk_path, run before vLLM starts, need not import vLLM).
DISK_FILE_NAME = "kvslots-disk-tier.kvs"


@dataclass(frozen=True)
class ConnectorConfig:
    #: Size of the host-memory tier per worker, in GiB (ignored when host_cache_blocks is set).
    host_cache_gb: float = 4.0
    #: Size of the host-memory tier in blocks; overrides host_cache_gb.
    host_cache_blocks: int | None = None
    #: Drop the last matched block of a host hit for EAGLE-family drafters: "auto" follows
    #: vLLM's speculative config (use_eagle_block_drop), true/false force it.
    eagle_block_drop: str | bool = "auto"
    #: Threads per worker for host<->device block copies on CPU.
    copy_threads: int = 1
    #: Publish host-tier events on our own ZMQ publisher too (vLLM's own publisher already
    #: carries them when --kv-events-config is on). None: off.
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str = "kvslots"
    events_buffer_steps: int = 10_000
    events_hwm: int = 100_000
    #: Disk tier under the host tier: a directory for one preallocated file per worker rank.
    #: None (default): no disk tier.
    disk_path: str | None = None
    #: Size of the disk tier per worker, in GiB (ignored when disk_blocks is set).
    disk_gb: float = 16.0
    #: Size of the disk tier in blocks; overrides disk_gb.
    disk_blocks: int | None = None
    #: Blocks the background writer may hold queued; a spill finding the queue full is dropped.
    disk_queue_len: int = 64
    #: Disaggregated prefill/decode (kv_role kv_producer / kv_consumer): the address this
    #: worker's Mooncake engine and control socket use, the producer's control port (peers reach
    #: it there; required for kv_producer), and how long a producer holds a finished request's
    #: blocks for a decode worker that does not come (seconds).
    pd_host: str = "127.0.0.1"
    pd_port: int | None = None
    pd_timeout_s: float = 120.0
    #: The environment variable holding the P/D control channel's shared secret (None:
    #: KVSLOTS_PD_SECRET). A variable's name, never the secret: vLLM logs kv_transfer_config.
    pd_secret_env: str | None = None

    def __post_init__(self) -> None:
        # The constructor is public (kvslots.vllm.ConnectorConfig): its values get the checks
        # from_extra_config's do (NaN GiB was int()'s ValueError when sizing, -5 blocks taken).
        for f in fields(self):
            value = getattr(self, f.name)
            checked = check_key(f.name, value)
            if checked is not value:
                object.__setattr__(self, f.name, checked)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        if extra is not None and not isinstance(extra, Mapping):
            raise ConnectorConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        try:
            # Read once: a Mapping whose keys() / __iter__ / __getitem__ (or a key's __hash__)
            # raises is a config error, not that error let through.
            items = [] if extra is None else list(dict(extra).items())
        except Exception as e:
            raise ConnectorConfigError(
                f"kv_connector_extra_config cannot be read as a mapping (reading it raised {type(e).__name__})"
            ) from None
        known = {f.name for f in fields(cls)}
        given: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in items:
            # A key's text as an exact str: a str subclass's own __eq__ / __hash__ never runs.
            name = str.__str__(key) if isinstance(key, str) else None
            if name not in known:
                unknown.append(_brief(key))
            elif name in given:  # two str subclass keys of one text (their own __hash__ differed)
                raise ConnectorConfigError(f"kv_connector_extra_config: key {name} given twice")
            else:
                given[name] = value
        if unknown:
            # Sorted by their shown form: keys of mixed types (1 and "a") do not compare. The
            # first few only: the message listed every one (100,000 unknown keys, 1 MB of it).
            unknown.sort()
            shown = ", ".join(unknown[:_SHOWN_UNKNOWN])
            if len(unknown) > _SHOWN_UNKNOWN:
                shown += f" and {len(unknown) - _SHOWN_UNKNOWN} more"
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown key(s) {shown}; known keys: {', '.join(sorted(known))}"
            )
        return cls(**{key: check_key(key, value) for key, value in given.items()})

    def num_host_blocks(self, bytes_per_block: int) -> int:
        """Host blocks for this worker, given the bytes of one block over all its layers."""
        if self.host_cache_blocks is not None:
            return self.host_cache_blocks
        # An int (a str or None was a TypeError here, NaN sized the tier as NaN blocks).
        bytes_per_block = _args.integer(bytes_per_block, "bytes_per_block")
        if bytes_per_block <= 0:
            raise ConnectorConfigError(f"cannot size the host cache: {bytes_per_block} bytes per block")
        n = _blocks_in("host_cache_gb", self.host_cache_gb, bytes_per_block)
        if n > MAX_BLOCKS:  # the core's limit: named here, not an unnamed error from the planner
            raise ConnectorConfigError(
                f"kv_connector_extra_config.host_cache_gb={self.host_cache_gb} holds {n} blocks of "
                f"{bytes_per_block} bytes, more than {MAX_BLOCKS}")
        return n

    def num_disk_blocks(self, bytes_per_block: int) -> int:
        """Disk-tier blocks for this worker, given the bytes of one block over all its layers."""
        if self.disk_blocks is not None:
            return self.disk_blocks
        # An int (a str or None was a TypeError here, NaN sized the tier as NaN blocks).
        bytes_per_block = _args.integer(bytes_per_block, "bytes_per_block")
        if bytes_per_block <= 0:
            raise ConnectorConfigError(f"cannot size the disk tier: {bytes_per_block} bytes per block")
        n = _blocks_in("disk_gb", self.disk_gb, bytes_per_block)
        if n > MAX_BLOCKS:  # disk_blocks' own bound
            raise ConnectorConfigError(
                f"kv_connector_extra_config.disk_gb={self.disk_gb} holds {n} blocks of {bytes_per_block} bytes, "
                f"more than {MAX_BLOCKS}")
        return n

    def check_tiers_hold_a_block(self) -> None:
        """What of the sizing can be checked before vLLM lays out its KV cache (``kvslots serve``,
        before it starts vLLM): a tier sized in GiB must hold a block of the smallest size there
        is, one byte (``host_cache_gb`` 1e-300 holds none, whatever the model). The real bytes
        per block are known only in the engine (:meth:`num_host_blocks`, the same rule)."""
        if self.host_cache_blocks is None:
            _blocks_in("host_cache_gb", self.host_cache_gb, 1)
        if self.disk_path is not None and self.disk_blocks is None:
            _blocks_in("disk_gb", self.disk_gb, 1)

    def check_disk_path(self) -> None:
        """Whether the disk tier's worker can do with ``disk_path`` what it will (``kvslots
        serve``, before it starts vLLM): make the directory when missing (``os.makedirs``) and
        create or open its file there for reading and writing. Tried, not asked: a probe file
        is created and removed in the directory, or in its nearest existing parent when it is
        still to be made (``os.access`` says yes to root for a read-only directory, and to
        ``/proc/self``). An earlier run's file must not be held by a running engine (its store's
        exclusive flock, tried without waiting). A ConnectorConfigError naming the key says why
        not."""
        path = self.disk_path
        if path is None:
            return

        def bad(why: str) -> ConnectorConfigError:
            return ConnectorConfigError(f"kv_connector_extra_config.disk_path={path!r}: {why}")

        # The directory itself, or the nearest parent that is there (a dangling link counts:
        # makedirs cannot go through it).
        there = path
        while True:
            try:
                os.lstat(there)
                break
            except (FileNotFoundError, NotADirectoryError):  # to be made; under a file: below
                pass
            except OSError as e:  # a name too long, a loop of links, no search permission
                raise bad(f"cannot look up {there!r} ({e.strerror or e})") from None
            parent = os.path.dirname(there.rstrip(os.sep)) or os.curdir
            if parent == there:
                break
            there = parent
        if not os.path.isdir(there):
            raise bad("not a directory" if there == path else f"{there!r} is not a directory")
        try:
            fd, probe = tempfile.mkstemp(prefix=".kvslots-probe-", dir=there)
        except OSError as e:
            raise bad(f"cannot create a file in {there!r} ({e.strerror or e})") from None
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
        if there != path:
            return
        file = os.path.join(path, DISK_FILE_NAME)
        if os.path.lexists(file):  # the file of an earlier run: opened, never truncated
            if not os.path.isfile(file):
                raise bad(f"{file!r} is there and is not a regular file")
            try:
                fd = os.open(file, os.O_RDWR)
            except OSError as e:
                raise bad(f"cannot open {file!r} for writing ({e.strerror or e})") from None
            try:
                # The engine's store holds an exclusive flock on its file while it runs.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise bad(f"{file!r} is in use by another engine (each needs a disk_path of its own)") from None
            except OSError:  # no locks on this filesystem: the store goes unlocked there too
                pass
            finally:
                os.close(fd)  # the lock, if taken, goes with it

    def use_eagle_block_drop(self, vllm_says: bool) -> bool:
        vllm_says = _args.flag(vllm_says, "vllm_says")  # returned as given: None or 1.5 came back
        return vllm_says if self.eagle_block_drop == "auto" else bool(self.eagle_block_drop)


#: Integer keys' upper bounds: a block count within a C int, BlockCopier's thread limit
#: (kvslots.vllm.transfer.MAX_THREADS), the event publisher's limits (ZMQ options are C ints).
_INT_LIMITS = {"host_cache_blocks": (1 << 31) - 1, "copy_threads": 1024,
               "events_buffer_steps": (1 << 30) - 2, "events_hwm": None}


def _blocks_in(key: str, gb: float, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` bytes in ``gb`` GiB; a ConnectorConfigError naming
    ``key`` when not one fits."""
    n = int(gb * GIB) // bytes_per_block
    if n < 1:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{key}={gb} holds no block of {bytes_per_block} "
            f"byte{'' if bytes_per_block == 1 else 's'}")
    return n


def _brief(value: Any) -> str:
    """``brief(value)``, or the type's name when its ``repr`` fails (a list nested deeper than
    the recursion limit, an object whose ``__repr__`` raises)."""
    try:
        return brief(value)
    except Exception:  # RecursionError included
        return f"<{type(value).__name__}>"


def _text(value: Any) -> bool:
    """A str that is valid Unicode (no lone surrogate: it could not be encoded to bytes for a
    path, a ZMQ address or topic, or a host name) and holds no NUL."""
    return isinstance(value, str) and text_problem(str.__str__(value)) is None


def _exact(value: Any) -> Any:
    """A str, int or float as its exact built-in type (the text or number itself), anything
    else as it is: the checks below and the code after them then never call an override of a
    subclass (``__lt__``, ``__float__``, ``__eq__``, ``strip``), which could raise or lie."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _args.integer(value, "value")  # operator.index: an int subclass's __index__ is not called
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    return value


def check_key(key: str, value: Any) -> Any:
    """``value`` for kv_connector_extra_config's ``key`` checked (and made its exact type) by that
    key's one rule, or a ConnectorConfigError naming the key."""

    def bad(why: str) -> ConnectorConfigError:
        return ConnectorConfigError(f"kv_connector_extra_config.{key}={_brief(value)}: {why}")

    value = _exact(value)
    if key == "disk_gb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1 << 20:
            raise bad("must be a number of GiB > 0")
        return float(value)
    if key in ("disk_blocks", "disk_queue_len"):
        if value is None and key == "disk_blocks":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 1 << 31:
            raise bad("must be an integer in [1, 2^31)")
        return value
    if key == "disk_path":
        if value is None:
            return None
        if not _text(value) or not value.strip():
            raise bad("must be a directory path (valid Unicode, no NUL)")
        return expand_home(value)  # as a model path: ~/kv was a directory "~" in vLLM's working directory
    if key == "host_cache_gb":
        # Bounded like disk_gb: infinity (or 1e999) would overflow sizing it in blocks.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1 << 20:
            raise bad("must be a number of GiB > 0 and < 2**20")
        return float(value)
    if key in _INT_LIMITS:
        if value is None and key == "host_cache_blocks":
            return None
        hi = _INT_LIMITS[key]
        if hi is None:  # events_hwm: the publisher's bound, checked at start-up, not when it binds
            from ..events.protocol import MAX_HWM

            hi = MAX_HWM
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
            raise bad(f"must be an integer in [1, {hi}]")
        return value
    if key == "pd_host":
        # The one rule for an address peers reach (_args.host): a wildcard such as '*' would be
        # advertised to peers and fail only once a request ran.
        try:
            return _args.host(value, "pd_host")
        except KVSlotsError as e:
            raise bad(str(e).removeprefix("pd_host ")) from None
    if key == "pd_port":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise bad("must be a TCP port in [1, 65535]")
        return value
    if key == "pd_timeout_s":
        # At least 0.1 s: it also bounds the control calls, and 1e-300 made every one fail at once.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 86400:
            raise bad("must be a number of seconds in [0.1, 86400]")
        return float(value)
    if key == "pd_secret_env":
        if value is None:
            return None
        if not _text(value) or not value or "=" in value:
            raise bad("must be the name of an environment variable (valid Unicode, no '=', no NUL)")
        return value
    if key == "eagle_block_drop":
        # isinstance, not ``in``: 1, 0 and 1.0 equal True and False but are no booleans.
        if isinstance(value, bool) or isinstance(value, str) and value == "auto":
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad('must be "auto", true or false')
    if key in ("events_endpoint", "events_replay_endpoint"):
        if value is None:
            return None
        # The publisher's own rule, checked here so that a bad one names the key at start-up.
        from ..events.protocol import check_endpoint

        if not _text(value):
            raise bad("must be a ZMQ endpoint such as tcp://127.0.0.1:5557")
        try:
            return check_endpoint(value, key)
        except KVSlotsError as e:
            raise bad(f"must be a ZMQ endpoint such as tcp://127.0.0.1:5557 ({e})") from None
    if key == "events_topic":
        if not _text(value):
            raise bad("must be a string (valid Unicode, no NUL)")
        return value
    raise bad("unknown key")  # unreachable: filtered by from_extra_config
