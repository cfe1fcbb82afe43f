"""Limits on HTTP connections that uvicorn does not set, shared by ``kvslots indexer`` and
``kvslots proxy``:

* a request's head (request line and headers) is at most :data:`MAX_HEAD_BYTES`, and so are
  its header fields with a chunked body's trailer fields (which are dropped): past it the
  client gets a 431 and the connection is closed (uvicorn's httptools parser has no limit: a
  300 MB header was read whole into memory);
* a request must arrive whole (head and body) within :data:`READ_TIMEOUT_S` of the connection
  opening or of the previous response on it: past it the client gets a 408 (or, when part of the
  body was read already, the connection is closed), so partial requests sent a byte at a time
  (slowloris) or connections that never send anything no longer stay open for ever; nor do
  clients that send requests and never read the answers: one that takes nothing of what it is
  sent for as long is dropped;
* at most ``max_connections`` connections are open at once (``--max-connections``; by default
  what the file descriptor limit leaves, :mod:`kvslots.indexer.fds`): one past it is answered a
  503 at once, before it sends anything, and closed, so it holds its descriptor for a moment
  only (uvicorn's ``limit_concurrency`` answers only once a request has arrived, and an idle
  connection kept its descriptor until the read timeout: when descriptors ran out, new
  connections failed, the server's own ones too);
* a client that half-closes its side once its request is sent (``shutdown(SHUT_WR)``) is
  answered, then closed (uvicorn closed the connection on the EOF, the answer unwritten); but
  for a request whose answer the app streams (:func:`eof_is_disconnect`) the EOF is the client
  gone, as uvicorn had it (a client closed at once and one half-closed look the same until
  something is written to it), and for one marked :func:`probe_eof` an interim ``100 Continue``
  written on the EOF tells them apart (a closed client's system resets the connection); a
  request answered before its body arrived whole (a 413) is closed once the client has sent
  nothing more of that body for :data:`REFUSED_LINGER_S` (its bytes were read as the next
  head's: a 431 past 64 KiB);
* at most :data:`MAX_PIPELINED` requests wait behind the one being answered on a connection:
  what a client pipelines past them is held unparsed, and nothing more read, until they are
  answered (uvicorn parsed all it was sent).

:func:`protocol_class` is what ``uvicorn.run(..., http=...)`` takes (:func:`uvicorn_options`: all
the server options the commands use); a request the parser refuses is a JSON 400 too. Bodies are
bounded by :class:`BodyLimit` (ASGI middleware), and their shape by :func:`json_shape_error`
(before they are parsed)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from .. import _args
from ..errors import ArgumentTypeError

MAX_HEAD_BYTES = 64 * 1024
READ_TIMEOUT_S = 60.0
_TICK_S = 1.0
#: How long a connection refused for the cap is kept once answered, reading and dropping what it
#: sends: closed with its request unread, the client could get a reset instead of the 503.
REFUSED_LINGER_S = 2.0
#: Most requests a connection may have parsed and waiting behind the one being answered
#: (pipelined): past it, the rest of what it sent is held unparsed and nothing more is read until
#: they are answered. uvicorn parsed every request a chunk held, and read on as each one was
#: answered: 20 connections pipelining 4 MB of ``GET /healthz`` each, reading no answer, took the
#: indexer from 60 MB to 1 GB, and /healthz on another connection went unanswered.
MAX_PIPELINED = 16
#: The scope key :func:`eof_is_disconnect` sets.
_EOF_KEY = "kvslots.eof_is_disconnect"


def eof_is_disconnect(scope: MutableMapping[str, Any]) -> None:
    """Marks the request of ``scope`` (an ASGI HTTP scope, as the guard's protocol made it) as one
    whose answer is streamed: the client's EOF (its FIN) ends it as a disconnect, at once or
    within a tick (:data:`_TICK_S`) of either coming. A half-closed client is otherwise answered,
    and a closed one was noticed only at the first byte written to it: a streamed completion
    queued in vLLM kept running seconds after its client gave up."""
    if not isinstance(scope, MutableMapping):
        raise ArgumentTypeError(f"scope must be a dict (an ASGI scope), got {type(scope).__name__}")
    scope[_EOF_KEY] = True
#: The scope key :func:`cut_off` sets.
_CUT_KEY = "kvslots.cut_off"


def cut_off(scope: MutableMapping[str, Any]) -> None:
    """Marks the answer of ``scope`` (an ASGI HTTP scope, as the guard's protocol made it) as cut
    off by the app: once the app returns (uvicorn closes the connection), what is left unsent is
    dropped and the connection aborted within a tick (:data:`_TICK_S`). Closed only, it waited for
    the client to take what was sent, up to the write stall (:data:`READ_TIMEOUT_S`)."""
    if not isinstance(scope, MutableMapping):
        raise ArgumentTypeError(f"scope must be a dict (an ASGI scope), got {type(scope).__name__}")
    scope[_CUT_KEY] = True
#: The scope key the guard sets on a request whose connection it aborted for a write stall.
_STALLED_KEY = "kvslots.write_stalled"


def write_stalled(scope: Mapping[str, Any]) -> bool:
    """Whether the guard aborted the connection of ``scope`` (an ASGI HTTP scope) because its
    client took nothing of what it was sent for :data:`READ_TIMEOUT_S`: uvicorn's send then returns
    as if it had sent (the request is marked disconnected), and the app cannot tell why."""
    return bool(scope.get(_STALLED_KEY)) if isinstance(scope, Mapping) else False
#: The scope key :func:`probe_eof` sets.
_PROBE_KEY = "kvslots.probe_eof"
#: What :func:`probe_eof` writes on the client's EOF: an interim answer every HTTP/1.1 client
#: takes before the final one (RFC 9110, 15.2; http.client skips 100 only).
_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: How long after the probe the socket is asked whether the client reset it (then at each tick).
_PROBE_WAIT_S = 0.1
#: Linux's TCP_CLOSE: the state of a socket its peer has reset (tcp_info's first byte).
_TCP_CLOSE = 7


def probe_eof(scope: MutableMapping[str, Any]) -> None:
    """Marks the HTTP/1.1 request of ``scope`` (an ASGI HTTP scope, as the guard's protocol made
    it) as one whose client's EOF is probed while no byte of its answer is written: a client that
    closed and one that half-closed look the same until written to, so the guard writes an interim
    ``100 Continue`` then; a closed client's system answers it with a reset, and the request is
    marked disconnected (the app's ``receive()`` says ``http.disconnect``) and the connection
    aborted; a half-closed client gets its answer after the interim one. Unmarked, a closed
    client was noticed only when its answer was written: the proxy ran a gone client's decode.
    Linux only (the reset is read from ``TCP_INFO``); elsewhere nothing is probed. An HTTP/1.0
    request (which takes no interim answer) is not marked."""
    if not isinstance(scope, MutableMapping):
        raise ArgumentTypeError(f"scope must be a dict (an ASGI scope), got {type(scope).__name__}")
    if scope.get("http_version") == "1.1" and hasattr(socket, "TCP_INFO"):
        scope[_PROBE_KEY] = True


#: A chunked body is fed to the parser in pieces of at least this many bytes (up to a blank
#: line): a request pipelined after it may be parsed with it, so at most this many bytes' worth
#: (a few dozen requests) come in past MAX_PIPELINED. One piece per blank line was 20-30 times
#: slower for a body of blank lines; the whole read (256 KiB) let thousands of requests in.
_CHUNKED_PIECE = 1024


def _raw_response(status: int, reason: str, detail: str, extra: str = "") -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class _Guard:
    """Mixin over a uvicorn HTTP protocol (httptools or h11); both keep the request in flight in
    ``self.cycle`` (None before the first request's head is parsed), with ``more_body`` true
    while its body is being read and ``response_complete`` once it is answered."""

    cycle: Any
    headers: Any  # (httptools) the header fields of the request being parsed
    transport: Any
    loop: Any
    connections: set  # the server's open connections, this one included
    #: Most connections open at once (None: no cap), or what holds it (its ``value`` read as
    #: each connection opens: :class:`kvslots.indexer.fds.ConnectionCap`); set by :func:`protocol_class`.
    max_connections: Any = None
    flow: Any
    _flow_class: Any  # uvicorn's FlowControl, kept paused while bytes are held (:func:`protocol_class`)

    def _guard_cap(self) -> int | None:
        cap = self.max_connections
        return cap if cap is None or isinstance(cap, int) else cap.value

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_head = 0  # bytes received while the current request's head is incomplete
        self._guard_cycle: Any = None  # the cycle the timer last saw
        self._guard_since: float | None = time.monotonic()
        self._guard_paused_at = 0.0  # when the transport last asked us to stop writing
        self._guard_closing_since: float | None = None  # closed with an answer still unsent
        self._guard_cycles: list[Any] = []  # requests parsed and not yet answered (pipelined ones too)
        self._guard_last_data = time.monotonic()  # when the client last sent something
        self._guard_held = b""  # received, not parsed yet: past MAX_PIPELINED requests waiting
        self._guard_eof = False  # the client half-closed while bytes were held
        self._guard_eof_seen = False  # the client half-closed (or closed: they look the same)
        self._guard_probed: Any = None  # the cycle whose EOF was probed (probe_eof)
        self._guard_fields = 0  # (httptools) bytes of the current request's header fields
        self._guard_trailers = False  # (httptools) its head is parsed: fields now are trailers
        self._guard_body = 0  # (httptools) the body's bytes the parser has still to see; -1: chunked
        if hasattr(self, "pipeline"):  # (httptools: h11 parses a request only once the last is answered)
            self.flow = self._flow_class(transport, self)
        cap = self._guard_cap()
        self._guard_refused = cap is not None and len(self.connections) > cap
        if self._guard_refused:
            self._guard_refuse()
            return
        self._guard_timer = self.loop.call_later(_TICK_S, self._guard_tick)

    def _guard_refuse(self) -> None:
        # Answered before its request is read (there may be none): the 503 says why, then the
        # connection is half-closed and kept a moment only, what the client sends dropped.
        self.transport.write(_raw_response(
            503, "Service Unavailable",
            f"the server has {self._guard_cap()} connections open, its most; retry later",
            extra="retry-after: 1\r\n"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._guard_timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_guard_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self._guard_paused_at = time.monotonic()

    def _write_stalled(self, now: float) -> bool:
        """Whether the client has taken nothing of what it is sent for :data:`READ_TIMEOUT_S`: the
        transport has asked us to stop writing since, or the connection was closed with an answer
        it has not read (close() waits for the client to read it all); at once when the app cut
        its answer off (:func:`cut_off`) and the connection is closing."""
        c = self.cycle
        if c is not None and c.scope.get(_CUT_KEY) and self.transport.is_closing():  # (cut_off) unsent: dropped
            return True
        flow = getattr(self, "flow", None)
        if flow is not None and flow.write_paused:
            return now - self._guard_paused_at > READ_TIMEOUT_S
        if self.transport.is_closing() and self.transport.get_write_buffer_size():
            if self._guard_closing_since is None:
                self._guard_closing_since = now
            return now - self._guard_closing_since > READ_TIMEOUT_S
        return False

    def _in_head(self) -> bool:
        # A request answered before its body arrived whole (a 413) is still reading that body:
        # its bytes were counted as the next head's, and past 64 KiB the client was sent a 431.
        c = self.cycle
        return c is None or (c.response_complete and not c.more_body)

    def eof_received(self) -> bool:
        # The client has sent all it will (shutdown(SHUT_WR), nc -N): uvicorn closed the
        # connection there, so the answer to a request sent whole was never written (a sync
        # route's, or one waiting on a backend). Kept open for writing until the last request
        # parsed is answered; closed at once when there is none, or its body is cut short.
        self._guard_eof_seen = True
        if self._guard_held and not self._guard_refused:  # its last requests are not parsed yet
            self._guard_eof = True
            return True
        c = self.cycle
        if self._guard_refused or c is None or c.response_complete or c.more_body or self._guard_gone(c):
            return False
        c.keep_alive = False  # the last request parsed (pipelined ones come before it)
        self._guard_probe(c)
        return True

    def _guard_probe(self, c: Any) -> None:
        """Writes the interim answer that tells a closed client from a half-closed one
        (:func:`probe_eof`) once for ``c``, when it is marked, its client's EOF seen and nothing
        else is being answered on the connection (no byte of an answer is under way)."""
        if (self._guard_probed is c or not self._guard_eof_seen or not c.scope.get(_PROBE_KEY)
                or c.response_started or c.response_complete or self.transport.is_closing()
                or getattr(self, "pipeline", ()) or any(w is not c and not w.response_complete
                                                        for w in self._guard_cycles)):
            return
        self._guard_probed = c
        self.transport.write(_PROBE)
        self.loop.call_later(_PROBE_WAIT_S, self._guard_check_reset)

    def _guard_reset(self) -> bool:
        """Whether the client reset the connection since its EOF was probed: every request it
        has waiting is then marked disconnected."""
        c = self._guard_probed
        if c is None or c.response_complete or self.transport.is_closing():
            return False
        try:
            sock = self.transport.get_extra_info("socket")
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
        except (OSError, AttributeError, IndexError):  # closed meanwhile; no TCP_INFO
            return False
        if state != _TCP_CLOSE:
            return False
        self._guard_mark_gone()
        return True

    def _guard_check_reset(self) -> None:
        if self._guard_reset():
            self.transport.abort()

    def _guard_gone(self, c: Any) -> bool:
        """Whether the client's EOF ends ``c`` (unanswered) as a disconnect (:func:`eof_is_disconnect`):
        every request it has waiting is marked so (uvicorn marks the newest only, on closing)."""
        if not (self._guard_eof_seen and not c.response_complete and c.scope.get(_EOF_KEY)):
            return False
        self._guard_mark_gone()
        return True

    def _guard_mark_gone(self) -> None:
        """Every request of this connection still unanswered ends as a disconnect."""
        for w in self._guard_cycles:
            if not w.response_complete:
                w.disconnected = True
                w.message_event.set()

    def data_received(self, data: bytes) -> None:
        if self._guard_refused:  # answered already: nothing it sends is read
            return
        self._guard_last_data = time.monotonic()
        if self._guard_held:  # (a read under way as reading was paused)
            self._guard_held += data
            return
        self._guard_feed(data)

    def _guard_feed(self, data: bytes) -> None:
        """Parses ``data`` up to the end of one request head at a time while fewer than
        :data:`MAX_PIPELINED` requests wait, holding the rest (reading paused) otherwise. A
        body is parsed whole (split at every blank line, 60 MB of them took 38 s): exactly the
        Content-Length left of it, so requests pipelined behind it are split at their heads' ends
        as any; a chunked body, whose end the parser alone finds, in pieces of at least
        :data:`_CHUNKED_PIECE` bytes up to a head's end (a piece holds that many bytes' worth of
        pipelined requests at most)."""
        pipeline = getattr(self, "pipeline", None)
        pos = 0
        while pos < len(data):
            if pipeline is not None and len(pipeline) >= MAX_PIPELINED:
                self._guard_held = data[pos:]
                self.flow.pause_reading()  # kept paused while bytes are held (_flow_class)
                return
            left = self._guard_body
            if pipeline is None:  # (h11 parses one request at a time)
                piece = data[pos:]
            elif left > 0:
                piece = data[pos:pos + left]
            else:
                end = data.find(b"\r\n\r\n", pos if left == 0 else pos + _CHUNKED_PIECE)
                piece = data[pos:] if end < 0 else data[pos:end + 4]  # one head ends in it at most
            pos += len(piece)
            self._guard_parse(piece)
            if self.transport.is_closing():
                return

    def _guard_deep(self) -> bool:
        """Whether reading is to stay paused: bytes are held unparsed, or :data:`MAX_PIPELINED`
        requests or more wait (uvicorn resumes it as each request is answered)."""
        return bool(self._guard_held) or len(getattr(self, "pipeline", ())) >= MAX_PIPELINED

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        pipeline = getattr(self, "pipeline", ())
        if self._guard_held and len(pipeline) < MAX_PIPELINED and not self.transport.is_closing():
            held, self._guard_held = self._guard_held, b""
            self._guard_feed(held)
            if not self._guard_held and not self.transport.is_closing():
                self.flow.resume_reading()  # (not while MAX_PIPELINED wait)
                if self._guard_eof and not self.eof_received():
                    self.transport.close()

    # httptools' callbacks (h11 bounds a head and its trailers itself).
    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._guard_fields = 0  # bytes of this request's header and trailer fields
        self._guard_trailers = False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._guard_trailers = True
        left = 0  # what the parser takes as the body: Content-Length bytes, or chunks (-1)
        for name, value in self.headers:  # (lower-cased by uvicorn; the parser checked them)
            if name == b"transfer-encoding":
                left = -1
                break
            if name == b"content-length":
                left = int(value) if value.strip().isdigit() else -1
        self._guard_body = left

    def on_body(self, body: bytes) -> None:
        if self._guard_body > 0:
            self._guard_body -= len(body)
        super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._guard_body = 0
        super().on_message_complete()  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        # A chunked body's trailer fields came after the head, uncounted, and uvicorn appended
        # them to the request's headers (the scope's list, the app reading it meanwhile): 112 MB
        # of them grew the indexer by 1.6 GB. They are counted with the head's, and dropped (ASGI
        # has no request trailers).
        self._guard_fields += len(name) + len(value) + 4
        if self._guard_fields > MAX_HEAD_BYTES:
            if not self.transport.is_closing():
                c = self.cycle
                if c is None or c.response_complete:  # no answer under way: say why
                    self.transport.write(_raw_response(431, "Request Header Fields Too Large",
                                                       f"header fields over {MAX_HEAD_BYTES} bytes"))
                self.transport.close()
            return
        if not self._guard_trailers:
            super().on_header(name, value)  # type: ignore[misc]

    def _guard_parse(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        if self.cycle is not before or not self._in_head():
            self._guard_head = 0  # a new head was parsed (its body may be in this chunk)
            if self.cycle is not before:  # (several at once when pipelined: the rest are queued)
                queued = [c for c, _ in getattr(self, "pipeline", ())]
                self._guard_cycles = [c for c in {*self._guard_cycles, *queued, self.cycle} if not c.response_complete]
            return
        self._guard_head += len(data)
        if self._guard_head > MAX_HEAD_BYTES:
            self.transport.write(_raw_response(431, "Request Header Fields Too Large",
                                               f"request line and headers over {MAX_HEAD_BYTES} bytes"))
            self.transport.close()

    def _guard_tick(self) -> None:
        self._guard_timer = None
        now = time.monotonic()
        # A client that sends requests and never reads the answers (pipelined, or one whose
        # answer outgrows the socket buffers) held its connection for ever: enough of them took
        # every place under --max-connections, and each closed one kept its descriptor.
        if self._write_stalled(now):
            # uvicorn marks only the newest request disconnected: one answered before it (pipelined)
            # then wrote to the aborted transport, a RuntimeError under uvloop.
            for c in self._guard_cycles:
                if not c.response_complete:
                    c.disconnected = True
                    c.scope[_STALLED_KEY] = True
            self.transport.abort()
            return
        c = self.cycle
        if c is not None and self._guard_gone(c):  # a stream whose client has gone
            self.transport.abort()
            return
        if c is not None and self._guard_eof_seen:  # marked after the EOF came, or reset since
            self._guard_probe(c)
            if self._guard_reset():
                self.transport.abort()
                return
        if self.transport.is_closing():
            if self.transport.get_write_buffer_size():  # until it is read, or it stalls
                self._guard_timer = self.loop.call_later(_TICK_S, self._guard_tick)
            return
        flow = getattr(self, "flow", None)
        if flow is not None and flow.write_paused:  # an answer under way: the read timeout waits
            self._guard_timer = self.loop.call_later(_TICK_S, self._guard_tick)
            return
        c = self.cycle
        if c is not None and c.response_complete and c.more_body and now - self._guard_last_data > REFUSED_LINGER_S:
            # Answered (a 413) with its body unread, and the client sends no more of it: the
            # rest is not waited for.
            self.transport.close()
            return
        reading = self._in_head() or bool(c.more_body)
        if not reading:
            self._guard_since = None
        elif self._guard_since is None or c is not self._guard_cycle:
            self._guard_since = now
        elif now - self._guard_since > READ_TIMEOUT_S:
            if self._in_head():  # no response under way: say why
                self.transport.write(_raw_response(408, "Request Timeout",
                                                   f"the request did not arrive whole within {READ_TIMEOUT_S:g} s"))
            self.transport.close()
            return
        self._guard_cycle = c
        self._guard_timer = self.loop.call_later(_TICK_S, self._guard_tick)


    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request its parser refuses (duplicate or negative Content-Length,
        # a bad chunk size, a raw non-ASCII path, ...) is text/plain: answer JSON as every route does.
        if not self.transport.is_closing():
            self.transport.write(_raw_response(400, "Bad Request", msg))
            self.transport.close()


def protocol_class(max_connections: Any = None) -> type:
    """uvicorn's HTTP protocol (httptools when installed, as its 'auto' picks, else h11) with
    the limits above; ``max_connections`` open at once (None: no cap; an object with a ``value``:
    its value as each connection opens, :class:`kvslots.indexer.fds.ConnectionCap`)."""
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    from uvicorn.protocols.http.flow_control import FlowControl

    class _HoldingFlow(FlowControl):
        """uvicorn's flow control, but reading is not resumed while the guard holds bytes
        unparsed or too many requests wait (uvicorn resumes it as each request is answered or
        reads its body)."""

        def __init__(self, transport: Any, guard: Any) -> None:
            super().__init__(transport)
            self._guard = guard

        def resume_reading(self) -> None:
            if not self._guard._guard_deep():
                super().resume_reading()

    return type(f"Guarded{base.__name__}", (_Guard, base),
                {"max_connections": max_connections, "_flow_class": _HoldingFlow})


def uvicorn_options(max_connections: Any = None) -> dict[str, Any]:
    """What ``uvicorn.run`` / ``uvicorn.Config`` take for the indexer and the proxy: the guarded
    protocol (at most ``max_connections`` connections open at once), and no WebSocket support
    (neither has a WebSocket route: an ``Upgrade: websocket`` request was a 403 with an empty
    body; without it, it is an ordinary HTTP request), and no client address taken from
    ``X-Forwarded-For`` (uvicorn trusts it from 127.0.0.1 by default: behind the default
    ``--host 127.0.0.1`` any client could name a new address in each request and pass the proxy's
    per-client limit)."""
    return {"http": protocol_class(max_connections), "ws": "none", "proxy_headers": False}


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413 before anything parses them. A body with
    no Content-Length is counted as it streams in; past the limit the client gets the 413 and
    the app sees a disconnect (whatever it answers then is dropped). The answer is
    ``{key: reason}`` (the indexer's ``detail``, the proxy's OpenAI-style ``error``).

    With ``budget_bytes``, the bodies of all requests being read or handled at once are at most
    that many bytes together (a Content-Length is counted whole as the request starts): one that
    would take them past it is a 503 with ``Retry-After: 1``, the same way. Each body was bounded
    and their number only by the connection cap: six 60 MB prompts at once took the proxy to
    1.6 GB, and it took 300 MB more for each one after."""

    def __init__(self, app: Any, max_bytes: int, key: str = "detail", budget_bytes: int | None = None):
        self.app = app
        self.max = max_bytes
        self.key = key
        self.budget = budget_bytes
        #: Bytes of the bodies of the requests in flight (all on the event loop: no lock).
        self.in_flight = 0

    def _over_budget(self, n: int) -> str | None:
        if self.budget is None or self.in_flight + n <= self.budget:
            return None
        return (f"the server is reading or handling {self.in_flight} bytes of request bodies, and takes at most "
                f"{self.budget} at once; retry later")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        taken = 0  # of the budget, given back when the request is done
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    return await self._reply(send, 400, "bad Content-Length")
                if n > self.max:
                    return await self._reply(send, 413, f"request body over {self.max} bytes")
                why = self._over_budget(n)
                if why is not None:
                    return await self._reply(send, 503, why, retry=True)
                taken = n
        self.in_flight += taken
        seen = 0
        state = {"started": False, "refused": False}

        async def limited():
            nonlocal seen, taken
            if state["refused"]:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                refusal = None
                if seen > self.max:
                    refusal = (413, f"request body over {self.max} bytes")
                elif seen > taken:  # no Content-Length: counted as it comes
                    why = self._over_budget(seen - taken)
                    if why is not None:
                        refusal = (503, why)
                    else:
                        self.in_flight += seen - taken
                        taken = seen
                if refusal is not None:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = True
                        await self._reply(send, *refusal, retry=refusal[0] == 503)
                    return {"type": "http.disconnect"}
            return msg

        async def tracked(msg):
            if state["refused"]:
                return
            if msg["type"] == "http.response.start":
                state["started"] = True
            await send(msg)

        try:
            await self.app(scope, limited, tracked)
        except Exception:
            if not state["refused"]:
                raise
        finally:
            self.in_flight -= taken

    async def _reply(self, send, status: int, detail: str, retry: bool = False) -> None:
        body = json.dumps({self.key: detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + ([(b"retry-after", b"1")] if retry else [])})
        await send({"type": "http.response.body", "body": body})


def json_shape_error(body: bytes, max_containers: int | None, max_strings: int | None,
                     max_items: int | None = None, *, strings_alone: bool = False) -> str | None:
    """Why ``body`` cannot be a JSON document of at most ``max_containers`` arrays and objects
    and ``max_items`` array items and object members (and, with ``strings_alone``, at most
    ``max_strings`` strings, keys included), found in a few passes of C over the bytes before
    any parser builds it; None when it may be. None for a bound: no limit on it.

    Parsing holds the GIL, in a worker thread too, and an empty array or object is the costliest
    thing per byte to build: a 3 MB body of a million ``[]`` held every other request of the
    indexer for about 0.5 s, 30 MB of them every other request of the proxy for 6 s. Counted
    here, past the route's most, they are refused before they are built.

    Every ``[``, ``{`` and ``,`` byte is counted first (those in strings too: an upper bound);
    only when that is over a bound are the ones in strings told apart, which costs a piece per
    string: past ``max_strings`` strings that is not tried, and the body is refused as having
    too many of both."""
    if not isinstance(body, (bytes, bytearray)):
        raise ArgumentTypeError(f"body must be bytes, got {type(body).__name__}")
    max_containers, max_strings, max_items = (
        None if v is None else _args.integer(v, name, 0)
        for v, name in ((max_containers, "max_containers"), (max_strings, "max_strings"), (max_items, "max_items")))
    plain = None
    if strings_alone and max_strings is not None:
        plain = _unescaped(body)
        n = plain.count(b'"') // 2
        if n > max_strings:
            return f"{n} strings (keys included); at most {max_strings} are taken"
    containers = max_containers is not None and body.count(b"[") + body.count(b"{") > max_containers
    # n items hold at most n - 1 commas (one item fewer per array or object holding any)
    items = max_items is not None and body.count(b",") >= max(max_items, 1)
    if not containers and not items:
        return None
    plain = _unescaped(body) if plain is None else plain
    if max_strings is not None and plain.count(b'"') > 2 * max_strings:
        what = " or ".join(x for x, over in (("'[' and '{'", containers), ("','", items)) if over)
        return (f"more {what} than the route takes and more than {max_strings} strings (keys included), "
                "its most")
    outside = b"".join(plain.split(b'"')[::2])
    n = outside.count(b"[") + outside.count(b"{")
    if max_containers is not None and n > max_containers:
        return f"{n} arrays and objects; at most {max_containers} are taken"
    n = outside.count(b",")
    if max_items is not None and n >= max(max_items, 1):
        return f"at least {n + 1} array items and object members; at most {max_items} are taken"
    return None


def json_members(body: bytes) -> int:
    """How many object members (``"key": value``) the JSON document ``body`` holds, nested ones
    included: its ``:`` bytes outside strings (in a valid document there are no others). Costs a
    piece per string, as :func:`json_shape_error` does."""
    if not isinstance(body, (bytes, bytearray)):
        raise ArgumentTypeError(f"body must be bytes, got {type(body).__name__}")
    if b":" not in body:
        return 0
    plain = _unescaped(body)
    return b"".join(plain.split(b'"')[::2]).count(b":") if b'"' in plain else plain.count(b":")


def _unescaped(body: bytes) -> bytes:
    """``body`` without its escaped backslashes, then its escaped quotes: the quotes left open
    and close its strings (in a valid document; an invalid one is refused by its parser, having
    built no more than what comes before its first error)."""
    return body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
