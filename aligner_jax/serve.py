r"""HTTP server binary (``aligner-serve``): one index behind a JSON API and a search page.

  python -m aligner_jax.serve --index_dir=outputs/zero_shot_scifact/index
  curl -s localhost:8080/search -H 'Content-Type: application/json' \
    -d '{"query": "statins reduce heart risk", "k": 5}'
  # the search page with live alignments: http://127.0.0.1:8080/ ; API docs: /docs

  ALIGNER_SERVE_WRITE_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe())') \
    python -m aligner_jax.serve --index_dir=DIR --port=8081
  # writes: POST/DELETE /documents with the header 'Authorization: Bearer TOKEN'

Endpoints: ``POST /search`` {query, k, offset, filter}, ``POST /explain`` {query, doc_id},
``GET /health``, ``GET /stats``, ``POST /documents`` {documents: [{id, text, title, metadata}]},
``DELETE /documents`` {ids}. Binds to 127.0.0.1 by default; writes are refused unless a write
token is set (``--write_token`` or ``$ALIGNER_SERVE_WRITE_TOKEN``). Details: serving/http_app.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.evaluation import live_explanation
from aligner_jax.serving import http_app, index_service, serve_job

FLAGS = flags.FLAGS
flags.DEFINE_string("index_dir", None, "The index folder to serve (aligner-index / aligner-eval).")
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (127.0.0.1: this machine only).")
flags.DEFINE_integer("port", 8080, "TCP port.")
flags.DEFINE_string("write_token", None, f"Token enabling writes (or ${serve_job.TOKEN_ENV}).")
flags.DEFINE_enum("mode", "fast", ["fast", "exhaustive", "device"],
                  "Compressed index, every document, or every document on the accelerators.")  # fmt: skip
flags.DEFINE_integer("threads", 2, "BLAS threads of the search.")
flags.DEFINE_integer("workers", 1, "Server processes on the port (serving/serve_job.py).")
flags.DEFINE_float("refresh_s", 2.0, "Seconds between looks for other writers' changes (0: off).")
_LIMITS = index_service.ServeLimits()
flags.DEFINE_integer("max_k", _LIMITS.max_k, "Largest k of a search.")
flags.DEFINE_integer("max_offset", _LIMITS.max_offset, "Largest offset of a search.")
flags.DEFINE_integer("max_query_chars", _LIMITS.max_query_chars, "Longest query (characters).")
flags.DEFINE_integer("max_request_bytes", _LIMITS.max_request_bytes, "Largest search body.")
flags.DEFINE_integer("max_write_bytes", _LIMITS.max_write_bytes, "Largest POST /documents body.")
flags.DEFINE_integer("max_documents", _LIMITS.max_documents, "Most documents per write.")
flags.DEFINE_integer("max_batch", _LIMITS.max_batch, "Most queries encoded together.")
flags.DEFINE_integer("search_threads", _LIMITS.search_threads, "Threads running the batches.")
LIMIT_FLAGS = ("max_k", "max_offset", "max_query_chars", "max_request_bytes", "max_write_bytes",
               "max_documents", "max_batch", "search_threads")  # fmt: skip


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.index_dir:
        raise app.UsageError("--index_dir is required")
    out = cli.run_job(
        "aligner-serve",
        serve_job.serve_job,
        on_interrupt="the index was not changed by the interruption",
        index_dir=FLAGS.index_dir,
        host=FLAGS.host,
        port=FLAGS.port,
        write_token=FLAGS.write_token,
        mode=FLAGS.mode,
        threads=FLAGS.threads,
        limits={name: FLAGS[name].value for name in LIMIT_FLAGS},
        refresh_s=FLAGS.refresh_s,
        workers=FLAGS.workers,
        explainer=http_app.Explainer(live_explanation.explain_hit, live_explanation.CSS),
    )
    print(out)


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
