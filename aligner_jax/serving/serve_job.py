"""The ``aligner-serve`` job: load an index, build the HTTP app (``http_app``), run uvicorn.

The server binds to 127.0.0.1 unless ``--host`` says otherwise; writes (``POST`` / ``DELETE
/documents``) are accepted only with the write token (``--write_token`` or the environment
variable ``ALIGNER_SERVE_WRITE_TOKEN``) as ``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import ipaddress
import os

import threadpoolctl
import uvicorn
from absl import logging

from aligner_jax.common.errors import ConfigError
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import http_app, index_service

TOKEN_ENV = "ALIGNER_SERVE_WRITE_TOKEN"
MIN_TOKEN_CHARS = 16


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def write_token_from(flag_value: str | None) -> str | None:
    """The write token: the flag, else ``$ALIGNER_SERVE_WRITE_TOKEN``, else none (read-only)."""
    token = flag_value if flag_value is not None else os.environ.get(TOKEN_ENV)
    if token is None:
        return None
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"--write_token: {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    return token


def build_app(
    index_dir: str,
    mode: str = "fast",
    write_token: str | None = None,
    threads: int = 2,
    limits: index_service.ServeLimits | None = None,
    explainer: http_app.Explainer | None = None,
    refresh_s: float = 2.0,
):
    """The FastAPI app of ``index_dir`` (the index loaded once, here)."""
    if threads < 1:
        raise ConfigError(f"--threads={threads}: must be >= 1")
    threadpoolctl.threadpool_limits(threads)

    def loader(directory, encoder):
        return search_lib.Searcher.load(directory, mode=mode, encoder=encoder)

    service = index_service.IndexService(
        index_dir, loader=loader, limits=limits, warm_batches=True, refresh_s=refresh_s
    )
    return http_app.create_app(service, write_token=write_token, explainer=explainer)


def serve_job(
    index_dir: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    write_token: str | None = None,
    mode: str = "fast",
    threads: int = 2,
    limits: dict | None = None,
    explainer: http_app.Explainer | None = None,
    refresh_s: float = 2.0,
) -> str:
    """Runs the server until interrupted; returns what the binary prints at exit.
    ``explainer``: what ``/explain`` and the page's alignments use (the binary passes
    ``evaluation.live_explanation``)."""
    if refresh_s < 0:
        raise ConfigError(f"--refresh_s={refresh_s}: must be >= 0 (0: never)")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port={port}: must be in 0..65535")
    token = write_token_from(write_token)
    limits_obj = index_service.ServeLimits(**(limits or {}))
    if not _is_loopback(host):
        logging.warning(
            "aligner-serve: --host=%s accepts connections from other machines over plain HTTP%s",
            host,
            "; the write token travels in clear: put a TLS proxy in front" if token else "",
        )
    app = build_app(index_dir, mode, token, threads, limits_obj, explainer, refresh_s)
    snap = app.state.service.snapshot
    logging.info(
        "aligner-serve: %s (%d documents), writes %s; http://%s:%d/ (API docs at /docs)",
        index_dir,
        snap.num_docs,
        "enabled (bearer token)" if token else "disabled (no --write_token)",
        host,
        port,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    app.state.service.close()
    return "aligner-serve: stopped"
