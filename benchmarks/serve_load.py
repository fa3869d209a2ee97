r"""Load test of ``aligner-serve`` (issue 25, item 4's acceptance): concurrent clients, and a
writer adding documents while they search.

  .venv/bin/python benchmarks/serve_load.py --index_dir=outputs/zero_shot_scifact/index \
    --queries=../shared/data/beir/scifact/queries.jsonl --clients=1,4,16 --duration=60

1. The binary serves ``--index_dir`` on a free 127.0.0.1 port. For each client count C, C
   closed-loop clients (httpx asyncio, one connection each, next request when the last one is
   answered) send ``POST /search`` (k=10) with the queries in turn for ``--duration`` seconds
   after a warm-up: latency p50/p95/p99 (client side, HTTP included), queries/s, errors.
2. The writer phase, on a copy of the index (``--work_dir``; the original is not touched): the
   ``--write_clients`` clients search a fixed set of queries whose answers were recorded first
   (snapshot 0), one ``POST /documents`` adds ``--writer_docs`` documents (copies of corpus
   documents under new ids, so that they enter the rankings), and the clients go on until
   ``--duration`` seconds have passed and the write is done (the copies are of the queries' best
   documents first, so that the write changes their answers). Afterwards the answers of snapshot 1
   are recorded; every answer given during the phase must equal (same ids in the same order,
   scores within 1e-4; near-tied documents may swap) the answer of the snapshot it names, and
   name snapshot 0 or 1.

Results: ``--output`` .json / .md / .png (``benchmarks/results/serve_load.*``), with ``uptime``
(load averages) before and after each phase: the machine is shared, say whether it was busy.
The client runs on the same machine as the server (2 cores here), which it shares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aligner_jax.common import fileio  # noqa: E402
from aligner_jax.data import beir  # noqa: E402
from aligner_jax.evaluation import plotting  # noqa: E402

SCORE_TOLERANCE = 1e-4  # a query encoded in batches of other sizes: float rounding


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``aligner-serve`` in a subprocess on a free localhost port."""

    def __init__(
        self,
        index_dir: str,
        token: str | None = None,
        threads: int = 2,
        search_threads: int = 1,
        mode: str = "fast",
        workers: int = 1,
    ):
        self.port = free_port()
        self.workers = workers
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if token:
            env["ALIGNER_SERVE_WRITE_TOKEN"] = token
        cmd = [sys.executable, "-m", "aligner_jax.serve", f"--index_dir={index_dir}"]
        cmd += [f"--port={self.port}", f"--threads={threads}", "--max_write_bytes=67108864"]
        cmd += [f"--search_threads={search_threads}", f"--mode={mode}", f"--workers={workers}"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"aligner-serve exited with {self.proc.returncode}")
            try:
                self.health = httpx.get(f"{self.url}/health", timeout=5).json()
                self.counts(deadline)  # every worker up
                return
            except httpx.TransportError:
                time.sleep(1.0)
        raise SystemExit("aligner-serve did not start")

    def counts(self, deadline: float | None = None) -> dict[int, dict]:
        """Each worker's ``/stats`` counts so far, by pid (a new connection per request reaches
        any worker: asked until every worker answered, or ``deadline``, default 60 s)."""
        deadline = deadline or time.time() + 60
        found: dict[int, dict] = {}
        while True:
            stats = httpx.get(f"{self.url}/stats", timeout=60).json()
            found[stats["pid"]] = stats["counts"]
            if len(found) == self.workers:
                return found
            if time.time() > deadline:
                raise SystemExit(
                    f"aligner-serve: /stats reached {len(found)} of {self.workers} workers"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def percentiles(values) -> dict:
    v = np.asarray(values, np.float64)
    if not len(v):
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    return {
        "p50": round(float(np.percentile(v, 50)), 2),
        "p95": round(float(np.percentile(v, 95)), 2),
        "p99": round(float(np.percentile(v, 99)), 2),
        "mean": round(float(v.mean()), 2),
    }


async def closed_loop(url, queries, clients, duration, k, record=None, until=None):
    """``clients`` closed-loop clients for ``duration`` s (and until ``until()`` is true)."""
    latencies, errors, served_ms = [], [], []
    start = time.perf_counter()
    counter = iter(range(1 << 62))

    async def client(c):
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            while time.perf_counter() - start < duration or (until is not None and not until()):
                q = queries[next(counter) % len(queries)]
                t = time.perf_counter()
                try:
                    r = await http.post("/search", json={"query": q, "k": k})
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                    continue
                ms = 1000.0 * (time.perf_counter() - t)
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                body = r.json()
                latencies.append(ms)
                served_ms.append(body["took_ms"])
                if record is not None:
                    record.append((q, body["generation"], _answer(body)))

    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - start
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "searches": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:5],
        "queries_per_s": round(len(latencies) / elapsed, 2),
        "latency_ms": percentiles(latencies),
        "server_took_ms": percentiles(served_ms),
    }


def _answer(body) -> tuple:
    return tuple((h["doc_id"], h["score"]) for h in body["hits"])


def answers_of(url, queries, k) -> dict:
    """Each query's answer and the snapshot that gave it, one query at a time."""
    out = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for q in queries:
            body = http.post("/search", json={"query": q, "k": k}).json()
            out[q] = (body["generation"], _answer(body))
    return out


def same_answer(a: tuple, b: tuple) -> bool:
    """The same ranking up to float rounding: position-wise scores within ``SCORE_TOLERANCE``,
    each shared document's score too, and documents in only one of them tied (within the
    tolerance) with the last hit: near-equal scores (a document and its copy) may swap places
    when the query is encoded in another batch."""
    if len(a) != len(b):
        return False
    if any(abs(x - y) > SCORE_TOLERANCE for (_, x), (_, y) in zip(a, b, strict=True)):
        return False
    score_a, score_b = dict(a), dict(b)
    for doc in score_a.keys() & score_b.keys():
        if abs(score_a[doc] - score_b[doc]) > SCORE_TOLERANCE:
            return False
    last = min(a[-1][1], b[-1][1]) if a else 0.0
    only = [score_a.get(d, score_b.get(d)) for d in score_a.keys() ^ score_b.keys()]
    return all(abs(score - last) <= SCORE_TOLERANCE for score in only)


def writer_phase(args, queries, token) -> dict:
    work = Path(args.work_dir)
    copy = work / "index"
    if copy.exists():
        shutil.rmtree(copy)
    work.mkdir(parents=True, exist_ok=True)
    shutil.copytree(args.index_dir, copy)
    corpus = beir.load_corpus(args.corpus)
    fixed = queries[: args.consistency_queries]
    server = Server(str(copy), token, args.threads, args.search_threads, args.mode)
    try:
        asyncio.run(closed_loop(server.url, fixed, args.write_clients, args.warmup, args.k))
        before = answers_of(server.url, fixed, args.k)
        assert {g for g, _ in before.values()} == {0}
        # Copies (new ids) of the queries' best documents first, so that the write changes
        # their answers, then of other documents.
        firsts = [answer[0][0] for _, answer in before.values() if answer]
        chosen = list(dict.fromkeys(firsts + list(corpus)))[: args.writer_docs]
        new_docs = [
            {"id": f"copy-{d}", "title": corpus[d].title, "text": corpus[d].text} for d in chosen
        ]
        record, write = [], {}
        load_before = uptime()

        async def run():
            async def writer():
                await asyncio.sleep(args.write_after)
                async with httpx.AsyncClient(base_url=server.url, timeout=3600) as http:
                    t = time.perf_counter()
                    r = await http.post(
                        "/documents",
                        json={"documents": new_docs},
                        headers={"Authorization": f"Bearer {token}"},
                    )
                    write.update(
                        status=r.status_code,
                        seconds=round(time.perf_counter() - t, 2),
                        answer=r.json(),
                        started_s=args.write_after,
                    )

            search = closed_loop(
                server.url,
                fixed,
                args.write_clients,
                args.duration,
                args.k,
                record=record,
                until=lambda: bool(write),
            )
            result, _ = await asyncio.gather(search, writer())
            return result

        phase = asyncio.run(run())
        load_after = uptime()
        after = answers_of(server.url, fixed, args.k)
        assert {g for g, _ in after.values()} == {1}, "the write did not publish snapshot 1"
        expected = {
            0: {q: a for q, (_, a) in before.items()},
            1: {q: a for q, (_, a) in after.items()},
        }
        by_generation, inconsistent = {}, []
        for q, generation, answer in record:
            by_generation[generation] = by_generation.get(generation, 0) + 1
            if generation not in expected or not same_answer(answer, expected[generation][q]):
                inconsistent.append({"query": q, "generation": generation})
        changed = sum(not same_answer(before[q][1], after[q][1]) for q in fixed)
    finally:
        server.stop()
        shutil.rmtree(copy, ignore_errors=True)
    return {
        **phase,
        "write": write,
        "documents_added": len(new_docs),
        "consistency_queries": len(fixed),
        "answers_changed_by_the_write": changed,
        "answers_by_snapshot": {str(g): n for g, n in sorted(by_generation.items())},
        "inconsistent_answers": len(inconsistent),
        "inconsistent_examples": inconsistent[:5],
        "uptime_before": load_before,
        "uptime_after": load_after,
    }


def write_markdown(result, path: Path) -> None:
    lines = [
        "# aligner-serve under load (benchmarks/serve_load.py)",
        "",
        f"Index `{result['index_dir']}` ({result['num_docs']} documents), k = {result['k']}, "
        f"{result['num_queries']} queries in turn, aligner-serve "
        f"`--mode={result['server_flags'].get('mode', 'fast')}` "
        f"`--workers={result['server_flags'].get('workers', 1)}`, closed-loop clients (httpx asyncio) on the same "
        f"machine as the server ({result['machine']}). Latency is the client's (HTTP included).",
        "",
        "| clients | searches | queries/s | p50 ms | p95 ms | p99 ms | errors | server p50 ms | mean batch | searches by worker | load before → after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in result["phases"]:
        lat, srv = p["latency_ms"], p["server_took_ms"]
        lines.append(
            f"| {p['clients']} | {p['searches']} | {p['queries_per_s']} | {lat['p50']} | "
            f"{lat['p95']} | {lat['p99']} | {p['errors']} | {srv['p50']} | {p.get('mean_batch')} | "
            f"{' / '.join(map(str, p.get('searches_by_worker', [])))} | "
            f"{_load(p['uptime_before'])} → {_load(p['uptime_after'])} |"
        )
    w = result.get("writer")
    if w:
        lat = w["latency_ms"]
        lines += [
            "",
            f"## {w['clients']} clients searching while one writer adds {w['documents_added']} documents",
            "",
            f"- write: `POST /documents` of {w['documents_added']} documents answered "
            f"{w['write'].get('status')} in {w['write'].get('seconds')} s (started after "
            f"{w['write'].get('started_s')} s)",
            f"- searches: {w['searches']} in {w['seconds']} s ({w['queries_per_s']} queries/s), "
            f"failed: {w['errors']}; p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms",
            f"- answers by snapshot: {w['answers_by_snapshot']}; inconsistent with their snapshot: "
            f"{w['inconsistent_answers']} (of {w['consistency_queries']} queries, "
            f"{w['answers_changed_by_the_write']} have a different answer after the write)",
            f"- load: {_load(w['uptime_before'])} → {_load(w['uptime_after'])}",
        ]
    goal = result["goal"]
    lines += [
        "",
        f"Goal: p95 at 16 clients ≤ 60 ms: **{goal['p95_16_ms']} ms** "
        f"({'met' if goal['p95_met'] else 'not met'}); queries/s at 16 clients ≥ 2× one client: "
        f"**{goal['speedup_16_vs_1']}×** ({'met' if goal['speedup_met'] else 'not met'}).",
        "",
    ]
    fileio.atomic_write_text(path, "\n".join(lines))


def _flags(result) -> str:
    """The server's flags as a command line (``--mode=fast --workers=2 --threads=1 ...``)."""
    return " ".join(f"--{k}={v}" for k, v in result["server_flags"].items())


def _load(uptime_line: str) -> str:
    return uptime_line.split("load average:")[-1].strip() if uptime_line else ""


def plot(result, path: Path) -> None:
    plt = plotting.pyplot()

    phases = result["phases"]
    labels = [str(p["clients"]) for p in phases]
    writer = result.get("writer")
    if writer:
        labels.append(f"{writer['clients']} + writer")
        phases = phases + [writer]
    x = np.arange(len(phases))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (q, color) in enumerate((("p50", "#1f5fbf"), ("p95", "#ef6c00"), ("p99", "#c62828"))):
        ax.bar(
            x + (i - 1) * 0.27,
            [p["latency_ms"][q] or 0 for p in phases],
            0.27,
            label=q,
            color=color,
        )
    ax.axhline(60, color="#555", ls="--", lw=1, label="goal p95 ≤ 60 ms (16 clients)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("latency (ms, client side)")
    ax.legend(fontsize=8)
    bx.bar(x, [p["queries_per_s"] for p in phases], color="#2e7d32")
    for i, p in enumerate(phases):
        bx.annotate(
            f"{p['queries_per_s']:.0f}",
            (i, p["queries_per_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    bx.set_xticks(x, labels)
    bx.set_xlabel("concurrent clients")
    bx.set_ylabel("queries / s")
    fig.suptitle(
        f"aligner-serve {_flags(result)}, {result['num_docs']} documents, k={result['k']} "
        f"({result['machine']})",
        fontsize=10,
    )
    fig.tight_layout()
    plotting.save(fig, path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index_dir", default=str(REPO / "outputs/zero_shot_scifact/index"))
    p.add_argument("--queries", default=str(REPO.parent / "shared/data/beir/scifact/queries.jsonl"))
    p.add_argument("--corpus", default=str(REPO.parent / "shared/data/beir/scifact/corpus.jsonl"))
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="aligner-serve --threads (BLAS)")
    p.add_argument("--search_threads", type=int, default=1, help="aligner-serve --search_threads")
    p.add_argument("--workers", type=int, default=1,
                   help="aligner-serve --workers (the search phases; the writer phase runs one)")  # fmt: skip
    p.add_argument("--mode", default="fast", choices=["fast", "exhaustive", "device"],
                   help="aligner-serve --mode (device: the exact search on the accelerators)")  # fmt: skip
    p.add_argument("--writer_docs", type=int, default=1000)
    p.add_argument("--write_clients", type=int, default=16)
    p.add_argument("--write_after", type=float, default=5.0)
    p.add_argument("--consistency_queries", type=int, default=300)
    p.add_argument("--no_writer", action="store_true")
    p.add_argument("--work_dir", default=str(REPO / "outputs/serve_load"))
    p.add_argument("--output", default=str(REPO / "benchmarks/results/serve_load"))
    args = p.parse_args()

    queries = [text for _, text in beir.iter_queries(args.queries)]
    counts = [int(c) for c in args.clients.split(",")]
    result = {
        "index_dir": args.index_dir,
        "k": args.k,
        "num_queries": len(queries),
        "duration_s": args.duration,
        "machine": f"{os.cpu_count()} cores, shared",
        "server_flags": {
            "threads": args.threads,
            "search_threads": args.search_threads,
            "mode": args.mode,
            "workers": args.workers,
        },
        "uptime_start": uptime(),
        "phases": [],
    }
    server = Server(args.index_dir, threads=args.threads, search_threads=args.search_threads,
                    mode=args.mode, workers=args.workers)  # fmt: skip
    result["num_docs"] = server.health["num_docs"]
    try:
        asyncio.run(closed_loop(server.url, queries, max(counts), args.warmup, args.k))
        for c in counts:
            before, counts_before = uptime(), server.counts()
            phase = asyncio.run(closed_loop(server.url, queries, c, args.duration, args.k))
            counts_after = server.counts()
            phase.update(uptime_before=before, uptime_after=uptime())
            delta = {
                name: [counts_after[w].get(name, 0) - counts_before[w].get(name, 0)
                       for w in sorted(counts_after)]
                for name in ("batches", "batched_queries", "searches")
            }  # fmt: skip
            phase["mean_batch"] = round(
                sum(delta["batched_queries"]) / max(sum(delta["batches"]), 1), 2
            )
            # the clients' connections are spread over the workers when they connect, and stay
            phase["searches_by_worker"] = sorted(delta["searches"], reverse=True)
            result["phases"].append(phase)
            print(json.dumps(phase), flush=True)
        result["server_stats"] = httpx.get(f"{server.url}/stats", timeout=30).json()
    finally:
        server.stop()
    if not args.no_writer:
        result["writer"] = writer_phase(args, queries, secrets.token_urlsafe(24))
        print(json.dumps(result["writer"]), flush=True)
    by_clients = {p["clients"]: p for p in result["phases"]}
    p16, p1 = by_clients.get(16), by_clients.get(1)
    speedup = round(p16["queries_per_s"] / p1["queries_per_s"], 2) if p16 and p1 else None
    result["goal"] = {
        "p95_16_ms": p16["latency_ms"]["p95"] if p16 else None,
        "p95_met": bool(p16 and p16["latency_ms"]["p95"] <= 60.0),
        "speedup_16_vs_1": speedup,
        "speedup_met": bool(speedup and speedup >= 2.0),
    }
    result["uptime_end"] = uptime()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(out.with_suffix(".json"), result)
    write_markdown(result, out.with_suffix(".md"))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}.json / .md / .png")
    failed = any(p["errors"] for p in result["phases"]) or (
        "writer" in result
        and (result["writer"]["errors"] or result["writer"]["inconsistent_answers"])
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
