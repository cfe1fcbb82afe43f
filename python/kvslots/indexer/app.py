"""HTTP API of ``kvslots indexer`` (FastAPI; OpenAPI at ``/docs`` and ``/openapi.json``)."""


import contextlib
import functools
import hmac
import json
import logging
import re
from collections.abc import MutableMapping
from typing import Annotated, Any, Callable

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from ..config.loader import brief, loads_strict_json
from ..errors import InvalidArgumentError, OutOfDescriptorsError
from .config import ConfigError, WorkerSpec
from .fds import out_of_fds_message
from .httpguard import BodyLimit, json_shape_error
from .service import IndexerService, _out_of_fds

log = logging.getLogger("kvslots.indexer")

U32 = 2**32 - 1
#: Most validation errors listed in a 422 (the rest are counted).
MAX_ERRORS = 20
U64 = 2**64 - 1


def _utf8(value: str) -> str:
    """Refuses strings that cannot be UTF-8 (a lone surrogate from a JSON \\ud800 escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


# Strict JSON types: "1", true and 2.0 are not token ids; a string must be encodable.
TokenId = Annotated[int, Field(strict=True, ge=0, le=U32)]


def _few_errors(value: Any, handler: Callable[[Any], Any]) -> Any:
    """A list's items validated, each bad one an error of its own while there are at most
    :data:`MAX_ERRORS`; past that one error that counts them. Building the errors cost more than
    anything else: 262,144 bad token ids took 15 s to refuse (a good request of that size: 1 s),
    almost all of it turning them into dicts."""
    try:
        return handler(value)
    except ValidationError as e:
        n = e.error_count()
        if n <= MAX_ERRORS or not isinstance(value, list):
            raise
        first = next((i for i, t in enumerate(value) if type(t) is not int or not 0 <= t <= U32), None)
        where = "" if first is None else f", the first at index {first}"
        raise PydanticCustomError("too_many_errors", "{n} items are not integers in [0, 2**32){where}",
                                  {"n": n, "where": where}) from None


def _few_unknown_fields(model: type[BaseModel], data: Any) -> Any:
    """As extra="forbid" does, but past :data:`MAX_ERRORS` unknown fields one error that counts
    them (an error each was seconds of work for a body of 200,000 of them)."""
    if isinstance(data, dict) and len(data) > MAX_ERRORS:
        unknown = [k for k in data if k not in model.model_fields]
        if len(unknown) > MAX_ERRORS:
            raise PydanticCustomError("too_many_errors", "{n} unknown fields", {"n": len(unknown)})
    return data
Text = Annotated[str, Field(strict=True), AfterValidator(_utf8)]


def _strict_json(body: bytes) -> Any:
    """The request body under kvslots' strict JSON rules (:func:`kvslots.config.loader.
    loads_strict_json`); FastAPI turns the JSONDecodeError raised otherwise into a 422."""
    try:
        return loads_strict_json(body)
    except ConfigError as e:
        raise json.JSONDecodeError(e.reason, "", 0) from None


#: Most bytes of request bodies read or handled at once (:class:`~.httpguard.BodyLimit`): each
#: was bounded (``max_body_bytes``), their number only by the connection cap.
BODY_BUDGET_BYTES = 64 * 2**20
#: Bodies past this size are parsed in a worker thread: on the event loop, a 2 MB body of 200,000
#: keys, one repeated at the end, held every other request (/healthz too) for 2.5 s.
OFF_LOOP_BYTES = 256 * 1024
#: Bodies past this size are refused unparsed when they hold more arrays and objects, or items,
#: than the route's body model allows (:func:`kvslots.indexer.httpguard.json_shape_error`).
SHAPE_CHECK_BYTES = 64 * 1024


def _most(schema: dict[str, Any], defs: dict[str, Any]) -> tuple[int, int, int] | None:
    """The most arrays and objects, strings (keys included), and array items and object members
    a document valid under the JSON Schema ``schema`` holds; None when it has no bound (an array
    without maxItems, an object open to other keys, a value of any type)."""
    if "$ref" in schema:
        return _most(defs.get(schema["$ref"].rpartition("/")[2], {}), defs)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        each = [_most(o, defs) for o in options]
        return None if None in each else tuple(max(x) for x in zip(*each))  # type: ignore[return-value]
    kind = schema.get("type")
    if kind == "object":
        if schema.get("additionalProperties", True) is not False:
            return None
        each = [_most(v, defs) for v in schema.get("properties", {}).values()]
        known = [e for e in each if e is not None]
        if len(known) < len(each):
            return None
        return 1 + sum(e[0] for e in known), sum(1 + e[1] for e in known), len(known) + sum(e[2] for e in known)
    if kind == "array":
        item = _most(schema.get("items", {}), defs)
        n = schema.get("maxItems")
        if item is None or n is None:
            return None
        return 1 + n * item[0], n * item[1], n + n * item[2]
    if kind == "string":
        return 0, 1, 0
    if kind in ("integer", "number", "boolean", "null"):
        return 0, 0, 0
    return None


def _body_bounds(route: APIRoute) -> tuple[int, int, int] | None:
    """What the route's body model lets a body hold (:func:`_most`): the model is the one home
    of the route's body rule, the bounds follow from it."""
    if route.body_field is None:
        return None
    from pydantic import TypeAdapter

    annotation: Any = route.body_field.field_info.annotation
    schema = TypeAdapter(annotation).json_schema()
    return _most(schema, schema.get("$defs", {}))


class _StrictJSONRequest(Request):
    #: The most arrays and objects, strings, and items the route's body may hold (None: no bound).
    bounds: tuple[int, int, int] | None = None
    #: /score: token ids past this many are dropped before parsing (:func:`_first_ids`)
    keep_ids: int | None = None
    #: /score: the bounds past the model's item bound (the byte cap's items; strings counted)
    wide_bounds: tuple[int, int, int] | None = None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if self.keep_ids is not None:  # a pass or a few over the bytes: off the loop when big
                body = await anyio.to_thread.run_sync(_first_ids, body, self.keep_ids, self.scope,
                                                      limiter=self.app.state.parse_threads) \
                    if len(body) > OFF_LOOP_BYTES else _first_ids(body, self.keep_ids, self.scope)
            # Before any parser builds it: a 3 MB body of a million empty arrays held every other
            # request for 0.5 s (1 s to refuse), off the event loop too (the parser holds the GIL);
            # one of a million nulls, twice as long as the largest good one. A small body costs
            # little to parse: the model's errors say more.
            if self.bounds is not None and len(body) > SHAPE_CHECK_BYTES:
                why = json_shape_error(body, *self.bounds)
                # (Not when arrays and objects were past the bound, which is the same in the wide
                # bounds: a second pass over a hostile 3 MB body of a million [] doubled how long
                # it held the GIL, /healthz 0.06-0.11 s instead of 0.04-0.06.)
                if why is not None and self.wide_bounds is not None and "arrays and objects" not in why \
                        and "'[' and '{'" not in why:
                    # /score past the model's item bound: a prompt past --max-tokens, cut after
                    # parsing where the bytes cannot be cut. Its strings are counted on their own
                    # (at most the model's), so 300,000 unknown keys are still refused unparsed.
                    why = json_shape_error(body, *self.wide_bounds, strings_alone=True)
                if why is not None:
                    raise json.JSONDecodeError(f"the body has {why}", "", 0)
            # In threads of their own: many at once would take the pool's every thread, where
            # /healthz and /score run.
            parse = _strict_json if self.keep_ids is None else functools.partial(
                _parse_first_ids, keep=self.keep_ids, scope=self.scope)
            self._json = await anyio.to_thread.run_sync(parse, body, limiter=self.app.state.parse_threads) \
                if len(body) > OFF_LOOP_BYTES else parse(body)
        return self._json


class _StrictJSONRoute(APIRoute):
    """Parses request bodies with :func:`_strict_json` (FastAPI's documented custom-route hook)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        bounds = _body_bounds(self)
        keep_ids = getattr(self.endpoint, "keep_ids", None)
        most_items = getattr(self.endpoint, "most_items", None)
        # /score: a prompt past --max-tokens that _first_ids cannot cut on the bytes is cut after
        # parsing; with the model's bound alone (max_tokens items) the shape check refused every
        # such body over SHAPE_CHECK_BYTES first (at the default --max-tokens, all of them).
        wide_bounds = None if bounds is None or most_items is None else (
            bounds[0], bounds[1], max(bounds[2], most_items))

        async def strict_handler(request: Request) -> Response:
            strict = _StrictJSONRequest(request.scope, request.receive)
            strict.bounds = bounds
            strict.keep_ids = keep_ids
            strict.wide_bounds = wide_bounds
            return await handler(strict)

        return strict_handler


#: Where a /score body's token_ids array starts: the key after '{' or ',' (inside a valid
#: document's string the quote would be escaped), the array's first byte at group 1's end.
_TOKEN_IDS_AT = re.compile(rb'[{,]\s*"token_ids"\s*:\s*(\[)')


def _over(most: str) -> bytes:
    """A regex of the integers of len(most) digits greater than ``most``."""
    alts = [f"{most[:k]}[{int(d) + 1}-9][0-9]{{{len(most) - k - 1}}}" for k, d in enumerate(most) if d != "9"]
    return "|".join(alts).encode()


#: In ids with no blanks between commas (``,1,2,``): an item that is no JSON integer in [0, 2**32)
#: (a leading zero, 11 digits or more, 10 past U32). Each starts with a literal ',' (a fast
#: search) and has no nested repeat: a regex of those kept a mark per item, 450 MB for 3 MB.
_NOT_ID = re.compile(rb",0[0-9]|,[0-9]{11}|,(?:" + _over(str(U32)) + rb"),")
#: The scope key of a /score prompt's length when its ids past max_tokens were dropped
TOTAL_IDS = "kvslots.indexer.token_ids"


def _first_ids(body: bytes, keep: int, scope: MutableMapping[str, Any]) -> bytes:
    """``body`` with its token_ids array cut to its first ``keep`` ids when it holds more, all of
    them integers in [0, 2**32) (checked here with C's speed: bytes methods and regexes): a
    longer prompt is scored on its first --max-tokens ids, and only those are parsed, so a body
    costs what it did when longer ones were refused (a JSON integer costs ~1 us and up to 36
    bytes to build: 1.57M of them in a 3 MB body took 1.9 s and 30 MB, the most taken before
    0.35 s and 13 MB). The prompt's length goes in ``scope[TOTAL_IDS]``. Any other body is
    returned as is, for the parser and the model to judge."""
    if body.count(b",") < keep:
        return body
    at = _TOKEN_IDS_AT.search(body)
    if at is None:
        return body
    start = at.end(1)
    end = body.find(b"]", start)
    if end < 0 or body.count(b",", start, end) < keep:
        return body
    content = body[start:end]
    lo, hi = 0, len(content)  # the keep-th comma: the first index with keep commas up to it
    while lo < hi:
        mid = (lo + hi) // 2
        if content.count(b",", 0, mid + 1) >= keep:
            hi = mid
        else:
            lo = mid + 1
    # The dropped ids are checked here (the kept ones by the parser and the model)
    tail = content[lo + 1 :]
    items = b"," + tail.translate(None, b" \t\r\n") + b","
    if (tail.translate(None, b"0123456789, \t\r\n") or b",," in items or _NOT_ID.search(items)
            or len(items) != len(tail) + 2 and re.search(rb"[0-9][ \t\r\n]+[0-9]", tail)):
        return body  # not ids alone: the parser and the model say what is wrong
    scope[TOTAL_IDS] = content.count(b",") + 1
    return body[: start + lo] + body[end:]


def _parse_first_ids(body: bytes, keep: int, scope: MutableMapping[str, Any]) -> Any:
    """_strict_json(body), its token_ids cut to their first ``keep`` when :func:`_first_ids` could
    not cut them on the bytes (an escaped key such as ``token\\u005fids``, ``-0``, a bad id past
    the limit): such a body was refused as too long (422 too_long), which a longer prompt is not.
    A dropped id that is no integer in [0, 2**32) is a 422 that names it."""
    doc = _strict_json(body)
    if TOTAL_IDS in scope or type(doc) is not dict:
        return doc
    ids = doc.get("token_ids")
    if type(ids) is not list or len(ids) <= keep:
        return doc
    for i in range(keep, len(ids)):
        t = ids[i]
        if type(t) is not int or not 0 <= t <= U32:
            shown = json.dumps(t)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise HTTPException(422, detail=[{
                "type": "invalid_token_id", "loc": ["body", "token_ids", i],
                "msg": f"token id {shown} at index {i}, past --max-tokens ({keep}), is invalid: "
                       "token ids are integers in [0, 2**32)"}])
    scope[TOTAL_IDS] = len(ids)
    doc["token_ids"] = ids[:keep]
    return doc


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (application/json, */*+json)."""
    kind = (content_type or "").partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _message(error: dict[str, Any]) -> str:
    msg = str(error.get("msg", ""))
    why = (error.get("ctx") or {}).get("error")
    return f"{msg}: {why}" if isinstance(why, str) and why else msg


def _safe(value: Any) -> Any:
    """A JSON-safe echo of part of an error: strings with lone surrogates escaped."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return _safe(repr(value))


class TierMatch(BaseModel):
    blocks: int = Field(description="Longest prefix of the prompt held entirely on this tier, in blocks")
    tokens: int


class WorkerScore(BaseModel):
    blocks: int = Field(description="Longest prefix the worker holds on any tier, in blocks (for an "
                        "EAGLE worker: that its engine serves from cache)")
    tokens: int
    tiers: dict[str, TierMatch] = Field(description="Per tier: GPU, CPU, STORAGE")
    score: float = Field(
        description="Sum over the matched prefix's blocks of the highest weight among the tiers "
        "the worker holds each block on (e.g. GPU 1.0, CPU 0.8)"
    )


class ScoreResponse(BaseModel):
    block_size: int
    prompt_blocks: int = Field(description="Full blocks in the prompt")
    truncated: bool = Field(description="True when the prompt is longer than the indexer's --max-tokens: "
                            "its first --max-tokens tokens were scored (a prefix's match is the prompt's)")
    stale: bool = Field(
        description="True when the index may lag the workers (a replay in progress, Redis "
        "unreachable or being rebuilt, no live writer): use the scores with care"
    )
    stale_reasons: list[str]
    workers: dict[str, WorkerScore] = Field(description="Every registered worker, matched or not")


class WorkerIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text = Field(max_length=128)
    endpoint: Text = Field(max_length=512, description="ZMQ PUB address, e.g. tcp://10.0.0.5:5557")
    replay: Text | None = Field(None, max_length=512, description="ZMQ ROUTER replay address")
    topic: Text = Field("", max_length=256)
    tier: Text = Field("GPU", description="Tier of events without a medium: GPU, CPU or STORAGE")
    eagle: bool = Field(False, strict=True, description="Runs an EAGLE-family drafter: the last block of "
                        "a prefix counts only when the engine serves it (see docs/indexer.md)")


class WorkerOut(BaseModel):
    name: str
    endpoint: str
    replay: str | None
    topic: str
    tier: str
    eagle: bool
    stream: dict[str, Any] | None = Field(description="Sequence state: applied_seq, gaps, replays, ...")


def create_app(service: IndexerService, *, own_service: bool = False) -> FastAPI:
    """The API over `service`. With `own_service`, the app starts the service on startup (a
    no-op when it is started already: ``kvslots indexer`` starts it before the server, so that a
    failure is one line, not uvicorn's traceback and exit status 3) and stops it on shutdown
    (uvicorn's graceful shutdown runs it, before re-raising SIGTERM)."""
    cfg = service.cfg
    max_tokens = cfg.max_tokens

    class ScoreRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        token_ids: Annotated[list[TokenId], WrapValidator(_few_errors)] = Field(
            max_length=max_tokens, description=f"The prompt's token ids: of a longer prompt the first "
            f"{max_tokens} are scored (truncated: true; the body is still at most {cfg.max_body_bytes} bytes)"
        )
        lora_id: int | None = Field(None, strict=True, ge=0, le=U64,
                                    description="LoRA adapter id, as the engine reports it")
        lora_name: Text | None = Field(None, max_length=256, description="LoRA name, when no id is given")
        block_size: int | None = Field(None, strict=True, ge=1, le=65536,
                                       description=f"Tokens per block (default {cfg.block_size})")

        @model_validator(mode="before")
        @classmethod
        def _unknown(cls, data: Any) -> Any:
            return _few_unknown_fields(cls, data)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if own_service:
            service.start()
        try:
            yield
        finally:
            if own_service:
                service.stop()

    app = FastAPI(
        lifespan=lifespan,
        # /score/ was a 307 with an empty body pointing at /score: a 404 that says so, as any
        # other unknown path.
        redirect_slashes=False,
        title="kvslots indexer",
        version=_version(),
        description=(
            "Which worker already holds how much of a prompt, on which tier. Built from the "
            "workers' KV cache events (vLLM's ZMQ event streams). Adding and removing workers "
            "needs a bearer token and is off unless one is configured."
        ),
    )
    app.router.route_class = _StrictJSONRoute
    app.state.parse_threads = anyio.CapacityLimiter(4)  # big bodies' (_StrictJSONRequest)
    # Bodies read or handled at once: at most BODY_BUDGET_BYTES, or four of the largest (a 503 past it).
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes,
                       budget_bytes=max(BODY_BUDGET_BYTES, 4 * cfg.max_body_bytes))

    def require_admin(authorization: str | None = Header(None)) -> None:
        if not cfg.admin_token:
            raise HTTPException(403, "the admin API is off: start the indexer with an admin token "
                                     "(--admin-token-file or KVSLOTS_INDEXER_ADMIN_TOKEN) to enable it")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), cfg.admin_token.encode()):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(InvalidArgumentError)
    async def _invalid(_: Request, exc: InvalidArgumentError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": _safe(str(exc))})

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back, which fails to serialize for NaN or a
        # lone surrogate (a 500): answer what was wrong and where, without the input.
        # The first MAX_ERRORS only: 262,144 bad token ids were as many entries, a 24 MB answer
        # to a 1.3 MB request that took 15 s (a good request of that size: 1 s).
        errors = exc.errors()
        detail = [{"type": _safe(e.get("type", "")), "loc": [_safe(x) for x in e.get("loc", ())],
                   "msg": _safe(_message(e))} for e in errors[:MAX_ERRORS]]
        if len(errors) > MAX_ERRORS:
            detail.append({"type": "too_many_errors", "loc": ["body"],
                           "msg": f"{len(errors) - MAX_ERRORS} more errors not listed"})
        # A body sent as anything but JSON (curl -d sends a form) reaches the model as bytes:
        # "Input should be a valid dictionary" said nothing of why.
        ctype = request.headers.get("content-type")
        for d in detail:
            if d["type"] == "model_attributes_type" and d["loc"] == ["body"] and not _is_json(ctype):
                d["msg"] = ("the body is read as JSON only when sent with Content-Type: application/json"
                            + ("" if ctype else " (none was given)"))
        return JSONResponse(status_code=422, content={"detail": detail})

    def score(req: ScoreRequest, request: Request) -> dict[str, Any]:
        """Per worker: the longest prefix of the prompt it holds (blocks, tokens), per tier, and
        the tier-weighted score. Only full blocks count. Of a prompt longer than --max-tokens, the
        first --max-tokens tokens are scored (``truncated``: true)."""
        doc = service.score(req.token_ids, req.block_size, req.lora_id, req.lora_name)
        total = request.scope.get(TOTAL_IDS)
        if total is not None:  # the body's ids past max_tokens were dropped unparsed
            doc["truncated"] = True
            doc["prompt_blocks"] = total // doc["block_size"]
        return doc

    score.keep_ids = max_tokens  # type: ignore[attr-defined]  # (_StrictJSONRoute reads it)
    # The shape check's item bound past the model's: as many ids as the byte cap holds ("1,"
    # each). Parsing that many in a parse thread, at the default --max-tokens (3 MB bodies), took
    # 0.5 s and +26 MiB of peak (ints), +44 MiB (floats, refused after parsing).
    score.most_items = cfg.max_body_bytes // 2 + 8  # type: ignore[attr-defined]
    app.post("/score", response_model=ScoreResponse, summary="Score a prompt against every worker")(score)

    @app.get("/workers", response_model=list[WorkerOut], summary="Registered workers and stream state")
    def workers() -> list[dict[str, Any]]:
        return service.workers()

    # Adding or removing a worker waits for its stream (a catch-up replay: up to about
    # --replay-timeout each, one at a time). In the default thread pool (40 threads) a burst of
    # them took every thread and /score, /healthz, ... waited behind them (45 adds of a worker
    # whose replay endpoint does not answer: /score answered after 88 s). They get a few threads
    # of their own instead and wait for them without holding one of the pool's.
    admin_threads = anyio.CapacityLimiter(4)

    @app.post("/workers", status_code=201, response_model=WorkerOut, dependencies=[Depends(require_admin)],
              summary="Add a worker (admin)")
    async def add_worker(w: WorkerIn) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(_add_worker, w, limiter=admin_threads)

    def _add_worker(w: WorkerIn) -> dict[str, Any]:
        try:
            spec = WorkerSpec.from_dict(w.model_dump())
        except ConfigError as e:
            raise HTTPException(422, str(e)) from None
        try:
            added = service.add_worker(spec)
        except ConfigError as e:  # ZMQ refused the address; nothing was kept
            raise HTTPException(422, _safe(str(e))) from None
        except service.backend.unavailable as e:
            raise _unavailable(e) from None
        except Exception as e:  # a server-side failure to subscribe (rolled back)
            if isinstance(e, OutOfDescriptorsError) and "max_connections" in (e.details or {}):
                # the connections' share of the descriptors (fds.ConnectionCap): kept, not run out
                log.warning("worker %s not added: %s", spec.name, e)
                raise HTTPException(503, f"worker {spec.name!r} not added: {_safe(str(e))}") from None
            if _out_of_fds(e):  # the server's limit, said in one line: a burst of adds logged a traceback each
                log.warning("worker %s not added: %s", spec.name, out_of_fds_message())
                raise HTTPException(503, f"worker {spec.name!r} not added: the indexer is {out_of_fds_message()}; "
                                         "remove workers or raise its limit") from None
            log.exception("worker %s not added", spec.name)
            raise HTTPException(503, f"worker {spec.name!r} not added: cannot subscribe to its stream now "
                                     f"({type(e).__name__})") from None
        if not added:
            raise HTTPException(409, f"worker {spec.name!r} already exists")
        return {**spec.to_dict(), "stream": service.sub.status().get(spec.name)}

    @app.delete("/workers/{name}", status_code=204, dependencies=[Depends(require_admin)],
                summary="Remove a worker and its entries (admin)")
    async def remove_worker(name: str) -> Response:
        return await anyio.to_thread.run_sync(_remove_worker, name, limiter=admin_threads)

    def _remove_worker(name: str) -> Response:
        try:
            removed = service.remove_worker(name)
        except service.backend.unavailable as e:
            raise _unavailable(e) from None
        if not removed:
            raise HTTPException(404, f"no worker {brief(name)}")  # a path can be 64 KiB: not all echoed
        return Response(status_code=204)

    @app.get("/healthz", summary="Liveness and backend state")
    def healthz() -> JSONResponse:
        ok, detail = service.health()
        return JSONResponse(status_code=200 if ok else 503, content=detail)

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _unavailable(e: BaseException) -> HTTPException:
    """503: the backend's store (Redis) cannot be reached; nothing was changed."""
    return HTTPException(503, f"the index store is unreachable ({type(e).__name__}); nothing was changed, "
                              "retry later", headers={"Retry-After": "1"})


def _version() -> str:
    from .. import __version__

    return __version__
