"""The disaggregated front door: an OpenAI-compatible HTTP server that runs each request's
prompt on a prefill worker and its decode on a decode worker.

For ``POST /v1/completions`` and ``/v1/chat/completions``:

1. the request goes to a prefill worker (round robin) with ``max_tokens`` 1, no streaming and
   ``kv_transfer_params: {"do_remote_decode": true}``; its answer carries the
   ``kv_transfer_params`` the KVSlotsConnector (kv_producer) returned: the prefill engine, its
   block ids, the control port;
2. the original request, with those ``kv_transfer_params``, goes to a decode worker, whose
   answer (streamed when the request asked for a stream) is the client's.

The decode worker is the one with the best ``kvslots indexer`` score for the prompt when an
indexer is given and the prompt is token ids (the proxy does not tokenize), else round robin.

A prefill worker that fails or answers without ``kv_transfer_params`` (or with anything but a
JSON object) does not fail the request: it goes to the decode worker without them and is
computed there (the response then has the header ``x-kvslots-pd: recomputed``), but for its
401 or 403 to the client's credential, the client's answer as it is (the client is not let in;
one to the proxy's own, ``backend_api_key`` or the URL's user:password, is recomputed). A decode worker
that fails (no answer, a 5xx) is a 502 with the reason; its 4xx answer (the request's fault:
vLLM's 400 for a bad parameter) is the client's, status and body. A request body that is not a
JSON object under kvslots' strict parser (no NaN, no duplicate keys, at most 64 levels, Unicode
text) is a 400, and so is one of more arrays and objects, or strings, than a request holds
(:data:`MAX_BODY_CONTAINERS`, :data:`MAX_BODY_STRINGS`), refused before it is parsed. A big
body's arrays of numbers (a prompt of token ids, floats) are checked and forwarded as sent,
never built into Python objects (:func:`_parse_body`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
from logging import DEBUG, INFO, WARNING
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter

from ..config.loader import MAX_DEPTH, loads_strict_json
from .._ratelog import RateLimitedLog
from ..errors import ArgumentTypeError, ConfigError, InvalidArgumentError, short_repr
from ..indexer.config import check_worker_name
from ..indexer.httpguard import (BodyLimit, cut_off, eof_is_disconnect, json_members, json_shape_error, probe_eof,
                                 write_stalled)
from .cli import (check_unique_names, default_requests_per_client, http_url, requests_per_client, seconds, shown_url,
                  userinfo_urls)

logger = logging.getLogger(__name__)

__all__ = ["DecodeWorker", "create_app", "prefill_body", "DEFAULT_MAX_BODY_MB"]

#: Most connections to the prefill and decode workers open at once by default
#: (``--backend-connections``; the command takes half of what the descriptor limit leaves when
#: that is less, :func:`kvslots.indexer.fds.default_backend_connections`): each request being
#: answered holds one. At httpx's 100, a benchmark at concurrency 256 queued in the proxy, while
#: vLLM takes 256 requests at once and more (max_num_seqs).
BACKEND_CONNECTIONS = 1024
#: Most backend connections given: a descriptor each.
MAX_BACKEND_CONNECTIONS = 1 << 16
#: Pools of their own for the short calls, the indexer's /score and ``GET /v1/models``, so that they
#: do not wait behind the requests holding every backend connection, nor /score behind clients
#: asking for the models (in one pool, 16 of them waiting on a decode worker slow to answer held
#: it, and every prompt's /score waited past its 2 s: round robin).
SCORE_CONNECTIONS = 6
MODELS_CONNECTIONS = 2
#: Connections of both: the descriptors the command sets aside for them.
SIDE_CONNECTIONS = SCORE_CONNECTIONS + MODELS_CONNECTIONS

#: Largest request body accepted by default (``--max-body-mb``): a 1000 MB body was read whole
#: (2 GB of memory) before a byte of it was looked at.
DEFAULT_MAX_BODY_MB = 64


@dataclass(frozen=True)
class DecodeWorker:
    url: str
    #: the worker's name in the indexer (``kvslots indexer`` workers), None: not scored
    indexer_name: str | None = None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill worker's copy of a request: one token (no ``min_tokens``), no stream, asks for a
    remote decode."""
    if not isinstance(body, dict):
        raise ArgumentTypeError(f"body must be a dict (a JSON object), got {type(body).__name__}")
    out = dict(body)  # only top-level keys change: nothing nested is copied
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    # vLLM refuses min_tokens past max_tokens (a 400): every request with min_tokens > 1 was
    # computed again on the decode worker, its prefill refused. One token suppresses no EOS that
    # matters here: the decode worker samples the answer.
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


#: Most bytes of request bodies read or handled at once (:class:`BodyLimit`'s budget; four of
#: the largest when that is more): past it a 503 with Retry-After. Six 60 MB text prompts at
#: once took the proxy to 1.6 GB, each one more to 300 MB more, bounded only by the connection cap.
BODY_BUDGET_BYTES = 256 * 2**20

#: Most arrays and objects, and strings (keys included), a request body may hold: past them a
#: 400 before it is parsed (:func:`kvslots.indexer.httpguard.json_shape_error`). Parsing holds the
#: GIL, off the event loop too: a 30 MB body of 10 million empty arrays took 15 s and held every
#: other request, /healthz too, for 6 s; one of 7.8 million empty strings, 3 s and 1.4 s. A chat
#: of 10,000 messages holds about 20,000 objects and 50,000 strings.
MAX_BODY_CONTAINERS = 2**17
MAX_BODY_STRINGS = 2**19

#: Bodies past this size are parsed (and re-encoded for the backends) in a worker thread: on the
#: event loop, a 30 MB body of 2.6 million keys held every other request, /healthz too, for 13 s.
OFF_LOOP_BYTES = 256 * 1024


async def _off_loop(fn: Any, *args: Any) -> Any:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


#: A top-level value of a big body (past :data:`OFF_LOOP_BYTES`) that is numbers, true, false and
#: null in arrays only (a prompt of token ids, a list of embeddings) and longer than this is kept
#: as sent (:class:`msgspec.Raw`), never parsed: the strict parser built 4.5 million ints of a
#: 27 MB prompt in 1.3 s holding the GIL (every other request, /healthz too, waited), and
#: json.dumps took 1 s more for each backend; 40 MB of floats took 10-17 s (a Python call each),
#: held /healthz up to 4 s and took 400 MB.
RAW_VALUE_BYTES = 4096
#: Longest run of digits kept as sent (a uint64 has 20): a longer integer, mantissa or exponent is
#: parsed, as before (an integer of too many digits, a float out of range: refused).
_RAW_INT_DIGITS = 20
_INT_ARRAY_BYTES = b"0123456789-[], \t\r\n"
#: Digits as 0 and E as e: a run of digits, and an exponent of three digits or more, not negative
#: (it may take a float past its range: mantissas are under 10**21 here), are found by find().
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789E", b"000000000e")
_BRACKET_STEP = {ord("["): 1, ord("]"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKET_STEP)
_BOM = b"\xef\xbb\xbf"
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _plain_arrays(value: bytes) -> bool:
    """Whether ``value``, a JSON value msgspec has checked the syntax of (it refuses NaN and
    Infinity), holds arrays of numbers, true, false and null only (no string, no object), no
    run of more than :data:`_RAW_INT_DIGITS` digits, no exponent of three digits or more that is
    not negative, nested less than :data:`MAX_DEPTH` levels (one more in the body): nothing the
    strict parser refuses (no key, no string, no NaN, no float out of range, no integer of too
    many digits) can be in it."""
    if b'"' in value or b"{" in value:
        return False
    zeros = value.translate(_DIGITS_AS_ZERO, b"+")  # '+' is only ever an exponent's sign
    if zeros.find(b"0" * (_RAW_INT_DIGITS + 1)) >= 0:
        return False
    # backwards: '0' is everywhere, 'e' seldom but in true and false (find() keys on the last byte)
    if b"e" in zeros and zeros[::-1].find(b"000e") >= 0:
        return False
    if value.count(b"[") >= MAX_DEPTH:  # only then can it be too deep
        brackets = value.translate(None, _NOT_BRACKETS)
        return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0) < MAX_DEPTH
    return True


def _parse_body(raw: bytes) -> Any:
    """A request body under kvslots' strict JSON rules (:func:`loads_strict_json`: no NaN, no
    duplicate key, at most 64 levels, Unicode text); a :class:`ConfigError` saying why not. A
    big one's (:data:`OFF_LOOP_BYTES`) top-level values of numbers in arrays only are
    :class:`msgspec.Raw`, their bytes as sent (:data:`RAW_VALUE_BYTES`), never parsed, and so are
    its other long values but ``stream``, once the strict parser has checked them; None when it
    is not a JSON object."""
    if len(raw) <= OFF_LOOP_BYTES:
        return loads_strict_json(raw)
    # msgspec checks the whole body's syntax and splits its top level, building none of the values.
    # What it refuses the strict parser refuses too, but for a UTF-8 BOM (skipped as that does).
    bom = 3 if raw.startswith(_BOM) else 0
    try:
        fields = _TOP_LEVEL.decode(memoryview(raw)[bom:])
    except msgspec.ValidationError:  # an array, a string, ...
        return None
    except msgspec.DecodeError as e:
        at = re.search(r"\(byte (\d+)\)", str(e))
        start = int(at[1]) + bom if at else len(raw)
        near = raw[start:start + 24]
        if near:  # what is there, as the strict parser names a NaN
            also = f" at {near.decode(errors='replace')!r}"
        else:  # what msgspec says of a lone surrogate's escape (the strict parser: not Unicode text)
            surrogate = "truncated" in str(e) and _SURROGATE_ESCAPE.search(raw)
            also = " or a \\u escape of a lone surrogate" if surrogate else ""
        raise ConfigError(f"invalid JSON: {e}{also}") from None
    except RecursionError:
        raise ConfigError(f"nested more than {MAX_DEPTH} levels deep") from None
    except UnicodeDecodeError:  # in a key (msgspec decodes those only)
        raise ConfigError("invalid JSON: not UTF-8") from None
    doc: dict[str, Any] = {}
    members = json_members(raw)
    for key, field in fields.items():
        value = bytes(field)
        big = len(value) > RAW_VALUE_BYTES
        if big and _plain_arrays(value):
            doc[key] = msgspec.Raw(value)
        else:  # in brackets: nested as deep as it is in the body
            parsed = loads_strict_json(b"[" + value + b"]")[0]
            members -= json_members(value)
            # Checked, a big value is forwarded as sent (the proxy reads only the prompt, which
            # _token_ids reads as sent, and stream): json.dumps wrote 40 MB of floats in objects
            # holding the GIL, so every other request, /healthz too, for 3 s.
            doc[key] = msgspec.Raw(value) if big and key != "stream" else parsed
    # msgspec keeps the last of a repeated key; the body's ':' outside strings count every one
    if members != len(fields):
        raise ConfigError("a duplicate key in the top-level object")
    return doc


def _request_doc(raw: bytes) -> dict[str, Any] | str:
    """A request body's JSON object, or why it is refused (a 400): its shape first
    (:func:`json_shape_error`), then kvslots' strict JSON rules (:func:`_parse_body`)."""
    why = json_shape_error(raw, MAX_BODY_CONTAINERS, MAX_BODY_STRINGS, strings_alone=True)
    if why is not None:
        return f"request body has {why}"
    try:
        body = _parse_body(raw)
    except ConfigError as e:
        return f"request body is not JSON: {e.reason}"
    return body if isinstance(body, dict) else "request body must be a JSON object"


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _json_bytes(doc: Any) -> bytes:
    """``doc`` as httpx's ``json=`` encodes it (compact UTF-8, no NaN); a top-level value that is a
    :class:`msgspec.Raw` (:func:`_parse_body`) is written as it is."""
    if isinstance(doc, dict) and any(isinstance(v, msgspec.Raw) for v in doc.values()):
        return msgspec.json.encode({k: v if isinstance(v, msgspec.Raw) else msgspec.Raw(_dumps(v))
                                    for k, v in doc.items()})
    return _dumps(doc)


async def _encoded(doc: Any, big: bool, auth: dict[str, bytes] | None = None) -> dict[str, Any]:
    """What ``client.post``/``build_request`` take for a JSON body: encoded in a worker thread when
    the request was big (:data:`OFF_LOOP_BYTES`); with ``auth``'s headers (:func:`_client_auth`)."""
    content = await _off_loop(_json_bytes, doc) if big else _json_bytes(doc)
    return {"content": content, "headers": {"content-type": "application/json", **(auth or {})}}


#: Longest ``backend_api_key`` (``--backend-api-key``).
MAX_API_KEY = 4096


def check_api_key(value: object, what: str = "backend_api_key") -> str:
    """``value`` when it is a key the proxy can send as ``Authorization: Bearer KEY`` (vLLM's
    ``--api-key``): 1..:data:`MAX_API_KEY` printable ASCII characters, no blank; an
    :class:`~kvslots.InvalidArgumentError` naming ``what`` otherwise (the key is not shown)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_API_KEY or not all("!" <= c <= "~" for c in value):
        raise InvalidArgumentError(f"{what} must be 1..{MAX_API_KEY} printable ASCII characters without blanks "
                                   f"(got {len(value)} characters)")
    return value


def check_one_credential(urls: Sequence[str], what: str = "backend_api_key") -> None:
    """With the workers' key (``what``), a worker URL (of ``urls``) with ``user:password@`` is an
    :class:`~kvslots.InvalidArgumentError`: httpx sends it as Basic auth in place of the key, which
    silently lost. The one check of this rule (the command line and :func:`create_app`)."""
    with_userinfo = userinfo_urls(list(urls))
    if with_userinfo:
        raise InvalidArgumentError(f"{what} and a worker URL with user:password@ ({shown_url(with_userinfo[0])}): "
                                   "give one way to authenticate to the workers")


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")


def check_header_name(value: object, what: str = "client_id_header") -> str:
    """``value`` lowercased when it is an HTTP header name (a token of at most 256 characters), as
    the ASGI scope holds it; an :class:`~kvslots.InvalidArgumentError` naming ``what`` otherwise."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a str, got {type(value).__name__}")
    if not _TOKEN.fullmatch(value):
        raise InvalidArgumentError(f"{what} {short_repr(value)} is not an HTTP header name")
    return value.lower()


#: An HTTP field value (RFC 9110: visible characters, obs-text too, blanks only between them).
#: Stricter than h11 (httpx's writer to the workers), which refuses only NUL, CR, LF, \x0b and \x0c
#: in a value: the other control characters (\x01-\x08, \x0e-\x1f, \x7f) are refused here.
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")


def _client_auth(scope: Any) -> dict[str, bytes] | str:
    """The client's ``Authorization`` header, as sent (bytes) but its outer blanks, for the
    workers: {} without one, why it is refused (a 400) when it is given more than once (which one
    would a worker read?) or is no HTTP field value (a control character in it: the value is not
    quoted). uvicorn's httptools parser keeps a value's trailing blanks, which h11 refuses: its
    error, quoting the client's credential, was logged and sent back in a 502."""
    found = [v for k, v in scope["headers"] if k == b"authorization"]
    if len(found) > 1:
        return f"{len(found)} Authorization headers; give one"
    if not found:
        return {}
    value = found[0].strip(b" \t")
    if not _FIELD_VALUE.fullmatch(value):
        return "the Authorization header is not an HTTP field value (a control character in it)"
    return {"authorization": value}


#: Most bytes of the indexer's answer to /score the proxy reads (about 250 a worker), and the most
#: seconds it waits for all of it: past either, round robin.
MAX_INDEXER_ANSWER = 4 * 2**20
INDEXER_TIMEOUT_S = 2.0
#: Most bytes of a prefill worker's answer the proxy reads (one token; prompt logprobs can make it
#: big): past it, or past the timeout, the request is computed on the decode worker.
MAX_PREFILL_ANSWER = 64 * 2**20
#: Most bytes of the first decode worker's answer to ``GET /v1/models`` passed on (a 502 past it).
MAX_MODELS_ANSWER = 16 * 2**20
#: Most bytes of a decode worker's refusal (not a 200) read whole (a 502 past it, or past
#: ``--timeout``). Read whole with httpx's per-read timeouts, an endless answer filled the proxy's
#: memory.
MAX_DECODE_ANSWER = 64 * 2**20
#: A decode worker's answer to a request without a stream is read whole up to this many bytes (and
#: sent whole, a 502 when the worker fails or ``--timeout`` passes first); past it, what was read is
#: sent and the rest passed on as it comes, the worker given ``--timeout`` in all to send it and the
#: client, apart, as long to read it (cut off past either: the client sees the answer unfinished;
#: the worker's counted in ``decode_errors``, the client's in ``slow_clients``). Bounded at 64 MiB,
#: legitimate answers were a 502 (n=8 of 8k tokens with top_logprobs=20 is about 96 MB), and read
#: whole, each took its size in memory.
PASS_ON_AFTER = 2**20


@contextlib.asynccontextmanager
async def _within(seconds: float) -> AsyncIterator[None]:
    """Gives the block ``seconds`` in all: past them an :class:`httpx.ReadTimeout` (httpx's
    timeouts are each read's: an answer trickled a byte a second held a request for ever)."""
    import anyio

    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError:
        raise httpx.ReadTimeout(f"no whole answer within {seconds:g} s") from None


async def _read_most(resp: httpx.Response, most: int) -> bytes:
    """The body of ``resp`` (streamed), of at most ``most`` bytes: an :class:`httpx.ReadError`
    past it, having read no more than a chunk past it."""
    body = bytearray()
    if not await _read_upto(resp.aiter_bytes(), body, most):
        raise httpx.ReadError(f"an answer of more than {most} bytes")
    return bytes(body)


async def _post_read(client: httpx.AsyncClient, url: str, request: dict[str, Any], *, most: int,
                     within: float, method: str = "POST") -> tuple[httpx.Response, bytes]:
    """POSTs ``request`` (:func:`_encoded`) to ``url`` (or sends ``method``): the answer (its
    status and headers; closed) and its body, of at most ``most`` bytes and all of it within
    ``within`` seconds; an :class:`httpx.HTTPError` otherwise, as one without end was read into
    memory whole. The one home of reading a backend's answer whole (:func:`_read_most`, :func:`_within`)."""
    async with _within(within), client.stream(method, url, **request) as resp:
        return resp, await _read_most(resp, most)


async def _answer_object(content: bytes) -> dict[str, Any] | None:
    """A backend's answer as a JSON object (:func:`_json_object`), parsed off the loop when big."""
    return await _off_loop(_json_object, content) if len(content) > OFF_LOOP_BYTES else _json_object(content)


def _listed(items: Any, what: str) -> list[Any]:
    """``items`` (any iterable) as a list; an :class:`ArgumentTypeError` naming ``what`` when it
    is not iterable (an int, None) or reading it fails."""
    if items is None:
        return []  # the emptiness check names what is missing
    try:
        return list(items)
    except Exception as e:
        raise ArgumentTypeError(f"{what} must be a list, got {type(items).__name__}") from e


def _json_object(content: bytes) -> dict[str, Any] | None:
    """A backend's answer as a JSON object (kvslots' strict parser), None when it is not one."""
    try:
        doc = loads_strict_json(content)
    except ConfigError:
        return None
    return doc if isinstance(doc, dict) else None


def _score(workers: Any, name: str | None) -> float:
    """A worker's score in the indexer's answer; 0 for anything but a finite number."""
    value = _readable_score(workers, name)
    return 0.0 if value is None else value


def _readable_score(workers: Any, name: str | None) -> float | None:
    """A worker's score in the indexer's answer when it is a finite number, else None."""
    entry = workers.get(name) if isinstance(workers, dict) else None
    score = entry.get("score") if isinstance(entry, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    try:
        value = float(score)
    except OverflowError:  # an integer past float's range
        return None
    return value if math.isfinite(value) else None


def _token_ids(body: dict[str, Any]) -> list[int] | msgspec.Raw | None:
    """The prompt when it is a non-empty list of integers (token ids), None otherwise; kept as sent
    (:func:`_parse_body`) it is sent as it is."""
    prompt = body.get("prompt")
    if isinstance(prompt, msgspec.Raw):
        # numbers in arrays only, past RAW_VALUE_BYTES (no lone number is as long): token ids when
        # integers only, one array when it has one '[', empty when only brackets and blanks
        text = bytes(prompt)
        if text.translate(None, _INT_ARRAY_BYTES):  # a float, true, false, null
            return None
        return prompt if text.count(b"[") == 1 and text.strip(b"[] \t\r\n") else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


_STREAM = TypeAdapter(bool | None)


def _streams(body: dict[str, Any]) -> bool:
    """Whether the decode worker streams its answer: ``stream`` as vLLM reads it (``bool | None``
    under pydantic's lax rules: "false", "0", "off" are False, "yes" and 1 True; a value it
    refuses is its 400, not streamed). Read by truth, "false" took the stream path for an answer
    vLLM sent whole, unbounded by ``--timeout`` in all."""
    try:
        return _STREAM.validate_python(body.get("stream")) is True
    except ValueError:  # pydantic's ValidationError
        return False


def _why(e: Exception) -> str:
    """What went wrong with a backend request: httpx's timeouts say nothing (str() is ''), and a
    502 "decode worker ... failed: " said nothing either. A request the proxy could not write
    (h11's LocalProtocolError: a header value it refuses) is named, not quoted: its text holds
    the header's value, a client's credential in logs and answers."""
    if isinstance(e, httpx.LocalProtocolError):
        return "the request could not be written (LocalProtocolError)"
    return str(e) or type(e).__name__


def _status_class(status: int) -> str:
    """'4xx', '5xx', ...: a rate-limited log's kind (one per class, not per status)."""
    return f"{status // 100}xx"


def _client_error(status: int) -> bool:
    """A 4xx from the decode worker: the request's fault (vLLM's 400 for a bad max_tokens, a
    prompt over the model's length, an unknown model; 429), so the client gets it as it is, not
    a 502 blaming the worker."""
    return 400 <= status < 500


async def _read_upto(chunks: Any, into: bytearray, most: int) -> bool:
    """Appends the chunks of ``chunks`` (an answer's ``aiter_bytes()``) to ``into`` until they end
    (True) or it holds more than ``most`` bytes (False: a chunk past it at most)."""
    while len(into) <= most:
        try:
            into += await chunks.__anext__()
        except StopAsyncIteration:
            return True
    return False


async def _unless_gone(receive: Any, work: Any) -> Any:
    """What ``work`` (a coroutine) returns, unless the client goes first (``receive``, the
    request's ASGI receive once its body is read, says ``http.disconnect``): then None, ``work``
    cancelled."""
    import anyio

    out: list[Any] = []

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()

    failed: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            out.append(await work)
        except Exception as e:  # raised as it is, not in the task group's ExceptionGroup
            failed.append(e)
        tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return out[0] if out else None


async def _not_encoded(resp: httpx.Response) -> None:
    """httpx's response hook: an answer with a Content-Encoding (the proxy asks for none) is an
    :class:`httpx.DecodingError`, the worker's failure, before a byte of it is decoded."""
    coding = resp.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise httpx.DecodingError(f"an answer with Content-Encoding {short_repr(coding)}, which the proxy does not "
                                  "ask for", request=resp.request)


class _BrokenOff(Exception):
    """A passed-on answer's worker failed, or ``--timeout`` passed, after its head was sent."""


class _Unfinished(StreamingResponse):
    """A StreamingResponse whose body ending in :class:`_BrokenOff` is left unfinished: uvicorn
    closes the connection without the last chunk, so the client knows the answer was cut short
    (an ended one would look whole).

    With ``client_s``, the client has that many seconds in all to take what it is sent: each
    send is bounded by what is left (a client reading nothing blocks it, uvicorn waiting for its
    socket to drain), and past them the answer is cut off and its connection aborted
    (:func:`~kvslots.indexer.httpguard.cut_off`); ``on_slow()`` is called then, or when the
    guard's write stall ended a send (:func:`~kvslots.indexer.httpguard.write_stalled`). Timed after each
    chunk was taken, a client reading nothing held its connection until the guard's write stall
    (60 s), past ``--timeout``, and was not counted."""

    def __init__(self, content: Any, *, client_s: float | None = None, on_slow: Any = None, **kw: Any):
        super().__init__(content, **kw)
        self.client_s = client_s
        self.on_slow = on_slow
        self.scope: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        with contextlib.suppress(_BrokenOff):
            await super().stream_response(send if self.client_s is None else self._timed(send))

    def _timed(self, send: Any) -> Any:
        import anyio

        assert self.client_s is not None  # _timed is used only with a client time
        left = self.client_s

        async def timed(message: Any) -> None:
            nonlocal left
            start = anyio.current_time()
            try:
                with anyio.fail_after(max(left, 0)):
                    await send(message)
            except TimeoutError:
                left = 0.0
            else:
                left -= anyio.current_time() - start
            # The guard's write stall (READ_TIMEOUT_S, before --timeout) ends a send the client
            # takes nothing of as if it were sent: the rest was read from the worker for nobody.
            stalled = self.scope is not None and write_stalled(self.scope)
            if left <= 0 or stalled:
                if self.on_slow is not None:
                    self.on_slow()
                if self.scope is not None:
                    cut_off(self.scope)
                raise _BrokenOff

        return timed


#: The routes whose requests take backend connections, counted per client (:class:`_PerClient`).
_PROXIED = frozenset({"/v1/completions", "/v1/chat/completions"})


class _PerClient:
    """ASGI middleware: at most ``most`` proxied requests (:data:`_PROXIED`) from one client
    address in flight at once, from their head to their answer's last byte; one more is a 429
    with ``Retry-After: 1`` before its body is read. Without it one client opening many
    connections held every backend connection (``--backend-connections``) and every other
    client's request waited behind its requests, up to ``--timeout``.

    With ``id_header`` (``--client-id-header``, a lowercase header name), a request's client is
    the last item of that header's last line (a load balancer appends its client's address to
    ``X-Forwarded-For``: the items before it are the client's own), the address when it has none:
    behind a load balancer every client has its address. Only a trusted load balancer may set it;
    a client reaching the proxy directly names itself anew in each request. Keys are kept only
    while their requests are in flight (at most one a connection) and hashed (16 bytes), so any
    number of names takes no more memory than the connections do."""

    def __init__(self, app: Any, most: int, id_header: bytes | None = None):
        self.app = app
        self.most = most
        self.id_header = id_header
        #: Requests in flight per client (all on the event loop: no lock); none at 0.
        self.in_flight: dict[Any, int] = {}

    def _who(self, scope: Any) -> Any:
        if self.id_header is not None:
            named = [v for k, v in scope["headers"] if k == self.id_header]
            if named:
                item = named[-1].rpartition(b",")[2].strip(b" \t")
                if item:
                    import hashlib

                    return hashlib.blake2b(item, digest_size=16).digest()  # bytes: never an address (str)
        return (scope.get("client") or (None,))[0]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in _PROXIED:
            return await self.app(scope, receive, send)
        who = self._who(scope)
        n = self.in_flight.get(who, 0)
        if n >= self.most:
            body = json.dumps({"error": f"this client has {n} requests in flight, the most one client may have "
                                        "at once (--max-requests-per-client); retry later"}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight[who] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[who] - 1
            if left:
                self.in_flight[who] = left
            else:
                del self.in_flight[who]


#: The kinds of indexer answers that leave the pick to round robin, counted in /healthz's
#: ``indexer_errors``: no answer (refused, past its 2 s, too big), a status but 2xx, no JSON object,
#: no ``workers`` object in it, a scored worker's score that is not a finite number, a scored
#: worker it does not name (it names every worker it has: the names differ). Only an answer whose
#: scores were all read and none is above 0 (nothing cached) is round robin uncounted.
INDEXER_ERROR_KINDS = ("no_answer", "status", "no_object", "no_workers", "bad_score", "unknown_worker")

#: The kinds of prefill failures counted in /healthz's ``prefill_errors``: no answer (refused, reset,
#: past --timeout, too big), a 4xx (a 401 or 403 to the client's credential is the client's answer), a
#: 5xx, another status but 200, a 200 without a JSON object.
PREFILL_ERROR_KINDS = ("no_answer", "4xx", "5xx", "other_status", "no_object")

#: Longest delay in seconds of a worker's Retry-After passed on (a day); a longer one is passed on as this.
MAX_RETRY_AFTER_S = 86400


_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MONTH = r"(?P<month>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_TIME = r"(?P<hour>\d\d):(?P<minute>\d\d):(?P<second>\d\d)"
#: RFC 9110's three HTTP-date forms, and only them (email.utils took '1 Jan 2030 00:00', a zone
#: but GMT, a two-digit year in the IMF form): IMF-fixdate, the obsolete RFC 850 and asctime forms.
_HTTP_DATES = tuple(re.compile(p, re.ASCII) for p in (
    rf"{_DAY}, (?P<day>\d\d) {_MONTH} (?P<year>\d{{4}}) {_TIME} GMT",
    r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), "
    rf"(?P<day>\d\d)-{_MONTH}-(?P<year>\d\d) {_TIME} GMT",
    rf"{_DAY} {_MONTH} (?P<day>[ \d]\d) {_TIME} (?P<year>\d{{4}})",
))
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _http_date(value: str, now: Any) -> Any:
    """``value`` as an aware UTC datetime when it is an HTTP-date (:data:`_HTTP_DATES`), else None;
    a two-digit year (RFC 850) is the latest one not more than 50 years after ``now`` (RFC 9110)."""
    from datetime import datetime, timezone

    m = next((m for m in (p.fullmatch(value) for p in _HTTP_DATES) if m), None)
    if m is None:
        return None
    year = int(m["year"])
    if len(m["year"]) == 2:
        year += now.year - now.year % 100
        if year > now.year + 50:
            year -= 100
    try:  # second 60: a leap second (RFC 9110), which datetime has not
        return datetime(year, _MONTHS.index(m["month"]) + 1, int(m["day"]), int(m["hour"]), int(m["minute"]),
                        min(int(m["second"]), 59), tzinfo=timezone.utc)
    except ValueError:  # 31 Feb, hour 24, year 0
        return None


def _retry_after(resp: httpx.Response) -> dict[str, str]:
    """The worker's ``Retry-After`` (its 429's or 503's: how long it asks clients to wait) as a
    header for the client, when it is one valid value: delay-seconds, or an HTTP-date
    (:func:`_http_date`) as the delay-seconds to it from the worker's own ``Date`` when it has one
    valid Date, else from the proxy's clock (0 when past), at most :data:`MAX_RETRY_AFTER_S`,
    written anew (the proxy's own text, never the worker's bytes); none otherwise (absent, given
    twice, or anything else). A date was passed on as a date, past the cap (year 9999); measured
    on the proxy's clock alone, a worker 60 s slow asking for 30 s was passed on as 0."""
    from datetime import datetime, timezone

    values = resp.headers.get_list("retry-after")
    if len(values) != 1:
        return {}
    value = values[0].strip(" \t")  # HTTP's blanks only: str.strip() takes \x0b, \x1c, ...
    if value.isascii() and value.isdigit():
        return {"retry-after": str(min(int(value), MAX_RETRY_AFTER_S) if len(value) <= 12 else MAX_RETRY_AFTER_S)}
    if len(value) > 64 or not value.isascii():
        return {}
    now = datetime.now(timezone.utc)
    dates = resp.headers.get_list("date")
    worker_now = _http_date(dates[0].strip(" \t"), now) if len(dates) == 1 and len(dates[0]) <= 64 else None
    when = _http_date(value, worker_now or now)
    if when is None:
        return {}
    delay = (when - (worker_now or now)).total_seconds()
    return {"retry-after": str(min(max(math.ceil(delay), 0), MAX_RETRY_AFTER_S))}


_MEDIA_TYPE = re.compile(rb"[\x20-\x7e]{1,256}")


def _media_type(resp: httpx.Response, default: str) -> str:
    """The worker's Content-Type for the client when it is one of printable ASCII (at most 256
    bytes), else ``default``: httpx decodes a header as UTF-8 when it can, and one past Latin-1
    (a worker's 'text/plain; x=\u4e2d') failed Starlette's encoding of it, a 500 in plain text (the
    worker's connection left open) instead of its answer."""
    values = [v for k, v in resp.headers.raw if k.lower() == b"content-type"]
    if len(values) == 1 and _MEDIA_TYPE.fullmatch(values[0].strip(b" \t")):
        return values[0].strip(b" \t").decode("ascii")
    return default


def _passed_on(resp: httpx.Response, content: bytes, headers: dict[str, str]) -> Response:
    return Response(content, status_code=resp.status_code,
                    media_type=_media_type(resp, "application/json"),
                    headers={**headers, **_retry_after(resp)})


def create_app(prefill_urls: Sequence[str], decode_workers: Sequence[DecodeWorker], *, indexer_url: str | None = None,
               timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
               max_body_mb: int = DEFAULT_MAX_BODY_MB, backend_connections: int = BACKEND_CONNECTIONS,
               max_requests_per_client: int | None = None, backend_api_key: str | None = None,
               client_id_header: str | None = None) -> FastAPI:
    """The proxy app. ``transport`` replaces the network (tests). A request body over
    ``max_body_mb`` MiB is a 413 before it is read whole. At most ``backend_connections``
    connections to the prefill and decode workers are open at once (a request finding them all in
    use waits for one, up to ``timeout_s``), and :data:`SIDE_CONNECTIONS` more for the indexer and
    ``GET /v1/models``. One client address may have at most ``max_requests_per_client``
    completions in flight at once (a 429 past it; None:
    :func:`~kvslots.proxy.cli.default_requests_per_client`, 0: no limit); with
    ``client_id_header``, one client is one value of that header (:class:`_PerClient`).

    The prefill and decode workers get the client's ``Authorization`` header (each leg, and
    ``GET /v1/models``), as a reverse proxy passes it (llm-d's routing sidecar), so workers
    started with vLLM's ``--api-key`` check the client's key; with ``backend_api_key`` they get
    ``Authorization: Bearer KEY`` instead (vLLM's disaggregated proxy examples), the client's not
    sent. The indexer gets neither. A worker URL's ``user:password@`` is sent to that worker as
    Basic auth in place of the client's header (the operator's setting wins); it and
    ``backend_api_key`` together are an :class:`~kvslots.InvalidArgumentError`."""
    if isinstance(prefill_urls, str):  # its characters would be the URLs
        raise ArgumentTypeError("prefill_urls must be a list of URLs, got a str")
    # Read once, as lists: an iterator was consumed by the checks below (every request then
    # found no decode worker: a 500), and an empty one passed the emptiness check.
    prefill_urls = _listed(prefill_urls, "prefill_urls")
    decode_workers = _listed(decode_workers, "decode_workers")
    if not prefill_urls or not decode_workers:
        raise InvalidArgumentError("the proxy needs at least one prefill and one decode worker")
    if isinstance(max_body_mb, bool) or not isinstance(max_body_mb, int) or not 0 < max_body_mb <= 65536:
        raise InvalidArgumentError(f"max_body_mb {max_body_mb!r} must be an integer in 1..65536")
    if (isinstance(backend_connections, bool) or not isinstance(backend_connections, int)
            or not 0 < backend_connections <= MAX_BACKEND_CONNECTIONS):
        raise InvalidArgumentError(f"backend_connections {short_repr(backend_connections)} must be an integer in "
                                   f"1..{MAX_BACKEND_CONNECTIONS}")
    if max_requests_per_client is None:
        max_requests_per_client = default_requests_per_client(backend_connections)
    requests_per_client(max_requests_per_client, "max_requests_per_client")
    prefill_urls = [http_url(u, "prefill URL") for u in prefill_urls]
    seconds(timeout_s, "timeout_s")
    if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
        raise ArgumentTypeError(f"transport must be an httpx.AsyncBaseTransport, got {type(transport).__name__}")
    for w in decode_workers:
        if not isinstance(w, DecodeWorker):
            raise ArgumentTypeError(f"decode_workers must hold DecodeWorker objects, got {type(w).__name__}")
        http_url(w.url, "decode URL")
        if w.indexer_name is not None:
            try:
                check_worker_name(w.indexer_name)
            except ConfigError as e:
                raise InvalidArgumentError(f"decode worker {shown_url(w.url)}: {e}") from None
    check_unique_names(decode_workers)
    if indexer_url is not None:
        http_url(indexer_url, "indexer URL")
    if backend_api_key is not None:
        backend_api_key = check_api_key(backend_api_key)
        check_one_credential([*prefill_urls, *(w.url for w in decode_workers)])
    id_header = None if client_id_header is None else check_header_name(client_id_header).encode()
    prefill_userinfo = frozenset(userinfo_urls(prefill_urls))  # the proxy's credential, not the client's
    # What backends and clients can make the proxy log (a failure, a client gone), at most
    # _ratelog.BURST lines a minute per backend (or the clients) and kind: a dead backend under
    # 1,000 requests a second wrote 1,000 lines a second. Keys are (role, URL, kind): one URL
    # given as a prefill and a decode worker shared an allowance, one role's lines hiding the other's.
    logs = RateLimitedLog(logger)
    prefill_cycle = itertools.cycle(list(prefill_urls))
    decode_cycle = itertools.cycle(list(decode_workers))
    # prefill_errors and indexer_errors: what the rate-limited log leaves out is counted where an
    # operator looks (a count of lines left out was logged only when the same kind failed again).
    state: dict[str, Any] = {"recomputed": 0, "disaggregated": 0, "decode_errors": 0, "gone_before_decode": 0,
                             "gone_in_decode": 0, "slow_clients": 0,
                             "indexer_errors": dict.fromkeys(INDEXER_ERROR_KINDS, 0),
                             "prefill_errors": dict.fromkeys(PREFILL_ERROR_KINDS, 0)}
    prefill_errors, indexer_errors = state["prefill_errors"], state["indexer_errors"]
    # max_keepalive_connections=20 (httpx's default), not the pool's size: httpcore's pool walks
    # every connection for each waiting request and hands idle ones to requests that wake slowly
    # (150 requests held at once by one worker took 6.9 s to reach it with all kept, 1.0-1.7 s
    # with 20). httpcore 1.0 closes an idle connection whenever the pool holds more than 20 in
    # all, so past 20 open a connection is rarely reused (256 clients: ~1 new connection per
    # request); still the fastest of the settings measured (9.3-9.6 s against 44-46 s for 2,048
    # requests at concurrency 256). A pool with real keep-alive is left out.
    # Answers are asked for and taken unencoded (_not_encoded): httpx asked for gzip and deflate
    # and decoded what came without a bound, 64 KiB read at a time up to 66 MB (deflate's ratio),
    # so a worker's 0.5 MB gzip answer grew the proxy by 315 MB.
    identity = {"accept-encoding": "identity"}
    # The workers' key, when given, is in their clients' headers (not the indexer's, side).
    keyed = {**identity, "authorization": f"Bearer {backend_api_key}"} if backend_api_key else identity
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                               limits=httpx.Limits(max_connections=backend_connections, max_keepalive_connections=20),
                               headers=keyed, event_hooks={"response": [_not_encoded]})
    side, models_side = (httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                                           limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                                           headers=h, event_hooks={"response": [_not_encoded]})
                         for n, h in ((SCORE_CONNECTIONS, identity), (MODELS_CONNECTIONS, keyed)))

    def worker_auth(scope: Any) -> dict[str, bytes] | str:
        """The headers a request's worker legs add (:func:`_client_auth`): none with the workers' key."""
        return {} if backend_api_key else _client_auth(scope)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()
        await side.aclose()
        await models_side.aclose()

    # redirect_slashes off: /v1/completions/ was a 307 with an empty body, a 404 as any unknown path.
    app = FastAPI(title="kvslots proxy", summary="OpenAI-compatible front door for disaggregated prefill/decode",
                  lifespan=lifespan, redirect_slashes=False)
    app.add_middleware(BodyLimit, max_bytes=max_body_mb * 2**20, key="error",
                       budget_bytes=max(BODY_BUDGET_BYTES, 4 * max_body_mb * 2**20))
    if max_requests_per_client:  # outside BodyLimit: refused before a byte of its body is read
        app.add_middleware(_PerClient, most=max_requests_per_client, id_header=id_header)

    async def pick_decode(body: dict[str, Any], big: bool) -> DecodeWorker:
        ids = await _off_loop(_token_ids, body) if big else _token_ids(body)  # a walk over every item
        scored = [w for w in decode_workers if w.indexer_name]
        if indexer_url and ids and scored:
            try:
                resp, content = await _post_read(side, f"{indexer_url.rstrip('/')}/score",
                                                 await _encoded({"token_ids": ids}, big), most=MAX_INDEXER_ANSWER,
                                                 within=INDEXER_TIMEOUT_S)
            except httpx.HTTPError as e:
                indexer_failed("no_answer", "unusable (%s)", _why(e))
            else:
                answer = await _answer_object(content) if 200 <= resp.status_code < 300 else None
                workers = answer.get("workers") if answer is not None else None
                if not 200 <= resp.status_code < 300:
                    indexer_failed("status", "unusable (it answered %d)", resp.status_code)
                elif answer is None:
                    indexer_failed("no_object", "answered no JSON object")
                elif not isinstance(workers, dict):
                    indexer_failed("no_workers", "answered no 'workers' object")
                else:
                    best = max(scored, key=lambda w: _score(workers, w.indexer_name))
                    if _score(workers, best.indexer_name) > 0:
                        return best
                    # Round robin: counted unless every score was read (none above 0: nothing cached)
                    unknown = [w.indexer_name for w in scored if w.indexer_name not in workers]
                    unread = [w.indexer_name for w in scored
                              if w.indexer_name in workers and _readable_score(workers, w.indexer_name) is None]
                    if unread:
                        indexer_failed("bad_score", "answered a score that is not a finite number for worker %r",
                                       unread[0])
                    elif unknown:
                        indexer_failed("unknown_worker", "does not name worker %r (is it another name there?)",
                                       unknown[0])
        return next(decode_cycle)

    def indexer_failed(kind: str, what: str, *args: Any) -> None:
        indexer_errors[kind] += 1
        logs.log(WARNING, ("indexer", kind), f"kvslots proxy: indexer %s {what}; round robin",
                 shown_url(indexer_url or ""), *args)  # (only called with one)

    def decode_failed(worker: DecodeWorker, what: str, resp: httpx.Response | None = None) -> JSONResponse:
        state["decode_errors"] += 1
        # %r: the worker's text in it is on one line (a newline in it wrote a line of the worker's choosing)
        logs.log(WARNING, ("decode", worker.url, _status_class(resp.status_code) if resp is not None else "failed"),
                 "kvslots proxy: decode worker %s: %r", shown_url(worker.url), what)
        # A worker's 503 with Retry-After (overloaded, draining) keeps it: clients (the OpenAI SDK
        # too) wait that long before trying again instead of their own backoff.
        return JSONResponse({"error": f"decode worker {shown_url(worker.url)} {what}"}, status_code=502,
                            headers=_retry_after(resp) if resp is not None else None)

    async def prefill_and_pick(path: str, body: dict[str, Any], big: bool, auth: dict[str, bytes]
                               ) -> tuple[dict[str, Any], DecodeWorker, dict[str, str]] | Response:
        """The prefill (its ``kv_transfer_params`` go into the decode request), then the decode
        worker: the decode request, its worker and the answer's headers; or the prefill worker's
        401 or 403 when the client's credential (or none) was sent, the client's answer as it is
        (the client is not let in: computed on the decode worker, an unauthenticated request
        reached the indexer and the decode worker)."""
        prefill_url = next(prefill_cycle)
        params = None
        try:
            resp, content = await _post_read(client, f"{prefill_url.rstrip('/')}{path}",
                                             await _encoded(prefill_body(body), big, auth), most=MAX_PREFILL_ANSWER,
                                             within=timeout_s)
        except httpx.HTTPError as e:
            prefill_errors["no_answer"] += 1
            logs.log(WARNING, ("prefill", prefill_url, "failed"), "kvslots proxy: prefill worker %s failed: %s",
                     shown_url(prefill_url), _why(e))
        else:
            status = resp.status_code
            if status != 200:
                prefill_errors[_status_class(status) if 400 <= status < 600 else "other_status"] += 1
            if status in (401, 403) and not (backend_api_key or prefill_url in prefill_userinfo):
                logs.log(DEBUG, ("prefill", prefill_url, "client auth"), "kvslots proxy: prefill worker %s answered %d",
                         shown_url(prefill_url), status)
                return _passed_on(resp, content, {})
            answer = await _answer_object(content) if status == 200 else None
            if status in (401, 403):
                # The credential was the proxy's (--backend-api-key, the URL's user:password), not
                # the client's: the operator's mistake, which every client was answered with while
                # the decode worker would have served them. Recomputed, as for any failed prefill.
                logs.log(WARNING, ("prefill", prefill_url, "4xx"),
                         "kvslots proxy: prefill worker %s refused the proxy's credential (%s): answered %d; "
                         "recomputed on the decode worker", shown_url(prefill_url),
                         "--backend-api-key" if backend_api_key else "the URL's user:password", status)
            elif answer is not None:
                params = answer.get("kv_transfer_params")
            elif status == 200:  # an array, a string, not JSON: recomputed on the decode worker
                prefill_errors["no_object"] += 1
                logs.log(WARNING, ("prefill", prefill_url, "no object"),
                         "kvslots proxy: prefill worker %s answered 200 without a JSON object: %r",
                         shown_url(prefill_url), content[:300])
            else:
                # Keyed on the status class: a flood of clients' bad requests (a 4xx) hid the worker's
                # own 500s. A 4xx is a WARNING too: it is often the prefill worker's setting (another
                # model name: 404, a smaller max_model_len) while the decode worker serves the
                # request, and P/D was off with nothing logged at INFO.
                logs.log(WARNING, ("prefill", prefill_url, _status_class(status)),
                         "kvslots proxy: prefill worker %s answered %d: %r", shown_url(prefill_url), status,
                         content[:300].decode(errors="replace"))
        decode_req = dict(body)
        headers = {}
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            decode_req["kv_transfer_params"] = params
            headers["x-kvslots-pd"] = "disaggregated"
        else:
            decode_req.pop("kv_transfer_params", None)
            headers["x-kvslots-pd"] = "recomputed"
        worker = await pick_decode(body, big)
        headers["x-kvslots-decode-worker"] = shown_url(worker.url)
        return decode_req, worker, headers

    async def forward(request: Request, path: str, body: dict[str, Any], big: bool, auth: dict[str, bytes]
                      ) -> Response:
        # The client may go while its prompt is prefilled (or its decode worker picked): the
        # prefill request is then cancelled (its connection closed: vLLM aborts it) and no decode
        # is started. It was started anyway, its answer written to nobody.
        picked = await _unless_gone(request.receive, prefill_and_pick(path, body, big, auth))
        if picked is None:
            state["gone_before_decode"] += 1
            logs.log(INFO, ("client", "gone"), "kvslots proxy: a client went while its prompt was prefilled; "
                     "no decode started")
            return Response(status_code=499)  # (written to nobody)
        if isinstance(picked, Response):
            return picked
        decode_req, worker, headers = picked
        state["disaggregated" if headers["x-kvslots-pd"] == "disaggregated" else "recomputed"] += 1
        url = f"{worker.url.rstrip('/')}{path}"
        if _streams(body):
            # Watched as the prefill is: a client gone before the decode worker's head came (queued
            # in vLLM) kept its decode running, and its place (--max-requests-per-client), till then.
            try:
                resp = await _unless_gone(request.receive, client.send(
                    client.build_request("POST", url, **await _encoded(decode_req, big, auth)), stream=True))
            except httpx.HTTPError as e:
                return decode_failed(worker, f"failed: {_why(e)}")
            if resp is None:
                state["gone_in_decode"] += 1
                logs.log(INFO, ("client", "gone"), "kvslots proxy: a client went before its decode worker answered; "
                         "decode request ended")
                return Response(status_code=499)  # (written to nobody)
            if resp.status_code != 200:
                try:
                    async with _within(timeout_s):
                        content = await _read_most(resp, MAX_DECODE_ANSWER)
                except httpx.HTTPError as e:
                    # The worker failed, as without a stream (its 4xx went to the client with
                    # "(body unreadable: ...)" as an application/json body).
                    return decode_failed(worker, f"failed: {_why(e)}")
                finally:
                    await resp.aclose()
                if _client_error(resp.status_code):
                    return _passed_on(resp, content, headers)
                return decode_failed(worker, f"answered {resp.status_code}: {content.decode(errors='replace')[:500]}",
                                     resp)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_bytes():  # unencoded: asked for, others refused (_not_encoded)
                        yield chunk
                except httpx.HTTPError as e:  # the status is sent already: log why, leave the stream unfinished
                    state["decode_errors"] += 1
                    logs.log(WARNING, ("decode", worker.url, "broke off"), "kvslots proxy: decode worker %s broke "
                             "off the stream: %s", shown_url(worker.url), _why(e))
                    # Ended, a stream cut short (a worker's reset, its answer shorter than its
                    # Content-Length) looked whole to the client, as a passed-on answer would.
                    raise _BrokenOff from None
                finally:
                    await resp.aclose()

            return _Unfinished(chunks(), media_type=_media_type(resp, "text/event-stream"), headers=headers)
        return await pass_on(request.receive, worker, url, decode_req, big, headers, auth)

    async def pass_on(receive: Any, worker: DecodeWorker, url: str, decode_req: dict[str, Any], big: bool,
                      headers: dict[str, str], auth: dict[str, bytes]) -> Response:
        """The decode worker's answer to a request without a stream: whole when it is at most
        :data:`PASS_ON_AFTER` bytes, else passed on as it comes (:data:`PASS_ON_AFTER`)."""
        import anyio

        deadline = anyio.current_time() + timeout_s
        resp = None
        content = bytearray()

        async def first() -> tuple[httpx.Response, Any, bool]:
            nonlocal resp
            async with _within(timeout_s):
                resp = await client.send(client.build_request("POST", url, **await _encoded(decode_req, big, auth)),
                                         stream=True)
                chunks = resp.aiter_bytes()
                whole = await _read_upto(chunks, content, PASS_ON_AFTER if resp.status_code == 200 else
                                         MAX_DECODE_ANSWER)
            return resp, chunks, whole

        try:
            # A client gone before a byte of its answer is written (httpguard.probe_eof) ends the
            # decode request: it ran to its end, for nobody.
            got = await _unless_gone(receive, first())
            if got is None:
                if resp is not None:
                    await resp.aclose()
                state["gone_in_decode"] += 1
                logs.log(INFO, ("client", "gone"), "kvslots proxy: a client went while its answer was decoded; "
                         "decode request ended")
                return Response(status_code=499)  # (written to nobody)
            resp, chunks, whole = got
            if not whole and resp.status_code != 200:
                raise httpx.ReadError(f"an answer of more than {MAX_DECODE_ANSWER} bytes")
        except httpx.HTTPError as e:
            if resp is not None:
                await resp.aclose()
            return decode_failed(worker, f"failed: {_why(e)}")
        if whole:
            await resp.aclose()
            if _client_error(resp.status_code):
                return _passed_on(resp, bytes(content), headers)
            if resp.status_code != 200:
                return decode_failed(worker, f"answered {resp.status_code}: "
                                             f"{content[:2000].decode(errors='replace')[:500]}", resp)
            return Response(bytes(content), media_type="application/json", headers=headers)

        async def rest() -> AsyncIterator[bytes]:
            # --timeout bounds the worker's time (waiting for its bytes) and, apart, the client's
            # (taking what was read: _Unfinished's client_s): one clock for both blamed the worker
            # for a client slow to read (counted in decode_errors, "the worker broke off its answer").
            worker_left = deadline - anyio.current_time()
            try:
                yield bytes(content)
                content.clear()
                while True:
                    asked = anyio.current_time()
                    try:
                        with anyio.fail_after(max(worker_left, 0)):
                            chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        return
                    worker_left -= anyio.current_time() - asked
                    yield chunk
            except (httpx.HTTPError, TimeoutError) as e:
                state["decode_errors"] += 1
                why = f"no whole answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else _why(e)
                logs.log(WARNING, ("decode", worker.url, "broke off"),
                         "kvslots proxy: decode worker %s broke off its answer: %s", shown_url(worker.url), why)
                raise _BrokenOff from None
            finally:
                await resp.aclose()

        def slow() -> None:
            state["slow_clients"] += 1
            logs.log(WARNING, ("decode", worker.url, "slow client"), "kvslots proxy: a client took more than %g s to "
                     "read the answer of decode worker %s; cut off", timeout_s, shown_url(worker.url))

        return _Unfinished(rest(), media_type="application/json", headers=headers, client_s=timeout_s,
                           on_slow=slow)

    async def read_body(request: Request) -> tuple[dict[str, Any], bool, dict[str, bytes]] | JSONResponse:
        """The request's JSON object, whether it is big (checked, parsed and encoded off the loop),
        and the headers its worker legs add (:func:`worker_auth`)."""
        auth = worker_auth(request.scope)
        if isinstance(auth, str):
            return JSONResponse({"error": auth}, status_code=400)
        raw = await request.body()
        big = len(raw) > OFF_LOOP_BYTES
        doc = await _off_loop(_request_doc, raw) if big else _request_doc(raw)
        if not isinstance(doc, dict):
            return JSONResponse({"error": doc}, status_code=400)
        if _streams(doc):  # a client that closes (or half-closes) has gone: its backend requests end
            eof_is_disconnect(request.scope)
        else:  # a closed client is told from a half-closed one (answered) by a 100 Continue
            probe_eof(request.scope)
        return doc, big, auth

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        return body if isinstance(body, Response) else await forward(request, "/v1/completions", *body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_body(request)
        return body if isinstance(body, Response) else await forward(request, "/v1/chat/completions", *body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = worker_auth(request.scope)
        if isinstance(auth, str):
            return JSONResponse({"error": auth}, status_code=400)
        try:
            resp, content = await _post_read(models_side, f"{decode_workers[0].url.rstrip('/')}/v1/models",
                                             {"headers": auth}, most=MAX_MODELS_ANSWER, within=timeout_s,
                                             method="GET")
        except httpx.HTTPError as e:
            return JSONResponse({"error": f"decode worker failed: {_why(e)}"}, status_code=502)
        status = resp.status_code
        if status >= 500 or status < 200:  # the worker's failure, as for completions
            return JSONResponse({"error": f"decode worker {shown_url(decode_workers[0].url)} answered "
                                          f"{status}: {content[:500].decode(errors='replace')}"}, status_code=502)
        return Response(content, status_code=status, media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"prefill": [shown_url(u) for u in prefill_urls], "decode": [shown_url(w.url) for w in decode_workers],
                **state}

    return app
