"""The HTTP API of ``aligner-serve`` (FastAPI): search, health, stats, document writes, the search
page with live ALIGNER alignments.

Endpoints (OpenAPI docs at ``/docs``, the schema at ``/openapi.json``):

  ``POST /search``     ``{"query", "k", "offset", "filter", "depth"}`` → ``{"hits": [{"doc_id",
                       "score", "rank", "title", "text", "metadata"}], "took_ms", "generation",
                       "query_tokens", "truncated_tokens", "filtered_docs"}``
  ``POST /explain``    ``{"query", "doc_id"}`` → the alignment of one hit (paper §4.4, Tables 4–5)
                       as data and as an HTML fragment (``explanation_html.render_fragment``)
  ``GET /health``      liveness and the snapshot served
  ``GET /stats``       index size, model, requests served, latency percentiles, limits
  ``POST /documents``  ``{"documents": [{"id", "text", "title", "metadata"}]}``  (write token)
  ``DELETE /documents`` ``{"ids": [...]}``  (write token)
  ``GET /``            the search page (``search_page``)

The index behind it (snapshots, batching, the serialised writer) is ``index_service``'s; this
module is the HTTP surface: bodies and their bounds, the write token, errors as 4xx answers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from aligner_jax.common import doc_ids, errors
from aligner_jax.data import beir
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import search_page
from aligner_jax.serving.index_service import ApiError, IndexService, ServeLimits

# ---------------------------------------------------------------------------------------------
# Request and response bodies (the OpenAPI schema)
# ---------------------------------------------------------------------------------------------


#: A document id as every entry point takes it (``common/doc_ids``): a string or an integer,
#: stored as the stripped string ("7", 7 and " 7" name one document).
DocId = Annotated[StrictStr | StrictInt, AfterValidator(doc_ids.clean)]


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "k": "5", 5.0 or true: refused
    query: str = Field(description="Free-text query.", examples=["statins reduce heart risk"])
    k: int = Field(10, ge=1, description="Hits to return (at most the server's --max_k).")
    offset: int = Field(0, ge=0, description="Hits to skip (pagination).")
    depth: int | None = Field(
        None,
        ge=1,
        description="Depth of the ranking the page is cut from (default offset + k; at most "
        "the server's --max_offset + --max_k). Pages asked with one depth are consecutive "
        "slices of one ranking; at their own default depths the fast index's pages can repeat "
        "or skip a document near a boundary.",
    )
    filter: dict[str, Any] | None = Field(
        None,
        description='Metadata conditions, e.g. {"year": {"gte": 2015}}, {"source": {"in": '
        '["a", "b"]}}, {"doc_id": {"in": [...]}}.',
    )


class Hit(BaseModel):
    doc_id: str
    score: float
    rank: int
    title: str = ""
    text: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)


class SearchResponse(BaseModel):
    hits: list[Hit]
    took_ms: float
    generation: int = Field(description="The index snapshot that answered (grows with writes).")
    query_tokens: int = Field(0, description="Tokens the query was encoded with.")
    truncated_tokens: int = Field(0, description="Query tokens dropped past the model's budget.")
    filtered_docs: int | None = Field(None, description="Documents passing the filter.")


class ExplainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    query: str
    doc_id: DocId


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: DocId
    text: str
    title: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)


class AddRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[Document]


class ErrorBody(BaseModel):
    """Every error answer: one line saying what was wrong (a 4xx names the field or flag)."""

    detail: str


def _errors(*statuses: int) -> dict[int, dict]:
    """The OpenAPI ``responses`` of a route's error answers (all ``ErrorBody``: FastAPI would
    document 422 as a list of validation errors, which this server never sends)."""
    meaning = {
        400: "the body is not UTF-8 encoded JSON",
        401: "the write token is missing",
        403: "writes are disabled, or the token is wrong",
        404: "an unknown or deleted document id",
        409: "another writer holds the index, or an id is already in it",
        413: "the body, or its list, is larger than the server's bound",
        422: "a bad field, query or filter",
        500: "a server bug (its log has the traceback)",
        501: "the server explains no hits",
        503: "the index could not be read or written (a file missing or damaged, a full disk)",
    }
    every = (400, *statuses, 413, 500, 503)
    return {s: {"model": ErrorBody, "description": meaning[s]} for s in every}


class DeleteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ids: list[DocId]


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a body longer than the route's bound is answered 413 before it is read
    whole (``Content-Length`` checked first; a chunked body is counted as it arrives, and past
    the bound the app sees the client disconnect while the client gets the 413)."""

    def __init__(self, app, limits: ServeLimits):
        self.app = app
        self.limits = limits

    def _limit(self, scope) -> tuple[int, str]:
        if scope["path"] == "/documents" and scope["method"] in ("POST", "DELETE"):
            return self.limits.max_write_bytes, "--max_write_bytes"
        return self.limits.max_request_bytes, "--max_request_bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self._limit(scope)
        refusal = {"detail": f"request body: larger than {limit} bytes (the server's {flag})"}
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_json(send, 413, refusal)
        state = {"seen": 0, "started": False, "refused": False}

        async def limited_receive():
            if state["refused"]:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                state["seen"] += len(msg.get("body", b""))
                if state["seen"] > limit and not state["started"]:
                    state["refused"] = True
                    await _send_json(send, 413, refusal)
                    return {"type": "http.disconnect"}
            return msg

        async def tracking_send(msg):
            if state["refused"]:
                return  # the 413 was the answer
            state["started"] = state["started"] or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, tracking_send)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(data)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _validation_message(exc: RequestValidationError) -> str:
    """One line naming each bad field: ``body.k: Input should be greater than or equal to 1``."""
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # loc ("body", character)
            at = e.get("loc", ("body", "?"))[-1]
            reason = e.get("ctx", {}).get("error", "")
            parts.append(f"the body is not valid JSON ({reason} at character {at})")
            continue
        where = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _user_error_status(e: BaseException) -> int:
    """409 for a held lock, 422 for what the request got wrong (a field, id, query, filter),
    503 for what the server's side got wrong (an index file missing, unreadable or damaged,
    a full disk): the client cannot fix those."""
    if isinstance(e, errors.LockedError):
        return 409
    if isinstance(e, (errors.ConfigError, errors.BeirFormatError)):
        return 422
    return 503


@dataclasses.dataclass(frozen=True)
class Explainer:
    """How ``/explain`` explains a hit (``evaluation.live_explanation``, handed over by the
    binary: the serving stage does not import evaluation).

    Attributes:
      explain: ``explain(searcher, query, doc_id, doc_text)`` → a JSON-able dict with an
        ``html`` fragment.
      css: the styles of the fragments (added to the search page).
    """

    explain: Callable[[search_lib.Searcher, str, str, str], dict]
    css: str = ""


def create_app(
    service: IndexService,
    write_token: str | None = None,
    explainer: Explainer | None = None,
    title: str = "aligner-serve",
) -> FastAPI:
    """The FastAPI app serving ``service``; writes need ``Authorization: Bearer WRITE_TOKEN``
    (refused with 403 when the server has no write token); ``/explain`` needs an ``explainer``
    (answered 501 without one)."""
    limits = service.limits
    app = FastAPI(
        title=title,
        description="ALIGNER multi-vector search over one index (aligner_jax).",
        version="1",
    )
    app.add_middleware(BodyLimit, limits=limits)
    page_html = search_page.render(explainer.css if explainer else "", limits.max_k)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            exc = StarletteHTTPException(
                400, "the body could not be parsed: send UTF-8 encoded JSON (invalid bytes or "
                "nesting thousands of levels deep are refused)"
            )  # fmt: skip
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        """A server bug: JSON like every other answer, one line (uvicorn logs the traceback)."""
        return JSONResponse(
            {"detail": f"internal server error ({type(exc).__name__}); see the server's log"},
            status_code=500,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        detail = _validation_message(exc)
        content_type = request.headers.get("content-type", "")
        if request.method in ("POST", "DELETE") and "json" not in content_type:
            detail = (
                f"the body must be JSON sent with 'Content-Type: application/json' (this request "
                f"has {content_type or 'none'!r}; curl: -H 'Content-Type: application/json'): "
                + detail
            )
        # a body that does not parse is 400, as bytes that are not UTF-8 are (the documented
        # contract); FastAPI answers it 422, with the fields a body that parsed got wrong
        unparsed = any(e.get("type") == "json_invalid" for e in exc.errors())
        return JSONResponse({"detail": detail}, status_code=400 if unparsed else 422)

    def check_query(text: str) -> str:
        if beir.is_blank(text):
            raise ApiError(422, "query: empty (or invisible characters only); give a text")
        if len(text) > limits.max_query_chars:
            raise ApiError(
                422,
                f"query: {len(text)} characters, more than the server's --max_query_chars="
                f"{limits.max_query_chars}",
            )
        return text

    def check_writer(request: Request) -> None:
        """The write routes' dependency: runs before their body is read and validated (a
        request without the token is 401/403 whatever its body)."""
        if write_token is None:
            raise ApiError(
                403, "writes are disabled: start aligner-serve with --write_token to allow them"
            )
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(
                401,
                "writes need the header 'Authorization: Bearer TOKEN' (the server's --write_token)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not secrets.compare_digest(given.strip().encode(), write_token.encode()):
            raise ApiError(403, "Authorization: the bearer token is not the server's write token")

    def run_user_errors(fn, *args):
        try:
            return fn(*args)
        except errors.USER_ERRORS as e:
            raise ApiError(_user_error_status(e), str(e).splitlines()[0]) from e

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html)

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the snapshot served and its size."""
        snap = service.snapshot
        return {"status": "ok", "generation": snap.generation, "num_docs": snap.num_docs}

    @app.get("/stats")
    async def stats() -> dict:
        """Index size, model, requests served, search latency percentiles (ms), limits."""
        return await run_in_threadpool(service.stats)

    @app.post("/search", response_model=SearchResponse, responses=_errors(422))
    async def search(body: SearchRequest) -> SearchResponse:
        """The ``k`` best documents after ``offset``, with their title, text and metadata."""
        start = time.perf_counter()
        check_query(body.query)
        if body.k > limits.max_k:
            raise ApiError(422, f"k={body.k}: at most {limits.max_k} (the server's --max_k)")
        if body.offset > limits.max_offset:
            raise ApiError(
                422,
                f"offset={body.offset}: at most {limits.max_offset} (the server's --max_offset)",
            )
        if body.depth is not None and body.depth > limits.max_offset + limits.max_k:
            raise ApiError(
                422,
                f"depth={body.depth}: at most {limits.max_offset + limits.max_k} (the server's "
                "--max_offset + --max_k)",
            )
        future = service.submit(body.query, body.k, body.offset, body.filter, body.depth)
        try:
            snapshot, results = await asyncio.wrap_future(future)
        except errors.USER_ERRORS as e:
            service.record(0.0, ok=False)
            raise ApiError(_user_error_status(e), str(e).splitlines()[0]) from e
        except Exception:
            service.record(0.0, ok=False)
            raise
        hits = [snapshot.hit(h) for h in results]
        took_ms = 1000.0 * (time.perf_counter() - start)
        service.record(took_ms, ok=True)
        return SearchResponse(
            hits=hits,
            took_ms=took_ms,
            generation=snapshot.generation,
            query_tokens=results.query_tokens,
            truncated_tokens=results.truncated_tokens,
            filtered_docs=results.filtered_docs,
        )

    @app.post("/explain", responses=_errors(404, 422, 501))
    async def explain(body: ExplainRequest) -> dict:
        """The alignment behind one hit: the query's most salient words, the document words each
        aligns to (rank, similarity, saliences), the score, and an HTML fragment (Tables 4–5)."""
        check_query(body.query)
        if explainer is None:
            raise ApiError(501, "this server explains no hits (started without an explainer)")
        snap = service.snapshot
        if body.doc_id not in snap.searcher.doc_positions:
            raise ApiError(404, f"doc_id={body.doc_id!r}: not a document of this index")
        title, text = await run_in_threadpool(snap.document, body.doc_id)
        if not text and not title:
            raise ApiError(
                404,
                f"doc_id={body.doc_id!r}: deleted, or its text is not stored (an index built "
                "with store_text=False)",
            )
        return await run_in_threadpool(
            run_user_errors,
            explainer.explain,
            snap.searcher,
            body.query,
            body.doc_id,
            beir.document_text(beir.Document(body.doc_id, title, text)),
        )

    @app.post(
        "/documents",
        dependencies=[Depends(check_writer)],
        responses=_errors(401, 403, 409, 422),
    )
    async def add_documents(body: AddRequest) -> dict:
        """Adds documents (write token). Answers once they are searchable (by this server
        process; with ``--workers``, by the others within ``--refresh_s``)."""
        docs = body.documents
        if not docs:
            raise ApiError(422, "documents: empty list; give at least one document")
        if len(docs) > limits.max_documents:
            raise ApiError(
                413,
                f"documents: {len(docs)}, more than the server's --max_documents="
                f"{limits.max_documents} per request",
            )
        dup = sorted(i for i, n in collections.Counter(d.id for d in docs).items() if n > 1)
        if dup:
            raise ApiError(422, f"documents: ids repeated in the request: {dup[:3]}")
        empty = [d.id for d in docs if not (d.text.strip() or d.title.strip())]
        if empty:
            raise ApiError(422, f"documents: empty title and text for ids {empty[:3]}")
        start = time.perf_counter()
        records = [d.model_dump() for d in docs]
        out = await run_in_threadpool(run_user_errors, service.add, records)
        return {**out, "took_ms": 1000.0 * (time.perf_counter() - start)}

    @app.delete(
        "/documents",
        dependencies=[Depends(check_writer)],
        responses=_errors(401, 403, 404, 409, 422),
    )
    async def delete_documents(body: DeleteRequest) -> dict:
        """Deletes documents by id (write token): never returned again."""
        if not body.ids:
            raise ApiError(422, "ids: empty list; give at least one document id")
        if len(body.ids) > limits.max_documents:
            raise ApiError(
                413,
                f"ids: {len(body.ids)}, more than the server's --max_documents="
                f"{limits.max_documents} per request",
            )
        start = time.perf_counter()
        out = await run_in_threadpool(
            run_user_errors, service.delete, list(dict.fromkeys(body.ids))
        )
        return {**out, "took_ms": 1000.0 * (time.perf_counter() - start)}

    return app
