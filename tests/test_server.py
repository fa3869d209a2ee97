"""aligner-serve (issue 25 items 4-5): the HTTP API over a real (bundled MiniLM) index of the toy
collection — every endpoint, the write token, request bounds, snapshots under concurrent writes,
the search page and its live alignments."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import gin
import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from fixtures import TOY_DOCS, TOY_QUERIES, run_module

import aligner_jax
from aligner_jax.common import cli, errors
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.evaluation import live_explanation
from aligner_jax.indexing import token_store as ts
from aligner_jax.indexing.indexer import IndexingConfig
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import http_app, index_service, serve_job

TOKEN = "test-write-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LATER = ("d9", "d10", "d11")  # added through the API
TOPICS = {"d1": "insects", "d10": "insects", "d2": "games", "d7": "medicine"}
FIRST = {
    k: {**v, "metadata": {"topic": TOPICS.get(k, "other"), "n": i}}
    for i, (k, v) in enumerate(TOY_DOCS.items())
    if k not in LATER
}
BEES = TOY_QUERIES["q1"]  # "honey bees in the hive"
EXPLAINER = http_app.Explainer(live_explanation.explain_hit, live_explanation.CSS)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The toy collection less d9-d11 indexed with the bundled MiniLM (search index included)."""
    root = tmp_path_factory.mktemp("serve")
    gin.clear_config()
    cli.parse_gin(["models/minilm_identity.gin"])
    encoder = Encoder(loading.load_encoder(), EncodingConfig())
    gin.clear_config()
    index_dir = root / "index"
    index = aligner_jax.Index.create(index_dir, model=encoder, config=IndexingConfig(shard_size=4))
    index.add([{"id": k, **v} for k, v in FIRST.items()])
    return index_dir


@pytest.fixture(scope="module")
def query_encoder(pristine):
    return search_lib.Searcher.load(str(pristine)).encoder


def _service(index_dir, query_encoder, **limits):
    def loader(directory, encoder):
        return search_lib.Searcher.load(directory, encoder=encoder or query_encoder)

    limits = index_service.ServeLimits(**limits) if limits else None
    return index_service.IndexService(index_dir, loader=loader, limits=limits)


@pytest.fixture
def index_copy(pristine, tmp_path):
    """A copy of the index that a test may write to."""
    return shutil.copytree(pristine, tmp_path / "index")


@pytest.fixture
def client(index_copy, query_encoder):
    service = _service(index_copy, query_encoder, max_k=50, max_query_chars=200)
    app = http_app.create_app(service, write_token=TOKEN, explainer=EXPLAINER)
    with TestClient(app) as c:
        yield c
    service.close()


@pytest.fixture(scope="module")
def read_only(pristine, query_encoder):
    """A server without a write token over the pristine index (tests here never write)."""
    service = _service(pristine, query_encoder, max_request_bytes=2048)
    with TestClient(http_app.create_app(service, explainer=EXPLAINER)) as c:
        yield c
    service.close()


def _ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [h["doc_id"] for h in response.json()["hits"]]


# -- search ------------------------------------------------------------------------------------


def test_search_returns_ranked_hits_with_title_text_and_metadata(read_only, pristine):
    r = read_only.post("/search", json={"query": BEES, "k": 3})
    body = r.json()
    assert r.status_code == 200 and body["generation"] == 0 and body["took_ms"] > 0
    hits = body["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3] and hits[0]["doc_id"] == "d1"
    assert hits[0]["title"] == "Honey bees" and hits[0]["text"] == TOY_DOCS["d1"]["text"]
    assert hits[0]["metadata"]["topic"] == "insects"
    assert all(a["score"] >= b["score"] for a, b in zip(hits, hits[1:], strict=False))
    # the same ranking and scores as the Python API
    direct = search_lib.Searcher.load(str(pristine)).search(BEES, k=3)
    assert [(h["doc_id"], pytest.approx(h["score"], abs=1e-6)) for h in hits] == [
        (h.doc_id, h.score) for h in direct
    ]
    assert body["query_tokens"] > 0 and body["truncated_tokens"] == 0


def test_pages_are_slices_of_one_ranking(read_only):
    whole = read_only.post("/search", json={"query": BEES, "k": 6}).json()["hits"]
    page = read_only.post("/search", json={"query": BEES, "k": 2, "offset": 2}).json()["hits"]
    assert [(h["doc_id"], h["rank"]) for h in page] == [
        (h["doc_id"], h["rank"]) for h in whole[2:4]
    ]
    assert [h["rank"] for h in page] == [3, 4]
    at_depth = read_only.post("/search", json={"query": BEES, "k": 2, "offset": 2, "depth": 6})
    assert [(h["doc_id"], h["rank"]) for h in at_depth.json()["hits"]] == [
        (h["doc_id"], h["rank"]) for h in whole[2:4]
    ]


def test_filter_restricts_the_candidates(read_only):
    r = read_only.post("/search", json={"query": BEES, "k": 5, "filter": {"topic": "insects"}})
    assert _ids(r) == ["d1"] and r.json()["filtered_docs"] == 1
    r = read_only.post("/search", json={"query": BEES, "k": 3, "filter": {"n": {"gte": 7}}})
    assert set(_ids(r)) <= {"d7", "d8"} and len(_ids(r)) == 2
    bad = read_only.post("/search", json={"query": BEES, "filter": {"topic": {"near": 1}}})
    assert bad.status_code == 422 and "near" in bad.json()["detail"]


def test_concurrent_queries_are_batched_and_each_gets_its_own_answer(read_only):
    """Requests arriving together are encoded in one batch (grouped by page and filter); each
    answer is the one a lone request gets."""
    alone = {
        q: _ids(read_only.post("/search", json={"query": q, "k": 3})) for q in TOY_QUERIES.values()
    }
    service = read_only.app.state.service
    batches = service.stats()["counts"].get("batches", 0)
    futures = [service.submit(q, 3) for q in TOY_QUERIES.values() for _ in range(3)]
    futures.append(service.submit(BEES, 2, 1))  # another page, same batch
    for future, q in zip(
        futures, [q for q in TOY_QUERIES.values() for _ in range(3)], strict=False
    ):
        _, hits = future.result(timeout=60)
        assert [h.doc_id for h in hits] == alone[q]
    _, page = futures[-1].result(timeout=60)
    assert [h.doc_id for h in page] == alone[BEES][1:3]
    assert service.stats()["counts"]["batches"] - batches < len(futures)  # some went together


# -- bounds and bad requests -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"query": BEES, "k": 0}, 422, "body.k: Input should be greater than or equal to 1"),
        ({"query": BEES, "k": 51}, 422, "k=51: at most 50 (the server's --max_k)"),
        ({"query": BEES, "offset": -1}, 422, "body.offset"),
        ({"query": BEES, "offset": 10_001}, 422, "--max_offset"),
        (
            {"query": BEES, "k": 2, "offset": 2, "depth": 3},
            422,
            "depth=3: the ranking's depth must be at least offset + k = 4",
        ),
        ({"query": BEES, "depth": 10_051}, 422, "depth=10051: at most 10050 (the server's"),
        ({"query": BEES, "depth": 0}, 422, "body.depth: Input should be greater than or equal"),
        ({"query": "x" * 201}, 422, "201 characters, more than the server's --max_query_chars=200"),
        ({"query": "   "}, 422, "query: empty"),
        ({"query": "\u200b\u0000"}, 422, "query: empty (or invisible characters only)"),
        ({"query": BEES, "filter": {"n": 10**20}}, 422, "beyond 64-bit integers"),
        ({"query": None}, 422, "body.query: Input should be a valid string"),
        ({"k": 3}, 422, "body.query: Field required"),
        ({"query": BEES, "kk": 3}, 422, "body.kk: Extra inputs are not permitted"),
        ({"query": BEES, "filter": ["topic"]}, 422, "body.filter"),
        ({"query": BEES, "k": "5"}, 422, "body.k: Input should be a valid integer"),
        ({"query": BEES, "k": 5.0}, 422, "body.k: Input should be a valid integer"),
        ({"query": BEES, "k": True}, 422, "body.k: Input should be a valid integer"),
    ],
)
def test_bad_searches_get_a_4xx_naming_the_field(client, body, status, message):
    r = client.post("/search", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]


def test_a_server_bug_is_a_json_500_counted_as_a_failed_search(index_copy, query_encoder):
    service = _service(index_copy, query_encoder)

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    service.snapshot.searcher.search_batch = boom
    with TestClient(http_app.create_app(service), raise_server_exceptions=False) as c:
        r = c.post("/search", json={"query": BEES})
        assert r.status_code == 500  # was plain text "Internal Server Error", not counted
        assert r.json() == {"detail": "internal server error (RuntimeError); see the server's log"}
        assert c.get("/stats").json()["counts"]["failed_searches"] == 1
    service.close()


def test_an_unreadable_index_file_is_a_503_not_the_clients_422(index_copy, query_encoder):
    service = _service(index_copy, query_encoder)

    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "search_index/codes.npy")

    service.snapshot.searcher.search_batch = gone
    with TestClient(http_app.create_app(service)) as c:
        r = c.post("/search", json={"query": BEES})
        assert r.status_code == 503 and "search_index/codes.npy" in r.json()["detail"]
        assert c.get("/stats").json()["counts"]["failed_searches"] == 1
    service.close()


def test_a_committed_write_whose_snapshot_fails_to_load_is_still_answered_done(
    index_copy, query_encoder
):
    """A write that committed but whose new snapshot failed to load answered as a failure: a
    retry then clashed with the write it had made."""
    service = _service(index_copy, query_encoder)
    loads = []

    def failing(directory, encoder):
        loads.append(directory)
        raise OSError("out of memory mapping the new generation")

    service._loader = failing
    try:
        out = service.add([{"id": "n1", "text": "glaciers carve valleys", "title": ""}])
        assert out == {"added": 1, "generation": 0} and loads
        assert service.stats()["counts"]["publish_errors"] == 1
        assert "n1" in ts.TokenStore(index_copy).live_positions()  # committed
    finally:
        service.close()


def test_an_empty_filter_is_no_filter(read_only):
    """As in Qdrant; it counted every document as passing a filter."""
    r = read_only.post("/search", json={"query": BEES, "k": 3, "filter": {}})
    assert r.json()["filtered_docs"] is None
    assert _ids(r) == _ids(read_only.post("/search", json={"query": BEES, "k": 3}))


def test_oversized_and_malformed_bodies_are_refused(read_only):
    big = json.dumps({"query": "bees " * 1000})
    r = read_only.post("/search", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert (
        r.json()["detail"]
        == "request body: larger than 2048 bytes (the server's --max_request_bytes)"
    )

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 500

    r = read_only.post("/search", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = read_only.post(
        "/search", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400  # as documented (and as bytes that are not UTF-8); was 422
    assert (
        r.json()["detail"].startswith("the body is not valid JSON (") and "at character 1" in r.text
    )
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d without -H
    r = read_only.post("/search", content=json.dumps({"query": BEES}), headers=form)
    assert r.status_code == 422 and "-H 'Content-Type: application/json'" in r.json()["detail"]


def test_limits_are_checked_when_the_server_starts(monkeypatch):
    with pytest.raises(errors.ConfigError, match="--max_k=0: must be an int >= 1"):
        index_service.ServeLimits(max_k=0)
    with pytest.raises(errors.ConfigError, match="--write_token: 5 characters; use at least 16"):
        serve_job.write_token_from("short")
    monkeypatch.setenv(serve_job.TOKEN_ENV, "short")  # the variable, not a flag never given
    with pytest.raises(errors.ConfigError, match=r"^\$ALIGNER_SERVE_WRITE_TOKEN: 5 characters"):
        serve_job.write_token_from(None)


# -- health, stats, OpenAPI --------------------------------------------------------------------


def test_health_stats_and_openapi(read_only):
    health = read_only.get("/health").json()
    assert health == {"status": "ok", "generation": 0, "num_docs": 9}
    read_only.post("/search", json={"query": BEES, "k": 2})
    stats = read_only.get("/stats").json()
    assert stats["num_docs"] == 9 and stats["num_tokens"] > 9 and stats["backend"] == "centroid"
    assert stats["model"]["name"] == "minilm/identity/none" and stats["counts"]["searches"] >= 1
    assert 0 < stats["search_latency_ms"]["p50"] <= stats["search_latency_ms"]["p99"]
    assert stats["limits"]["max_request_bytes"] == 2048
    schema = read_only.get("/openapi.json").json()
    assert {"/search", "/explain", "/health", "/stats", "/documents"} <= set(schema["paths"])
    assert {"post", "delete"} <= set(schema["paths"]["/documents"])
    assert read_only.get("/docs").status_code == 200
    # errors are documented as they are sent: {"detail": "one line"}, not FastAPI's list
    error = {"$ref": "#/components/schemas/ErrorBody"}
    assert schema["components"]["schemas"]["ErrorBody"]["properties"]["detail"]["type"] == "string"
    for path, method, statuses in (
        ("/search", "post", {"400", "413", "422", "500"}),
        ("/documents", "post", {"400", "401", "403", "409", "413", "422", "500"}),
        ("/documents", "delete", {"401", "403", "404", "409", "422"}),
        ("/explain", "post", {"404", "422", "501"}),
    ):
        responses = schema["paths"][path][method]["responses"]
        assert statuses <= set(responses), (path, method)
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error
    assert "HTTPValidationError" not in json.dumps(schema["paths"])


def test_a_body_that_is_not_utf8_json_is_one_line(read_only):
    for body in (b'{"query": "\xff"}', b"[" * 1020 + b"]" * 1020):  # under its 2048-byte bound
        r = read_only.post("/search", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400  # was "There was an error parsing the body"
        assert r.json()["detail"].startswith("the body could not be parsed: send UTF-8 encoded")


# -- writes ------------------------------------------------------------------------------------


def test_writes_need_the_token(client, read_only):
    doc = {"documents": [{"id": "d10", "text": TOY_DOCS["d10"]["text"]}]}
    r = read_only.post("/documents", json=doc, headers=AUTH)
    assert r.status_code == 403 and "--write_token" in r.json()["detail"]
    r = client.post("/documents", json=doc)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    r = client.post("/documents", json=doc, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403 and "not the server's write token" in r.json()["detail"]
    r = client.request(
        "DELETE", "/documents", json={"ids": ["d1"]}, headers={"Authorization": TOKEN}
    )
    assert r.status_code == 401
    # the token is checked before the body: a bad body without it is 401 / 403, not 422
    r = client.post("/documents", json={"documents": [{"id": "q"}]})
    assert r.status_code == 401, r.text
    r = read_only.post("/documents", json={"documents": [{"id": "q"}]}, headers=AUTH)
    assert r.status_code == 403, r.text
    assert client.get("/health").json()["generation"] == 0  # nothing was written


def test_a_delete_body_may_be_as_long_as_a_write(client):
    """DELETE /documents had the 64 KiB bound of searches: 6,000 ids were refused 413, short of
    the documented --max_documents=10000."""
    ids = [f"missing-{i:06d}" for i in range(6000)]
    assert len(json.dumps({"ids": ids})) > 65536
    r = client.request("DELETE", "/documents", json={"ids": ids}, headers=AUTH)
    assert r.status_code == 404 and "6000 are not live documents" in r.json()["detail"]


def test_an_id_another_process_added_meanwhile_is_a_409(client, index_copy):
    """The clash check read the served snapshot: within --refresh_s of an outside commit the
    add failed deep in Index.add, a 422 naming the Python API and the server's path."""
    aligner_jax.Index.open(index_copy).add([{"id": "d9", **TOY_DOCS["d9"]}])
    r = client.post("/documents", json={"documents": [{"id": "d9", "text": "x"}]}, headers=AUTH)
    assert r.status_code == 409, r.text
    assert "1 ids are already in the index" in r.json()["detail"]
    assert client.get("/health").json() == {"status": "ok", "generation": 1, "num_docs": 10}


def test_add_and_delete_publish_new_snapshots(client):
    before = _ids(client.post("/search", json={"query": BEES, "k": 3}))
    docs = [
        {
            "id": d,
            "title": TOY_DOCS[d]["title"],
            "text": TOY_DOCS[d]["text"],
            "metadata": {"topic": "insects"},
        }
        for d in LATER
    ]
    r = client.post("/documents", json={"documents": docs}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["added"] == 3 and r.json()["generation"] == 1
    after = client.post("/search", json={"query": BEES, "k": 3}).json()
    assert after["generation"] == 1 and [h["doc_id"] for h in after["hits"]][:2] == ["d1", "d10"]
    assert after["hits"][1]["title"] == "Beekeeping"
    assert client.get("/health").json()["num_docs"] == 12
    # the same ids again: a conflict, nothing written
    r = client.post("/documents", json={"documents": docs[:1]}, headers=AUTH)
    assert r.status_code == 409 and "already in the index" in r.json()["detail"]
    r = client.request("DELETE", "/documents", json={"ids": ["d1", "nope"]}, headers=AUTH)
    assert r.status_code == 404 and "'nope'" in r.json()["detail"]
    r = client.request("DELETE", "/documents", json={"ids": ["d1"]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {**r.json(), "deleted": 1, "generation": 2}
    now = _ids(client.post("/search", json={"query": BEES, "k": 3}))
    assert "d1" not in now and now[0] == "d10" and before[0] == "d1"
    r = client.post("/explain", json={"query": BEES, "doc_id": "d1"})
    assert r.status_code == 404 and "deleted" in r.json()["detail"]
    # the index on disk holds the writes: a fresh searcher agrees
    fresh = search_lib.Searcher.load(client.app.state.service.index_dir)
    assert [h.doc_id for h in fresh.search(BEES, k=3)] == now
    # a deleted id may be added again (a new document; it was refused as "already in")
    back = {"id": "d1", "title": "Bees again", "text": TOY_DOCS["d1"]["text"]}
    r = client.post("/documents", json={"documents": [back]}, headers=AUTH)
    assert r.status_code == 200, r.text
    hits = client.post("/search", json={"query": BEES, "k": 3}).json()["hits"]
    assert [h["title"] for h in hits if h["doc_id"] == "d1"] == ["Bees again"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"documents": []}, "documents: empty list"),
        (
            {"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]},
            "repeated in the request: ['a']",
        ),
        ({"documents": [{"id": "a", "text": "  "}]}, "empty title and text for ids ['a']"),
        ({"documents": [{"id": "", "text": "x"}]}, "body.documents.0.id"),
        ({"documents": [{"id": " ", "text": "x"}]}, "body.documents.0.id: Value error, is empty"),
        ({"documents": [{"id": 1.5, "text": "x"}]}, "body.documents.0.id"),
        (
            {"documents": [{"id": 7, "text": "x"}, {"id": " 7", "text": "y"}]},
            "repeated in the request: ['7']",
        ),
        ({"documents": [{"text": "x"}]}, "body.documents.0.id: Field required"),
        ({"documents": [{"id": "a", "text": "x", "body": "y"}]}, "Extra inputs"),
    ],
)
def test_bad_writes_get_a_422_naming_the_field(client, body, message):
    r = client.post("/documents", json=body, headers=AUTH)
    assert r.status_code == 422 and message in r.json()["detail"], r.text


def test_integer_ids_name_the_same_documents_as_their_strings(client):
    """As in a BEIR corpus and ``Index.add`` (``common/doc_ids``): once refused over HTTP."""
    r = client.post("/documents", json={"documents": [{"id": 77, "text": "bees"}]}, headers=AUTH)
    assert r.status_code == 200, r.text
    r = client.request("DELETE", "/documents", json={"ids": [" 77"]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["deleted"] == 1, r.text
    r = client.request("DELETE", "/documents", json={"ids": [True]}, headers=AUTH)
    assert r.status_code == 422 and "body.ids.0" in r.json()["detail"], r.text


def test_a_write_during_searches_never_shows_half_an_update(index_copy, query_encoder):
    """Real uvicorn (two search threads), 4 client threads searching while 3 documents are added
    then one deleted: 0 failures, every answer equal to the answer of the snapshot (generation)
    it names, and each client sees the generations in order."""
    service = _service(index_copy, query_encoder, search_threads=2)
    app = http_app.create_app(service, write_token=TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    queries = list(TOY_QUERIES.values())
    seen, failures, stop = [], [], threading.Event()

    def reader():
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                for q in queries:
                    r = http.post("/search", json={"query": q, "k": 4})
                    if r.status_code != 200:
                        failures.append(r.text)
                        continue
                    body = r.json()
                    hits = tuple((h["doc_id"], h["score"]) for h in body["hits"])
                    seen.append((threading.get_ident(), body["generation"], q, hits))

    readers = [threading.Thread(target=reader) for _ in range(4)]
    for t in readers:
        t.start()
    expected = {}

    def wait_for(generation):  # until the readers have answered every query from this snapshot
        deadline = time.time() + 60
        while time.time() < deadline:
            if {q for _, g, q, _ in list(seen) if g == generation} == set(queries):
                return
            time.sleep(0.05)

    with httpx.Client(base_url=url, timeout=120) as http:
        wait_for(0)
        docs = [{"id": d, **TOY_DOCS[d]} for d in LATER]
        assert http.post("/documents", json={"documents": docs}, headers=AUTH).status_code == 200
        wait_for(1)
        r = http.request("DELETE", "/documents", json={"ids": ["d1"]}, headers=AUTH)
        assert r.status_code == 200
        wait_for(2)
    stop.set()
    for t in readers:
        t.join()
    server.should_exit = True
    thread.join(timeout=10)
    service.close()
    assert not failures
    # Each generation answers each query one way: the same ranking, the same scores (up to the
    # float rounding of encoding a query in batches of other sizes).
    for _, generation, q, hits in seen:
        expected.setdefault((generation, q), []).append(hits)
    assert {g for g, _ in expected} == {0, 1, 2}
    for (generation, q), answers in expected.items():
        for hits in answers:
            assert [d for d, _ in hits] == [d for d, _ in answers[0]], (generation, q)
            assert [s for _, s in hits] == pytest.approx([s for _, s in answers[0]], abs=1e-4)
    assert [d for d, _ in expected[(0, BEES)][0]][:2] == ["d1", "d3"]
    assert [d for d, _ in expected[(1, BEES)][0]][:2] == ["d1", "d10"]
    assert [d for d, _ in expected[(2, BEES)][0]][:1] == ["d10"]
    for ident in {i for i, *_ in seen}:
        gens = [g for i, g, *_ in seen if i == ident]
        assert gens == sorted(gens)


# -- the page and the explanations -------------------------------------------------------------


def test_explain_gives_the_alignment_of_a_hit(read_only):
    r = read_only.post("/explain", json={"query": BEES, "doc_id": "d1"})
    assert r.status_code == 200, r.text
    ex = r.json()
    assert ex["doc_id"] == "d1" and ex["alignment"] == "top_k:1" and ex["uniform_salience"]
    words = {w["query_word"]: [a["doc_word"] for a in w["aligned"]] for w in ex["query_words"]}
    assert words["bees"] == ["bees"] and words["hive"] == ["hive"] and words["honey"] == ["Honey"]
    assert 'id="d1-query"' in ex["html"] and 'id="d1-top-alignments"' in ex["html"]
    assert "<html" not in ex["html"]  # a fragment for the page
    assert read_only.post("/explain", json={"query": BEES, "doc_id": "zz"}).status_code == 404


def test_explain_without_an_explainer_is_501(index_copy, query_encoder):
    service = _service(index_copy, query_encoder)
    with TestClient(http_app.create_app(service)) as c:
        r = c.post("/explain", json={"query": BEES, "doc_id": "d1"})
    service.close()
    assert r.status_code == 501


def test_search_page_is_served(read_only, client):
    default = index_service.ServeLimits().max_k
    assert f'max="{default}" value="{min(10, default)}"' in read_only.get("/").text
    assert 'max="50" value="10"' in client.get("/").text  # the server's --max_k, not 100
    r = read_only.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for part in (
        '<form id="form">',
        'id="q"',
        '"/search"',
        '"/explain"',
        "sup.rank",
        ".hit .snippet",
    ):
        assert part in page
    assert "innerHTML = ex.html" in page and "textContent" in page  # index texts as text


# -- the binary --------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess loading JAX, the model and the warm-ups: ~30 s
def test_serve_binary_answers_on_localhost(pristine, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from fixtures import start_python

    proc = start_python(
        "-m", "aligner_jax.serve", f"--index_dir={pristine}", f"--port={port}", capture=True
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.5)
        assert health["num_docs"] == 9
        r = httpx.post(f"http://127.0.0.1:{port}/search", json={"query": BEES, "k": 1}, timeout=60)
        assert r.json()["hits"][0]["doc_id"] == "d1"
        r = httpx.post(
            f"http://127.0.0.1:{port}/explain", json={"query": BEES, "doc_id": "d1"}, timeout=60
        )
        assert r.status_code == 200 and r.json()["score"] > 0.5
        r = httpx.post(f"http://127.0.0.1:{port}/documents", json={"documents": []}, timeout=10)
        assert r.status_code == 403  # no --write_token
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_binary_refuses_a_missing_index_in_one_line(tmp_path):
    r = run_module("aligner_jax.serve", f"--index_dir={tmp_path / 'nope'}")
    assert r.returncode == 1
    (last,) = r.stderr.strip().splitlines()[-1:]
    assert last.startswith("aligner-serve: error: ") and "nope" in last


def test_changes_committed_by_another_writer_are_served(index_copy, query_encoder):
    """aligner-index (here aligner_jax.Index, the same code) adds to the served directory: the
    server moves to the new state by itself (``refresh_s``) as a new snapshot."""
    service = index_service.IndexService(
        index_copy,
        loader=lambda d, enc: search_lib.Searcher.load(d, encoder=enc or query_encoder),
        refresh_s=0.2,
    )
    with TestClient(http_app.create_app(service)) as c:
        query = "slow rivers of ice carving valleys"
        assert "d9" not in _ids(c.post("/search", json={"query": query, "k": 3}))
        aligner_jax.Index.open(index_copy).add([{"id": "d9", **TOY_DOCS["d9"]}])
        deadline = time.time() + 60
        while c.get("/health").json()["generation"] == 0 and time.time() < deadline:
            time.sleep(0.1)
        r = c.post("/search", json={"query": query, "k": 3})
        assert r.json()["generation"] == 1 and _ids(r)[0] == "d9"
        assert r.json()["hits"][0]["title"] == "Glaciers"
        assert service.stats()["counts"]["refreshes"] == 1
        assert not service.refresh()  # nothing new since
    service.close()


def test_a_search_on_a_snapshot_another_process_vacuumed_is_answered_on_the_new_one(
    index_copy, query_encoder
):
    """A vacuum replaces the store's shard files: the snapshot the server opened before it can
    no longer read the ones it had not mapped; the search loads the committed state and is
    answered there (it failed with the old snapshot's missing file)."""
    service = _service(index_copy, query_encoder)
    try:
        writer = aligner_jax.Index.open(index_copy)
        writer.delete(["d2"])
        summary = writer.vacuum()
        assert summary["removed_docs"] == 1 and summary["shards_after"] == 2  # 8 docs, shards of 4
        snapshot, hits = service.submit(BEES, k=3).result(timeout=120)
        assert hits[0][0] == "d1" and hits[0].title == "Honey bees"
        assert snapshot.generation == 1 and service.stats()["counts"]["refreshes"] == 1
        chess = service.submit(TOY_QUERIES["q3"], k=8).result(timeout=120)[1]
        assert chess and "d2" not in [h[0] for h in chess]
    finally:
        service.close()


def test_a_request_cancelled_in_the_queue_leaves_the_search_thread_alive(index_copy, query_encoder):
    """A future cancelled while queued (a handler cancelled by a timeout) made set_result raise
    in the only search thread, which died: every later search hung while /health said ok."""
    service = _service(index_copy, query_encoder, max_batch=1)
    try:
        futures = [service.submit(BEES, k=2) for _ in range(6)]
        cancelled = [f.cancel() for f in futures[1:]]
        assert any(cancelled)  # queued behind the first, which is searched meanwhile
        after = service.submit(BEES, k=2)
        assert after.result(timeout=60)[1][0][0] == "d1"
        assert all(
            f.result(timeout=60)[1] for f, c in zip(futures[1:], cancelled, strict=True) if not c
        )
    finally:
        service.close()


def test_the_refresh_thread_outlives_a_bug(index_copy, query_encoder):
    service = index_service.IndexService(
        index_copy,
        loader=lambda d, enc: search_lib.Searcher.load(d, encoder=enc or query_encoder),
        refresh_s=0.05,
    )
    service.refresh = lambda: {}["a bug"]  # a KeyError: the thread stopped refreshing, silently
    deadline = time.time() + 30
    while service.stats()["counts"].get("refresh_errors", 0) < 3 and time.time() < deadline:
        time.sleep(0.05)
    service.close()
    assert service.stats()["counts"]["refresh_errors"] >= 3


# ~45 tokens: past the two shortest query length buckets (16, 32), which alone are warmed in
# batches; such a query is searched alone, in the shapes Searcher.load compiled.
LONG = " ".join(["honey bees gather nectar from flowers and store it in the hive"] * 4)


@pytest.mark.parametrize("mode", ["fast", "device"])
def test_a_warmed_service_compiles_nothing_for_any_batch(pristine, query_encoder, index_copy, mode):
    """``warm_batches`` (the binary's): after the start nothing compiles, whatever a batch
    holds — short queries together, long ones (beyond the warmed length buckets) and a
    ``k + offset`` beyond the warmed k (device mode) — and the snapshot published after a write
    is warmed before it answers; the answers are the exhaustive search's (device) / the same
    as one query at a time (fast)."""
    from aligner_jax.common import compilations

    def loader(directory, encoder):
        return search_lib.Searcher.load(directory, mode=mode, encoder=encoder or query_encoder)

    service = index_service.IndexService(
        index_copy, loader=loader, limits=index_service.ServeLimits(max_batch=4), warm_batches=True
    )
    texts = list(TOY_QUERIES.values())[:2] + [LONG, LONG + " again"]
    try:
        with compilations.counting() as counter:
            pages = service.snapshot.searcher.search_batch(texts, k=3)
            deep = service.snapshot.searcher.search_batch(texts[:2], k=40, offset=10)
            after_start = list(counter.names)
            service.add([{"id": "new1", "text": LONG}])  # compiles the new snapshot's shapes
            published = counter.count
            late = service.snapshot.searcher.search_batch(texts, k=3)
    finally:
        service.close()
    compiled = counter.names
    assert after_start == []
    assert compiled[published:] == []
    assert [p.query_tokens > 32 for p in pages] == [False, False, True, True]
    assert late[2][0][0] == "new1"  # the added document is the long query's best
    reference = search_lib.Searcher.load(
        str(pristine), mode="exhaustive" if mode == "device" else mode, encoder=query_encoder
    )
    want = [reference.search(t, k=3) for t in texts] + [
        reference.search(t, k=40, offset=10) for t in texts[:2]
    ]
    for page, w in zip(pages + deep, want, strict=True):
        assert [h[0] for h in page] == [h[0] for h in w]
        np.testing.assert_allclose([h[1] for h in page], [h[1] for h in w], rtol=1e-5)


# -- several worker processes (--workers) ------------------------------------------------------


WORKERS_SCRIPT = """
import sys
import fixtures
from aligner_jax.serving import serve_job
print(serve_job._serve_workers(2, "127.0.0.1", int(sys.argv[1]), {
    "index_dir": sys.argv[2], "write_token": None, "refresh_s": 2.0, "fail": sys.argv[3] == "1"},
    target=fixtures.pid_worker))
"""


def _start_workers(port, index_dir, fail=False):
    from fixtures import REPO, start_python

    return start_python(
        "-c", WORKERS_SCRIPT, port, index_dir, int(fail), capture=True,
        PYTHONPATH=str(REPO / "tests"),
    )  # fmt: skip


def test_workers_share_the_port_and_stop_together(pristine):
    """``--workers=2``'s supervisor (``_serve_workers``; stand-in workers): both processes serve
    the one port, new connections reach both, SIGTERM stops them all (exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _start_workers(port, pristine)
    try:
        pids, deadline = set(), time.time() + 60
        while len(pids) < 2 and time.time() < deadline:
            try:
                pids.add(httpx.get(f"http://127.0.0.1:{port}/", timeout=5).json()["pid"])
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.2)
        assert len(pids) == 2 and proc.pid not in pids
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == "aligner-serve: stopped"
    for pid in pids:  # the workers are gone with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_exits_stops_the_server_with_its_code(pristine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _start_workers(port, pristine, fail=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "worker aligner-serve-0 exited with code 3" in err or "exited with code 3" in err


def test_workers_refuse_bad_settings_before_starting(tmp_path, pristine, monkeypatch):
    monkeypatch.setattr(serve_job.multiprocessing, "get_context", lambda *a: pytest.fail("start"))
    with pytest.raises(errors.ConfigError, match="--workers=0: must be >= 1"):
        serve_job.serve_job(str(pristine), workers=0)
    with pytest.raises(errors.ConfigError, match="--workers=2 with writes enabled needs --refresh"):
        serve_job.serve_job(str(pristine), workers=2, write_token=TOKEN, refresh_s=0)
    # once, in the parent, as aligner-search says it (it blamed an interrupted indexing job)
    with pytest.raises(errors.MissingPathError, match=r"^--index_dir=.*nope: no such folder"):
        serve_job.serve_job(str(tmp_path / "nope"), workers=2)
    with socket.socket() as taken:  # a port another program listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.ConfigError, match=f"--port={port}: Address already in use"):
            serve_job.serve_job(str(pristine), port=port, workers=2)
        # one worker: refused before the index is loaded (it loaded and warmed it, said it
        # served on the port, then failed)
        monkeypatch.setattr(serve_job, "build_app", lambda *a: pytest.fail("loaded"))
        with pytest.raises(errors.ConfigError, match=f"--port={port}: Address already in use"):
            serve_job.serve_job(str(pristine), port=port)


def test_a_second_multi_worker_server_on_a_port_is_refused(pristine, monkeypatch):
    """SO_REUSEPORT let a second aligner-serve --workers bind the port of a running one (also
    on another index or mode), and the kernel spread the connections over both servers."""
    holder = serve_job._bound_socket("127.0.0.1", 0, reuse_port=True)
    port = holder.getsockname()[1]
    lock = serve_job._lock_port("127.0.0.1", port)  # as the first server holds it
    monkeypatch.setattr(serve_job.multiprocessing, "get_context", lambda *a: pytest.fail("start"))
    try:
        with pytest.raises(
            errors.ConfigError,
            match=rf"--port={port}: another aligner-serve --workers \(pid {os.getpid()}\) "
            "serves this port",
        ):
            serve_job.serve_job(str(pristine), host="0.0.0.0", port=port, workers=2)
    finally:
        lock.close()
        holder.close()
    serve_job._lock_port("127.0.0.1", port).close()  # released with its file


@pytest.mark.slow  # two worker processes loading JAX, the model and the warm-ups: ~60 s
def test_two_workers_answer_alike_and_see_each_others_writes(index_copy):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from fixtures import start_python

    url = f"http://127.0.0.1:{port}"
    proc = start_python(
        "-m", "aligner_jax.serve", f"--index_dir={index_copy}", f"--port={port}",
        "--workers=2", "--threads=1", "--refresh_s=0.3", capture=True,
        ALIGNER_SERVE_WRITE_TOKEN=TOKEN,
    )  # fmt: skip

    def by_worker(body, want=lambda r: True, timeout=120.0) -> dict:
        """Each worker's answer to ``body``: one connection (one worker) per try, until both
        workers answered ``want``."""
        seen, deadline = {}, time.time() + timeout
        while len(seen) < 2:
            assert time.time() < deadline, f"answered by {sorted(seen)} only"
            try:
                with httpx.Client(base_url=url, timeout=60) as c:
                    pid = c.get("/stats").json()["pid"]
                    r = c.post("/search", json=body).json()
            except httpx.TransportError:
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.5)
                continue
            if want(r):
                seen[pid] = [h["doc_id"] for h in r["hits"]]
        return seen

    try:
        query = "slow rivers of ice carving valleys"
        before = by_worker({"query": query, "k": 3})
        (ranking,) = {tuple(v) for v in before.values()}  # both workers: the same ranking
        assert "d9" not in ranking
        r = httpx.post(
            f"{url}/documents", json={"documents": [{"id": "d9", **TOY_DOCS["d9"]}]},
            headers=AUTH, timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        after = by_worker({"query": query, "k": 3}, want=lambda r: r["hits"][0]["doc_id"] == "d9")
        assert set(after) == set(before)  # the same two processes: the other one refreshed
    finally:
        proc.terminate()
        proc.wait(timeout=60)
