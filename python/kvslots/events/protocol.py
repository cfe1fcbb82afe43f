"""The ZMQ framing of KV event streams, as vLLM 0.32's ``ZmqEventPublisher`` writes it, in one
place: :mod:`.publisher` builds these frames, :mod:`.subscriber` parses them, and nothing else
does either.

* Live (PUB): ``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian unsigned counter from 0
  per publisher instance (so up to ``SEQ_MAX``; nothing on the wire is negative), ``payload`` a
  msgpack ``KVEventBatch``.
* Replay request (DEALER to ROUTER): ``(b"", start)``, ``start`` 8 bytes big-endian (a REQ
  socket adds the empty frame itself).
* Replay reply: ``(b"", topic, seq, payload)`` per buffered batch with ``seq >= start``, in
  order, then the end marker ``(b"", b"", END_SEQ, b"")``: ``END_SEQ`` (all ones) with an empty
  payload. Older vLLMs leave out the topic frame; subscribers accept both. A reply with the seq
  ``END_SEQ`` and a payload is the batch ``SEQ_MAX``, not the end.
* Who binds: :func:`is_bind_endpoint`; the ROUTER always binds, subscribers connect.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Sequence

from .. import _args
from ..config.loader import brief
from ..errors import ArgumentTypeError, InvalidArgumentError, InvalidStateError

#: Highest ``hwm`` of a publisher (and kv_connector_extra_config's ``events_hwm``): a
#: subscriber that stops reading makes the live socket queue up to hwm messages for it, ~200
#: bytes each (three frames) besides the batches they share with the other subscribers (19 MB
#: at the default 100,000; 400 GB at 2**31-1, which was taken).
MAX_HWM = 1_000_000

_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
#: Longest ipc:// path in bytes: sun_path (108 bytes on Linux, 104 elsewhere) less its NUL.
MAX_IPC_PATH = (108 if sys.platform.startswith("linux") else 104) - 1
MAX_INPROC_NAME = 256

#: The address schemes ZMQ event streams use.
SCHEMES = ("tcp://", "ipc://", "inproc://")

#: The largest sequence number the 8-byte unsigned wire field holds.
SEQ_MAX = 2**64 - 1

#: Sequence frame of the replay end marker, as vLLM writes it (-1, 8 signed big-endian bytes;
#: the same bytes as ``SEQ_MAX``: the empty payload is what tells the two apart).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: What :func:`parse_replay_reply` gives as the seq of the end marker (no wire seq is negative).
REPLAY_END = -1

#: The largest frame a subscriber takes by default (ZMQ_MAXMSGSIZE on its SUB and replay DEALER
#: sockets): ZMQ drops the connection of a peer that sends a bigger one before buffering it,
#: and reconnects. A batch is one engine step's events, about 9 bytes per token of the step
#: (5-byte token ids, a 34-byte hash per block stored and per block evicted); 64 MiB is a step
#: of some 7 million tokens, vLLM's default step (max_num_batched_tokens) is 8192.
MAX_FRAME_BYTES = 64 * 2**20

Frames = Sequence[bytes]


_forks = 0  # fork()s between the first process and this one (os.getpid() is a system call)


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def fork_generation() -> int:
    """What :func:`check_process` compares: a new value in each forked child."""
    return _forks


def check_process(made_in: int, what: str) -> None:
    """Refuses using ``what`` (an event publisher or subscriber made when
    :func:`fork_generation` was ``made_in``) in a forked child: its thread did not survive the
    fork and libzmq's sockets and context are not usable there (a child's poll_once() hung,
    publish() queued batches no thread sent and then blocked for ever, flush() said
    everything was sent)."""
    if _forks != made_in:
        raise InvalidStateError(f"{what} was made in the process that forked this one ({os.getpid()}): "
                                f"ZMQ sockets and threads do not survive fork; make a new one here")


def seq_bytes(seq: int) -> bytes:
    if type(seq) is int and 0 <= seq <= SEQ_MAX:  # every batch sent: the check below costs 3x
        return seq.to_bytes(8, "big")
    return _args.integer(seq, "seq", 0, SEQ_MAX).to_bytes(8, "big")


def _frames(frames: Frames) -> Frames:
    """Frames as ``recv_multipart`` gives them: a list (or tuple) of bytes. Anything else is the
    caller's mistake, not a peer's (a peer's malformed message is a None):
    :class:`ArgumentTypeError`. Exact types: a subclass's own ``__len__`` / ``__eq__`` raised."""
    if type(frames) is list or type(frames) is tuple:
        for f in frames:  # a loop, not any(): this runs for every message received
            if type(f) is not bytes:
                break
        else:
            return frames
        what = f"a {type(frames).__name__} holding {', '.join(sorted({type(f).__name__ for f in frames}))}"
    else:
        what = type(frames).__name__
    raise ArgumentTypeError(f"frames must be a list of bytes, got {what}")


def _frame(frame: bytes, name: str) -> bytes:
    """A frame to send: bytes, or a bytearray or memoryview (ZMQ sends their bytes)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"{name} must be bytes, got {type(frame).__name__}")
    return frame


def _seq(frame: bytes) -> int | None:
    """The unsigned 8-byte big-endian sequence number of a frame; None if it is not 8 bytes."""
    return int.from_bytes(frame, "big") if len(frame) == 8 else None


# ---- live stream ---------------------------------------------------------------------------


def live_message(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return (_frame(topic, "topic"), seq_bytes(seq), _frame(payload, "payload"))


def parse_live(frames: Frames) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a live message (``0 <= seq <= SEQ_MAX``); None for anything that is
    not three frames with an 8-byte sequence number."""
    if len(_frames(frames)) != 3:
        return None
    seq = _seq(frames[1])
    if seq is None:
        return None
    return seq, frames[2]


# ---- replay --------------------------------------------------------------------------------


def replay_request(start: int) -> tuple[bytes, bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start`` on (clamped to the
    wire's range: a subscriber past ``SEQ_MAX`` asks from ``SEQ_MAX``)."""
    return (b"", min(max(_args.integer(start, "start"), 0), SEQ_MAX).to_bytes(8, "big"))


def parse_replay_request(frames: Frames) -> tuple[bytes, int] | None:
    """``(client identity, start)`` of a request as the ROUTER receives it; None if malformed."""
    if len(_frames(frames)) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def replay_reply(client: bytes, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
    return (_frame(client, "client"), b"", _frame(topic, "topic"), seq_bytes(seq), _frame(payload, "payload"))


def replay_end(client: bytes) -> tuple[bytes, ...]:
    return (_frame(client, "client"), b"", b"", END_SEQ, b"")


def parse_replay_reply(frames: Frames, topic: bytes = b"") -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a reply as the DEALER receives it; ``seq`` is ``REPLAY_END`` for the
    end marker (``END_SEQ`` with an empty payload), else ``0 <= seq <= SEQ_MAX``. None if
    malformed, or if it is a batch whose topic frame does not start with ``topic`` (the
    subscription's prefix, as the live stream is filtered; older vLLMs send no topic frame, so
    their replies cannot be told apart)."""
    if not isinstance(topic, bytes):
        raise ArgumentTypeError(f"topic must be bytes, got {type(topic).__name__}")
    if len(_frames(frames)) == 4 and frames[0] == b"":  # vLLM 0.32: [b"", topic, seq, payload]
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":  # older vLLM: [b"", seq, payload]
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    if len(seq_frame) != 8:
        return None
    if seq_frame == END_SEQ and not payload:
        return REPLAY_END, b""
    if len(frames) == 4 and not frames[1].startswith(topic):
        return None
    return int.from_bytes(seq_frame, "big"), payload


# ---- addresses -----------------------------------------------------------------------------


def vllm_binds(endpoint: str) -> bool:
    """vLLM 0.32's rule (``ZmqEventPublisher._is_bind_endpoint``): a publisher binds wildcard,
    IPv6-any, ipc and inproc addresses and connects to the rest."""
    endpoint = _args.text(endpoint, "endpoint")
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_bind_endpoint(endpoint: str) -> bool:
    """:func:`vllm_binds`, plus: TCP port 0 binds, since only a bound socket can take an
    OS-chosen port."""
    if vllm_binds(endpoint):
        return True
    return endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0"


def is_ipv6(endpoint: str) -> bool:
    """Whether a socket for ``endpoint`` needs ZMQ_IPV6 (off by default, and then ZMQ refuses
    IPv6 literals): a TCP address with a bracketed host (``tcp://[::1]:5557``) or ``::`` in it.
    Publishers and subscribers alike set it by this rule."""
    endpoint = _args.text(endpoint, "endpoint")
    return endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint)


def _bracketed_ipv6(host: str) -> ipaddress.IPv6Address:
    """The address of a ``[IPv6]`` host (a scope id ``%eth0`` allowed); ValueError if it is not one."""
    if not (host.startswith("[") and host.endswith("]")):
        raise ValueError(host)
    return ipaddress.IPv6Address(host[1:-1])


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``data_parallel_rank``, as vLLM derives it: a TCP port
    is shifted by the rank (port 0 stays 0: the OS picks), an inproc name gets ``_dp<rank>``.
    vLLM rejects ipc endpoints for ranks above 0; we suffix them like inproc names."""
    data_parallel_rank = _args.integer(data_parallel_rank, "data_parallel_rank", 0)
    if endpoint is not None:
        endpoint = _args.text(endpoint, "endpoint")
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")) or "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        value = _port(port) if sep else None
        if value is None or value == 0:
            return endpoint
        if value >= _LONG_PORT:  # perhaps of thousands of digits, which int() refuses
            raise InvalidArgumentError(f"endpoint {brief(endpoint)}: port {_show_port(port)} is past 65535")
        return f"{head}:{value + data_parallel_rank}"
    raise InvalidArgumentError(f"invalid endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def host_problem(host: str) -> str | None:
    """Why ``host`` can name no host or interface (None: it may): a space or a control character
    (a lone surrogate included), which no host name, address or interface name holds. The one
    home of this rule: a TCP endpoint's host (:func:`check_endpoint`) and the address
    ``kvslots serve --host`` gives vLLM's server."""
    if not isinstance(host, str):
        raise ArgumentTypeError(f"host must be a str, got {type(host).__name__}")
    if not host.isprintable() or any(c.isspace() for c in host):
        return "the host contains spaces or control characters"
    return None


def check_endpoint(endpoint: str, name: str = "endpoint", data_parallel_rank: int = 0) -> str:
    """The rule for every endpoint a publisher or subscriber is given: text without a NUL
    that starts with one of ``SCHEMES``, whose TCP host has no space or control character, whose TCP port (shifted by ``data_parallel_rank``) is
    at most 65535 and whose bracketed TCP host, if any, is an IPv6 address
    (``tcp://[::1]:5557``; see :func:`is_ipv6`).
    Raises :class:`ArgumentTypeError` or :class:`InvalidArgumentError` naming ``name``; what
    only ZMQ can judge (a host that does not resolve, a port in use) is left to it. Returns the
    endpoint as an exact ``str``."""
    endpoint = _args.text(endpoint, name)
    if not endpoint.startswith(SCHEMES):
        raise InvalidArgumentError(f"{name} {endpoint!r} must start with tcp://, ipc:// or inproc://")
    if "\0" in endpoint:
        # ZMQ reads the address as a C string: what follows the NUL was dropped, and the
        # socket bound or connected elsewhere than asked (tcp://127.0.0.1:0\0:5557, an ipc path).
        raise InvalidArgumentError(f"{name} {brief(endpoint)}: contains a NUL character")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        problem = host_problem(host)
        if problem:
            # ZMQ failed only when the socket was made (in vLLM's engine, for an endpoint
            # kvslots serve passed on).
            raise InvalidArgumentError(f"{name} {brief(endpoint)}: {problem}")
        if host.startswith("["):
            try:
                _bracketed_ipv6(host)
            except ValueError:
                raise InvalidArgumentError(f"{name} {brief(endpoint)}: not an IPv6 address in brackets") from None
        value = _port(port)
        if value and value + data_parallel_rank > 65535:
            shifted = f" + data_parallel_rank {data_parallel_rank}" if data_parallel_rank else ""
            raise InvalidArgumentError(f"{name} {brief(endpoint)}: port {_show_port(port)}{shifted} is past 65535")
    elif endpoint.startswith("ipc://"):
        # Past the OS's socket path length ZMQ fails only when the socket is made (in vLLM's
        # engine, after the model loaded, for an endpoint kvslots serve passed on).
        problem = _ipc_path_problem(offset_endpoint_port(endpoint, data_parallel_rank) or endpoint)
        if problem:
            raise InvalidArgumentError(f"{name} {brief(endpoint)}: {problem}")
    return endpoint


def _ipc_path_problem(endpoint: str) -> str | None:
    """Why an ``ipc://`` endpoint's path cannot be a socket's (None: it can): the one home of the
    OS's length rule, for :func:`check_endpoint` and :func:`check_connect_endpoint`."""
    if len(endpoint.encode("utf-8", "surrogatepass")) - len("ipc://") > MAX_IPC_PATH:
        return f"the path is longer than {MAX_IPC_PATH} bytes (the OS limit)"
    return None


def check_connect_endpoint(endpoint: str, what: str = "endpoint") -> str:
    """The stricter rule for a worker's live or replay address that an operator registers with
    the indexer (``--worker``, YAML, ``POST /workers``): what ZMQ refuses to connect to, or would
    accept and then silently never reach, is an :class:`InvalidArgumentError` here
    (:class:`ArgumentTypeError` for a non-string). :func:`check_endpoint` is the general rule,
    which leaves such addresses to ZMQ's own errors at connect time.

    ``tcp://HOST:PORT``: HOST a host name, an IPv4 address or a bracketed IPv6 one (``[::1]``,
    ``[::ffff:127.0.0.1]``), not ``*`` or ``[::]`` (bind addresses); PORT 1-65535.
    ``ipc://PATH`` (``@NAME``: abstract): at most :data:`MAX_IPC_PATH` bytes. ``inproc://NAME``."""
    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{what} {brief(endpoint)}: {why}")

    if not isinstance(endpoint, str):
        raise ArgumentTypeError(f"{what} must be a string, got {type(endpoint).__name__}")
    if not endpoint.isprintable() or any(c.isspace() for c in endpoint):
        raise bad("contains spaces or control characters")
    try:
        endpoint.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("is not valid Unicode") from None
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise bad("use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
            raise bad("use tcp://HOST:PORT with a port in 1-65535")
        if host == "*":
            raise bad("'*' is an address to bind, not to connect to: name the publisher's host")
        if host.startswith("["):
            try:
                addr = _bracketed_ipv6(host)
            except ValueError:
                raise bad("not an IPv6 address in brackets") from None
            # EventSubscriber reaches any IPv6 peer (is_ipv6 sets ZMQ_IPV6); [::] only binds.
            if addr.is_unspecified or (addr.ipv4_mapped is not None and addr.ipv4_mapped.is_unspecified):
                raise bad(f"'{host}' is an address to bind, not to connect to: name the publisher's host")
        elif not _HOST.fullmatch(host):
            raise bad("the host must be a host name or an IPv4 address")
        elif re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise bad("not an IPv4 address") from None
    elif scheme == "ipc":
        if not rest or rest == "*":
            raise bad("name the publisher's socket path")
        problem = _ipc_path_problem(endpoint)
        if problem:
            raise bad(problem)
    elif not rest or len(rest) > MAX_INPROC_NAME:
        raise bad(f"use inproc://NAME with a name of 1-{MAX_INPROC_NAME} characters")
    return endpoint


#: What :func:`_port` gives for a number of six digits or more.
_LONG_PORT = 100_000


def _port(text: str) -> int | None:
    """The number a port text of ASCII digits holds (str.isdigit() is True for "²", which int()
    refuses), None for other text; ``_LONG_PORT`` for six digits or more (int() raises
    ValueError for 4300 digits or more, and no port is past 65535 anyway)."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 5 else _LONG_PORT


def _show_port(text: str) -> str:
    return text if len(text) <= 12 else f"{text[:12]}... ({len(text)} digits)"
