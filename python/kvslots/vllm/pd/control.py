"""The P/D control channel: small msgpack requests from a decode worker to a prefill worker over
ZMQ (the KV bytes themselves go through Mooncake, :mod:`.transport`).

Two operations, both answered at once by a background thread of the prefill worker:

- ``hello``: the prefill worker's Mooncake session, block layout (every layer, target and draft),
  block size and model name, so the decode worker can check both sides match before reading;
- ``done``: the decode worker finished (or gave up) reading a request's blocks; the prefill
  worker may free them. The answer says whether the blocks were still held when the read ended
  (``held``: false when the prefill worker's hold timed out first, so the bytes read may be
  stale and the decode worker must not use them).

Every client call has a timeout and a fresh socket per attempt, so a dead or restarted peer
gives a :class:`~kvslots.errors.TransferError` (kind ``"peer"`` / ``"timeout"``), never a hang.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ..._args import C_INT_MAX, callback, integer, number, text
from ...config.loader import brief
from ...errors import ArgumentTypeError, InvalidArgumentError, TransferError
from ...events.codec import DECODE_ERRORS

logger = logging.getLogger(__name__)

__all__ = ["ControlServer", "control_call"]

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()

#: Largest control message accepted. Requests are under a KiB and a ``hello`` reply (every
#: layer's segment layout) some KiB; a larger frame is a hostile or broken peer, and ZMQ drops
#: its connection before buffering it (a 512 MiB frame was read whole before this cap).
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 16 << 20


class ControlServer:
    """Answers control requests on ``tcp://host:port`` with ``handler(msg) -> reply`` on its own
    thread. ``port`` 0 picks a free port (see :attr:`port`)."""

    def __init__(self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]]):
        # Checked before a socket exists: a lone surrogate in host was a UnicodeEncodeError that
        # left the socket open, a port of -1 or 2**70 was "bound", a handler no callable killed
        # the serving thread at the first request.
        host = _host(host)
        port = integer(port, "port", 0, 65535)
        handler = callback(handler, "handler")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close()
            raise TransferError(f"P/D control socket cannot bind tcp://{host}:{port}: {e}",
                                details={"kind": "engine"}) from None
        except BaseException:
            self._sock.close()
            raise
        self.host = host
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvslots-pd-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            _unpin_thread()
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    ident, _, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except (zmq.ZMQError, ValueError):
                    continue
                try:
                    msg = _DEC.decode(payload)
                    if not isinstance(msg, dict):
                        raise TypeError("not a map")
                    reply = _ENC.encode(self._handler(msg))
                except Exception as e:  # a bad request must not stop the server
                    # Encoded in here too: a reply msgpack cannot encode (a handler's bug) ended
                    # this thread, and every later request went unanswered.
                    reply = _ENC.encode({"error": f"{type(e).__name__}: {e}".encode("utf-8", "replace").decode()})
                try:
                    self._sock.send_multipart([ident, b"", reply], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        finally:
            self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _unpin_thread() -> None:
    """Lets the calling thread run on every CPU. vLLM's CPU workers pin their process (and so
    every new thread) to the cores of their OpenMP pool, where a busy engine loop can starve a
    small service thread for minutes."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # pid 0: this thread only (Linux)
    except (AttributeError, OSError):
        pass


#: Longest wait of one try, in seconds: ZMQ's poll takes milliseconds as a C int.
MAX_TIMEOUT_S = C_INT_MAX // 1000
#: Most retries of one call.
MAX_RETRIES = 100


def _host(host: Any) -> str:
    host = text(host, "host")
    if not host or "\0" in host:
        raise InvalidArgumentError(f"host must be a host name or address, got {host!r}")
    return host


def control_call(host: str, port: int, msg: dict[str, Any], *, timeout_s: float, retries: int = 1) -> dict[str, Any]:
    """Sends ``msg`` to a :class:`ControlServer` and returns its reply; a
    :class:`~kvslots.errors.TransferError` when no reply comes within ``timeout_s`` (per try) or
    the reply is an error. Checked before anything is sent: ``timeout_s`` and ``retries``
    (:class:`~kvslots.errors.InvalidArgumentError`), ``msg`` a dict
    (:class:`~kvslots.errors.ArgumentTypeError`); a host, port or msg content that cannot reach
    a server (they come from the peer's hand-off, ``kv_transfer_params``) is a TransferError
    (kind ``"peer"``), as a peer that does not answer is."""
    # Checked first: a negative timeout_s was ZMQ's "wait forever" (a hang), NaN, inf or None a
    # builtin ValueError, OverflowError or TypeError, a msg msgpack cannot encode a TypeError or
    # UnicodeEncodeError, one over the server's cap waited out every try unanswered.
    timeout_s = number(timeout_s, "timeout_s", positive=True, hi=MAX_TIMEOUT_S)
    retries = integer(retries, "retries", 0, MAX_RETRIES)
    if not isinstance(msg, dict):
        raise ArgumentTypeError(f"msg must be a dict, got {type(msg).__name__}")
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
    ctx = zmq.Context.instance()
    last = ""
    for _ in range(retries + 1):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send_multipart([b"", payload])
            if sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN):
                frames = sock.recv_multipart()
                try:
                    reply = _DEC.decode(frames[-1])
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
            last = f"no reply within {timeout_s} s"
        except zmq.ZMQError as e:
            last = str(e)
        finally:
            sock.close()
        time.sleep(0.05)
    raise TransferError(f"P/D peer {host}:{port} did not answer {brief(msg.get('op'))}: {last}",
                        details={"kind": "timeout"})
