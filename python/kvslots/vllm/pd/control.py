"""The P/D control channel: small msgpack requests from a decode worker to a prefill worker over
plain TCP (the KV bytes themselves go through Mooncake, :mod:`.transport`).

Two operations, both answered at once by a background thread of the prefill worker:

- ``hello``: the prefill worker's Mooncake session, block layout (every layer, target and draft),
  block size and model name, so the decode worker can check both sides match before reading;
- ``done``: the decode worker finished (or gave up) reading a request's blocks; the prefill
  worker may free them. The answer says whether the blocks were still held when the read ended
  (``held``: false when the prefill worker's hold timed out first, so the bytes read may be
  stale and the decode worker must not use them).

Wire: one request and one reply per connection, each a 4-byte big-endian length and that many
bytes of msgpack. Every length is checked before anything past it is read, so what a peer can
make either side hold is bounded: a request of :data:`MAX_REQUEST_BYTES` on each of at most
:data:`MAX_CONNECTIONS` connections (the oldest goes for a new one, and each has
:data:`REQUEST_DEADLINE_S` to deliver its request), a reply of :data:`MAX_REPLY_BYTES`. (It was
ZMQ, whose ROUTER and DEALER queue every frame of a multipart message until its last frame:
one connection streaming frames that never end held gigabytes after seconds.)

Every client call has a timeout and a fresh connection per attempt, so a dead or restarted peer
gives a :class:`~kvslots.errors.TransferError` (kind ``"peer"`` / ``"timeout"``), never a hang.

Authentication (optional, off by default as in vLLM's own NixlConnector, P2pNcclConnector and
MooncakeConnector, whose side channels trust their network). With a shared ``secret`` on both
ends, each request's msgpack is preceded by its HMAC-SHA256 (:data:`TAG_BYTES`) under the
secret, and each reply's by the HMAC of the request's tag and the reply: a server answers a
request whose tag does not match (checked with :func:`hmac.compare_digest`) with an error (not
tagged: a caller with no secret or another one reads why) and never acts on it; a caller takes
no reply whose tag does not match. Each tagged request carries a random ``nonce``, so no two
share a tag and a reply captured for one is no reply to another. A captured request can still
be sent again (no clock is shared, no nonce remembered): a ``done`` acts once, and a
``hello``'s reply, readable on the wire as every reply is, gives the prefill worker's Mooncake
session and layout. The secret protects this channel only: Mooncake's transfers have no
authentication of their own, and with a hello's reply anyone who reaches them reads or writes
the KV cache, so the network between the workers must be private, secret or not. A server with
no secret on an address other than loopback says so in one warning at start.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec

from ..._args import C_INT_MAX, callback, integer, number, text
from ...config.loader import brief
from ...errors import ArgumentTypeError, InvalidArgumentError, TransferError
from ...events.codec import DECODE_ERRORS

logger = logging.getLogger(__name__)

__all__ = ["ControlServer", "control_call"]

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()
_LEN = struct.Struct(">I")

#: Largest control message accepted. Requests are under a KiB and a ``hello`` reply (every
#: layer's segment layout) some KiB; a larger one is a hostile or broken peer: its connection is
#: dropped with nothing past the length read (a 512 MiB frame was once read whole).
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 16 << 20
#: Connections a server keeps at once; a new one past it closes the oldest. Decode workers
#: connect once per call and are answered at once, so only idle or hostile peers are that old.
MAX_CONNECTIONS = 64
#: Seconds a connection has from its accept to deliver its request and take its reply.
REQUEST_DEADLINE_S = 10.0
#: Bytes of the HMAC-SHA256 tag before each message when a secret is set.
TAG_BYTES = 32
#: Shortest secret taken (bytes): a shorter one is guessed.
MIN_SECRET_BYTES = 16
#: An unauthenticated request is logged at most this often (a scanner sends many).
_REFUSED_LOG_S = 60.0


def _secret(secret: Any) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise ArgumentTypeError(f"secret must be bytes or None, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def _request_tag(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, b"kvslots-pd-request\0" + body, hashlib.sha256).digest()


def _reply_tag(secret: bytes, request_tag: bytes, body: bytes) -> bytes:
    # Bound to its request: a reply captured for one request is no reply to another.
    return hmac.new(secret, b"kvslots-pd-reply\0" + request_tag + body, hashlib.sha256).digest()


class _Conn:
    __slots__ = ("sock", "buf", "out", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.out = b""
        self.deadline = deadline


class ControlServer:
    """Answers control requests on TCP ``host:port`` with ``handler(msg) -> reply`` on its own
    thread. ``port`` 0 picks a free port (see :attr:`port`). With ``secret`` (bytes, at least
    :data:`MIN_SECRET_BYTES`) only requests tagged with it are acted on (see the module)."""

    def __init__(self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]], *,
                 secret: bytes | None = None):
        # Checked before a socket exists: a lone surrogate in host was a UnicodeEncodeError that
        # left the socket open, a port of -1 or 2**70 was "bound", a handler no callable killed
        # the serving thread at the first request.
        host = _host(host)
        port = integer(port, "port", 0, 65535)
        handler = cast(Callable[[dict[str, Any]], dict[str, Any]], callback(handler, "handler"))
        self._secret = _secret(secret)
        self.refused = 0  # requests not authenticated
        self._refused_told_at = float("-inf")
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(None if host == "*" else host, port,
                                                              type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        except (OSError, ValueError) as e:  # no such host; a name IDNA cannot encode
            raise TransferError(f"P/D control socket cannot bind {host}:{port}: {e}", details={"kind": "engine"}) from None
        self._sock = socket.socket(family, kind, proto)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(addr)
            self._sock.listen(128)
            self._sock.setblocking(False)
            self.port = self._sock.getsockname()[1]
            # Made here, not on the thread: out of descriptors, the thread died at its start and
            # the server took connections it never answered.
            self._sel = selectors.DefaultSelector()
        except OSError as e:
            self._sock.close()
            raise TransferError(f"P/D control socket cannot bind {host}:{port}: {e}",
                                details={"kind": "engine"}) from None
        except BaseException:
            self._sock.close()
            raise
        self.host = host
        self._handler = handler
        if self._secret is None and not _loopback(self._sock.getsockname()[0]):
            logger.warning("kvslots P/D control channel on %s:%d is not authenticated: anyone who reaches it can "
                           "release this worker's held blocks; a shared secret (KVSLOTS_PD_SECRET on every worker) "
                           "protects this channel only: Mooncake's KV transfers have no authentication, so the "
                           "network between the workers must be private in any case", host, self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvslots-pd-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = self._sel
        conns: dict[socket.socket, _Conn] = {}  # oldest first
        try:
            _unpin_thread()
            sel.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(0.1):
                    if key.fileobj is self._sock:
                        self._accept(sel, conns)
                    else:
                        c = conns.get(key.fileobj)  # type: ignore[call-overload]
                        if c is None:
                            continue
                        try:
                            keep = self._step(sel, c)
                        except Exception:  # noqa: BLE001 - one connection's trouble ends it, not the server
                            logger.exception("kvslots P/D control server: dropping a connection")
                            keep = False
                        if not keep:
                            self._drop(sel, conns, c)
                now = time.monotonic()
                for c in [c for c in conns.values() if now >= c.deadline]:
                    self._drop(sel, conns, c)
        finally:
            for c in list(conns.values()):
                self._drop(sel, conns, c)
            sel.close()
            self._sock.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[socket.socket, _Conn]) -> None:
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):  # none left to accept
                return
            except OSError:  # out of descriptors (EMFILE): they wait in the backlog; no busy loop
                self._stop.wait(0.05)
                return
            sock.setblocking(False)
            while len(conns) >= MAX_CONNECTIONS:
                self._drop(sel, conns, next(iter(conns.values())))
            c = _Conn(sock, time.monotonic() + REQUEST_DEADLINE_S)
            conns[sock] = c
            sel.register(sock, selectors.EVENT_READ)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, conns: dict[socket.socket, _Conn], c: _Conn) -> None:
        conns.pop(c.sock, None)
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _step(self, sel: selectors.BaseSelector, c: _Conn) -> bool:
        """Reads what the connection has or writes what it can take; False when it is done
        (answered, closed by the peer, or over the cap)."""
        try:
            if c.out:
                c.out = c.out[c.sock.send(c.out):]
                return bool(c.out)
            need = (_LEN.size if len(c.buf) < _LEN.size else _LEN.size + _LEN.unpack_from(c.buf)[0]) - len(c.buf)
            data = c.sock.recv(min(need, 1 << 16))
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        c.buf += data
        if len(c.buf) < _LEN.size:
            return True
        (n,) = _LEN.unpack_from(c.buf)
        if n > MAX_REQUEST_BYTES:
            return False  # dropped with nothing past its length read
        if len(c.buf) < _LEN.size + n:
            return True
        if _hung_up(c.sock):
            # The caller gave up before this was read (this process was stopped or busy past
            # its timeout) and may have taken the call as failed: not acted on, as ZMQ dropped
            # such a request with the caller's socket.
            return False
        reply = self._answer(bytes(c.buf[_LEN.size:]))
        c.buf = bytearray()
        c.out = _LEN.pack(len(reply)) + reply
        sel.modify(c.sock, selectors.EVENT_WRITE)
        return True

    def _answer(self, payload: bytes) -> bytes:
        if self._secret is not None:
            tag, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
            if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, _request_tag(self._secret, body)):
                self.refused += 1
                now = time.monotonic()
                if now - self._refused_told_at >= _REFUSED_LOG_S:
                    self._refused_told_at = now
                    logger.warning("kvslots P/D control channel: %d request(s) not authenticated refused (another "
                                   "secret or none on the caller)", self.refused)
                return _ENC.encode({"error": "not authenticated (the P/D secret differs, or the caller has none)"})
            reply = self._reply(body, nonced=True)
            return _reply_tag(self._secret, tag, reply) + reply
        return self._reply(payload)

    def _reply(self, payload: bytes, nonced: bool = False) -> bytes:
        try:
            msg = _DEC.decode(payload)
            if not isinstance(msg, dict):
                raise TypeError("not a map")
            if nonced:
                msg.pop("nonce", None)  # the caller's, for the tags only
            reply = _ENC.encode(self._handler(msg))
            if len(reply) > MAX_REPLY_BYTES - TAG_BYTES:  # room for a tag
                raise ValueError(f"reply of {len(reply)} bytes, over the {MAX_REPLY_BYTES} a caller reads")
        except Exception as e:  # a bad request must not stop the server
            # Encoded in here too: a reply msgpack cannot encode (a handler's bug) ended this
            # thread, and every later request went unanswered.
            reply = _ENC.encode({"error": f"{type(e).__name__}: {e}".encode("utf-8", "replace").decode()})
        return reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer of a connection whose request was read whole has closed it already."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # reset
        return True


def _unpin_thread() -> None:
    """Lets the calling thread run on every CPU. vLLM's CPU workers pin their process (and so
    every new thread) to the cores of their OpenMP pool, where a busy engine loop can starve a
    small service thread for minutes."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # pid 0: this thread only (Linux)
    except (AttributeError, OSError):
        pass


#: Longest wait of one try, in seconds (milliseconds in a C int, as ZMQ's poll took them).
MAX_TIMEOUT_S = C_INT_MAX // 1000
#: Most retries of one call.
MAX_RETRIES = 100


def _host(host: Any) -> str:
    host = text(host, "host")
    if not host or "\0" in host:
        raise InvalidArgumentError(f"host must be a host name or address, got {host!r}")
    return host


def control_call(host: str, port: int, msg: dict[str, Any], *, timeout_s: float, retries: int = 1,
                 secret: bytes | None = None) -> dict[str, Any]:
    """Sends ``msg`` to a :class:`ControlServer` and returns its reply; a
    :class:`~kvslots.errors.TransferError` when no reply comes within ``timeout_s`` (per try) or
    the reply is an error. Checked before anything is sent: ``timeout_s`` and ``retries``
    (:class:`~kvslots.errors.InvalidArgumentError`), ``msg`` a dict
    (:class:`~kvslots.errors.ArgumentTypeError`); a host, port or msg content that cannot reach
    a server (they come from the peer's hand-off, ``kv_transfer_params``) is a TransferError
    (kind ``"peer"``), as a peer that does not answer is. With
    ``secret`` the request is tagged and a reply not tagged with it is a TransferError (kind
    ``"peer"``)."""
    # Checked first: a negative timeout_s was ZMQ's "wait forever" (a hang), NaN, inf or None a
    # builtin ValueError, OverflowError or TypeError, a msg msgpack cannot encode a TypeError or
    # UnicodeEncodeError, one over the server's cap waited out every try unanswered.
    timeout_s = number(timeout_s, "timeout_s", positive=True, hi=MAX_TIMEOUT_S)
    retries = integer(retries, "retries", 0, MAX_RETRIES)
    secret = _secret(secret)
    if not isinstance(msg, dict):
        raise ArgumentTypeError(f"msg must be a dict, got {type(msg).__name__}")
    if secret is not None:
        # Random per request: identical requests had identical tags, so a reply captured for
        # one (an old hello's session) was a valid reply to every later one.
        msg = {**msg, "nonce": os.urandom(16)}
    try:
        host = _host(host)
        port = integer(port, "port", 1, 65535)
        try:
            payload = _ENC.encode(msg)
        except (TypeError, ValueError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
            raise ArgumentTypeError(f"msg does not encode as msgpack: {e}") from None
        if len(payload) > MAX_REQUEST_BYTES:
            raise InvalidArgumentError(f"msg is {len(payload)} bytes encoded; a control server drops any over "
                                       f"{MAX_REQUEST_BYTES} unread")
    except InvalidArgumentError as e:
        # A TransferError, which the connector's pull handles as a failed peer (a lone surrogate
        # in a hand-off's host or request id, a UnicodeEncodeError, escaped its ack handler and
        # left the request waiting; a NUL was ZMQ's error, a TransferError, before these checks).
        raise TransferError(f"P/D peer {brief(host)}:{brief(port)}: {e}", details={"kind": "peer"}) from None
    tag = b""
    if secret is not None:
        tag = _request_tag(secret, payload)
        payload = tag + payload
    frame = _LEN.pack(len(payload)) + payload
    last = ""
    for _ in range(retries + 1):
        try:
            body = _exchange(host, port, frame, time.monotonic() + timeout_s)
        except _NoAnswer as e:
            last = str(e) or f"no reply within {timeout_s} s"
            time.sleep(0.05)
            continue
        if secret is not None:
            got, body = body[:TAG_BYTES], body[TAG_BYTES:]
            if len(got) < TAG_BYTES or not hmac.compare_digest(got, _reply_tag(secret, tag, body)):
                raise TransferError(f"P/D control reply from {host}:{port} is not authenticated (the P/D secret "
                                    f"differs, or the peer has none){_refusal(got + body)}", details={"kind": "peer"})
        try:
            reply = _DEC.decode(body)
        except DECODE_ERRORS as e:  # bad UTF-8 or deep nesting too, not only malformed bytes
            raise TransferError(f"P/D control reply from {host}:{port} does not decode: {e}",
                                details={"kind": "peer"}) from None
        if not isinstance(reply, dict):
            raise TransferError(f"P/D control reply from {host}:{port} is not a map", details={"kind": "peer"})
        if "error" in reply:
            # brief: the peer's text, cut (a reply may be 16 MiB) and on one line
            raise TransferError(f"P/D peer {host}:{port} refused {brief(msg.get('op'))}: "
                                f"{brief(reply['error'], 300)}", details={"kind": "peer"})
        return reply
    raise TransferError(f"P/D peer {host}:{port} did not answer {brief(msg.get('op'))}: {last}",
                        details={"kind": "timeout"})


def _refusal(raw: bytes) -> str:
    """A server's unauthenticated error reply, for the caller's message ("" if it is none)."""
    try:
        reply = _DEC.decode(raw)
    except DECODE_ERRORS:
        return ""
    return f": {brief(reply['error'], 300)}" if isinstance(reply, dict) and "error" in reply else ""


class _NoAnswer(Exception):
    """One try of a call got no reply (nothing listening, the connection broken or silent)."""


def _exchange(host: str, port: int, frame: bytes, deadline: float) -> bytes:
    """Sends ``frame`` on a fresh connection and returns the reply's msgpack bytes, by
    ``deadline``. A refused connection is tried again every 100 ms until then (a peer that is
    starting, as ZMQ reconnected); a reply over :data:`MAX_REPLY_BYTES` is refused at its length."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _NoAnswer()
        try:
            sock = socket.create_connection((host, port), timeout=left)
            break
        except (socket.gaierror, ValueError) as e:  # no such host, or a name IDNA cannot encode
            raise _NoAnswer(f"cannot resolve {brief(host)}: {e}") from None
        except OSError as e:  # refused, unreachable, timed out: again until the deadline
            if deadline - time.monotonic() <= 0.1:
                raise _NoAnswer(str(e) or type(e).__name__) from None
            time.sleep(0.1)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.sendall(frame)
        head = _recv_exact(sock, _LEN.size, deadline)
        (n,) = _LEN.unpack(head)
        if n > MAX_REPLY_BYTES:
            raise TransferError(f"P/D control reply from {host}:{port} of {n} bytes, over {MAX_REPLY_BYTES}",
                                details={"kind": "peer"})
        return _recv_exact(sock, n, deadline)
    except OSError as e:  # reset, or silent past the deadline (socket.timeout)
        raise _NoAnswer(str(e) or type(e).__name__) from None
    finally:
        sock.close()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _NoAnswer()
        sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        if k == 0:
            raise _NoAnswer("the peer closed the connection before its reply ended")
        got += k
    return bytes(buf)
