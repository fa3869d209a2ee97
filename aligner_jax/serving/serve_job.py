"""The ``aligner-serve`` job: load an index, build the HTTP app (``http_app``), run uvicorn.

The server binds to 127.0.0.1 unless ``--host`` says otherwise; writes (``POST`` / ``DELETE
/documents``) are accepted only with the write token (``--write_token`` or the environment
variable ``ALIGNER_SERVE_WRITE_TOKEN``) as ``Authorization: Bearer TOKEN``.

``--workers=N`` runs N server processes on the one port, each listening on its own
``SO_REUSEPORT`` socket (the kernel spreads the connections over them). Each loads the index
itself — its files are memory-mapped, so the processes share their pages — and has its own
snapshots, batching threads and Python interpreter: the searches of one process share one GIL,
which caps what one process gets from many cores. A write is applied by the worker that
received it (the index directory's writer lock serialises writers across processes: a write
while another is applied is refused with 409) and reaches the other workers when they next
look for changes (``--refresh_s``); ``generation`` in the answers counts each worker's own
snapshots.
"""

from __future__ import annotations

import fcntl
import ipaddress
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import threadpoolctl
import uvicorn
from absl import logging

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.indexing import token_store as ts
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
        source = "--write_token" if flag_value is not None else f"${TOKEN_ENV}"
        raise ConfigError(
            f"{source}: {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
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
    workers: int = 1,
) -> str:
    """Runs the server until interrupted; returns what the binary prints at exit.
    ``explainer``: what ``/explain`` and the page's alignments use (the binary passes
    ``evaluation.live_explanation``); ``workers``: server processes (module docstring)."""
    if refresh_s < 0:
        raise ConfigError(f"--refresh_s={refresh_s}: must be >= 0 (0: never)")
    if workers < 1:
        raise ConfigError(f"--workers={workers}: must be >= 1")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port={port}: must be in 0..65535")
    checks.index_dir(index_dir)
    token = write_token_from(write_token)
    limits_obj = index_service.ServeLimits(**(limits or {}))
    if not _is_loopback(host):
        logging.warning(
            "aligner-serve: --host=%s accepts connections from other machines over plain HTTP%s",
            host,
            "; the write token travels in clear: put a TLS proxy in front" if token else "",
        )
    if workers > 1:
        return _serve_workers(
            workers, host, port,
            dict(index_dir=index_dir, mode=mode, write_token=token, threads=threads,
                 limits=limits_obj, explainer=explainer, refresh_s=refresh_s),
        )  # fmt: skip
    # Bound before the index loads: a port in use fails at once, and --port=0's port is known.
    sock = _bound_socket(host, port, reuse_port=False)
    try:
        app = build_app(index_dir, mode, token, threads, limits_obj, explainer, refresh_s)
    except BaseException:
        sock.close()
        raise
    documents = f"{app.state.service.snapshot.num_docs} documents"
    _log_start(index_dir, documents, token, host, sock.getsockname()[1])
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        app.state.service.close()
    return "aligner-serve: stopped"


def _serve_workers(
    workers: int, host: str, port: int, app_args: dict, target: Callable | None = None
) -> str:
    """``serve_job`` with ``workers`` processes, each with its own listening socket on the port
    (``SO_REUSEPORT``: the kernel spreads new connections over the sockets; one shared socket
    let one worker accept all of a burst of connections, and keep them). A worker listens once
    its app is loaded and warmed, so no connection waits on a worker that is still compiling.
    Runs until interrupted, SIGTERM or a worker's exit (then stops the others). ``target(host,
    port, app_args)`` is what each worker runs (:func:`_worker`; tests pass a stand-in)."""
    if app_args["write_token"] and app_args["refresh_s"] == 0:
        raise ConfigError(
            f"--workers={workers} with writes enabled needs --refresh_s > 0: a worker sees the "
            "writes the others applied only when it looks for changes"
        )
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError(f"--workers={workers}: needs SO_REUSEPORT (Linux); use --workers=1")
    # A missing or broken index fails here in one line, not once in every worker.
    manifest = ts.read_manifest(app_args["index_dir"])
    # Holds the port (bound, not listening: it receives no connections) so that a port in use
    # fails here, and --port=0 picks one port for every worker.
    holder = _bound_socket(host, port, reuse_port=True)
    port = holder.getsockname()[1]
    # SO_REUSEPORT lets another program of this user bind the port too: another aligner-serve
    # --workers would share its connections. Its lock (while this server runs) refuses that.
    port_lock = _lock_port(host, port)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=target or _worker, args=(host, port, app_args), name=f"aligner-serve-{i}"
        )
        for i in range(workers)
    ]
    stored = f"{manifest['counts']['num_docs']} documents stored, {workers} workers"
    _log_start(app_args["index_dir"], stored, app_args["write_token"], host, port)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for proc in procs:
            proc.start()
        while not stop.is_set() and all(proc.is_alive() for proc in procs):
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()  # uvicorn's own SIGTERM handling: a graceful shutdown
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        holder.close()
        port_lock.close()
    failed = [(p.name, p.exitcode) for p in procs if p.exitcode not in (0, -signal.SIGTERM)]
    if failed and not stop.is_set():
        raise RuntimeError(
            f"aligner-serve: worker {failed[0][0]} exited with code {failed[0][1]} (its error is "
            "above); the other workers were stopped"
        )
    return "aligner-serve: stopped"


def _log_start(index_dir: str, what: str, token: str | None, host: str, port: int) -> None:
    logging.info(
        "aligner-serve: %s (%s), writes %s; http://%s:%d/ (API docs at /docs)",
        index_dir,
        what,
        "enabled (bearer token)" if token else "disabled (no --write_token)",
        host,
        port,
    )


def _lock_port(host: str, port: int):
    """An exclusive lock on ``aligner-serve-port-PORT.lock`` in the temporary folder (any host:
    sockets on 0.0.0.0 and 127.0.0.1 share a port), held by the returned open file (closing it
    releases it); refuses a port another aligner-serve --workers holds."""
    path = Path(tempfile.gettempdir()) / f"aligner-serve-port-{port}.lock"
    f = open(path, "a+")  # noqa: SIM115 - held open for the server's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ConfigError(
            f"--host={host} --port={port}: another aligner-serve --workers (pid {holder}) "
            "serves this port; stop it or choose another port"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def _bound_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A socket bound to (host, port), not yet listening (uvicorn listens); ``reuse_port``:
    with ``SO_REUSEPORT`` (``--workers``: one socket per worker on the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--host={host} --port={port}: {e.strerror}") from e
    return sock


def _worker(host: str, port: int, app_args: dict) -> None:
    """One ``--workers`` process: loads the app (index, model, warm-ups), then listens."""
    app = build_app(**app_args)
    sock = _bound_socket(host, port, reuse_port=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.service.close()
