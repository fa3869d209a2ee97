#!/usr/bin/env python
"""Build and search one peer multi-vector engine (FastPlaid or XTR-WARP) on CPU or a GPU.

Run with the peer virtualenv, never with the aligner_jax environment:

    /work/peer-venv/bin/python benchmarks/peers/run_peer.py \
        --system fast-plaid --vectors DIR --work_dir DIR --threads 2 --k 100 \
        --out result.json [--setting nbits=2 --setting n_ivf_probe=16 ...] \
        [--sweep '[{"n_ivf_probe": 1, "n_full_scores": 256}, {"n_ivf_probe": 8}]'] \
        [--retry_setting codec_sample_max_tokens=856337 ...]

This file imports only numpy, torch and the peer package (no aligner_jax).

``--sweep`` (a JSON list of objects of search settings, or ``@FILE`` holding one) searches every
query at every listed setting with the index built (or reused) once: one entry per setting in
the output's ``sweep`` list (``--setting`` search keys are the base each entry overrides). A
setting whose search fails is recorded with its error and the next one runs.
``--retry_setting`` (build or load keys, repeatable): if the build fails, it is retried once
with these settings on top of ``--setting``'s; ``build_attempts`` records every attempt
(settings, error) and ``build_settings`` the ones the index was built with.

Input folder (``--vectors``):
    doc_vectors.npy    float16 [T, D]   L2-normalised token vectors, all docs concatenated
    doc_offsets.npy    int64   [N+1]    doc i = rows offsets[i]:offsets[i+1]
    doc_ids.json       list of N strings
    query_vectors.npy  float16 [Tq, D]
    query_offsets.npy  int64   [Q+1]
    query_ids.json     list of Q strings

Output JSON keys: system, setting, settings, threads, k, phase ("done" or the
phase that failed), build_s, load_s (opening the built index afresh),
index_bytes (all files in the index folder), index_bytes_search (without the
copies kept only for later updates), index_files, num_docs, num_tokens, dim,
build_settings, build_attempts, sweep ([{setting, settings, latency_ms, cpu_ms,
results, params, load_avg_1m, error}], one per --sweep entry; the top-level
latency_ms / cpu_ms / results / params are the first entry's),
peak_rss_bytes (ru_maxrss, whole run), peak_rss_build_bytes (ru_maxrss after
the build), rss_after_search_bytes, latency_ms (wall, one per query, batch 1,
after one untimed warm-up query), cpu_ms (process CPU time per query, all
threads; helps spot a busy machine), results ({qid: [[doc_id, score], ...]}),
params (effective build/search parameters), versions, error.

The work runs in a child process under a supervisor, so a failure of any kind
is recorded as ``"error": "<ExceptionType>: <message>"`` with exit status 0:
a Python exception in the peer, ``--time_limit_s`` running out
(``TimeoutError``), the child dying (segfault, OOM killer:
``ChildProcessError``), or the supervisor getting SIGTERM/SIGINT
(``Interrupted``; the child is killed too).  Only bad command-line usage
(e.g. an unknown ``--setting``) exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

# --------------------------------------------------------------------------
# Settings: which --setting NAME=VALUE keys each system accepts, and where
# they go.  Keys not listed are rejected (exit 2) so typos don't silently run
# the defaults.
# --------------------------------------------------------------------------
SETTINGS = {
    "fast-plaid": {
        # FastPlaid.create(...) kwargs
        "build": {
            "nbits": "nbits",  # default 4
            "kmeans_niters": "kmeans_niters",  # default 4
            "max_points_per_centroid": "max_points_per_centroid",  # default 256
            "n_samples_kmeans": "n_samples_kmeans",  # default None -> heuristic
            "seed": "seed",  # default 42
            "build_batch_size": "batch_size",  # default 25_000
            "start_from_scratch": "start_from_scratch",  # default 1000
        },
        # FastPlaid(...) constructor kwargs
        "load": {},
        # FastPlaid.search(...) kwargs
        "search": {
            "n_ivf_probe": "n_ivf_probe",  # default 8
            "n_full_scores": "n_full_scores",  # default 4096
            "search_batch_size": "batch_size",  # default "auto"
        },
    },
    "xtr-warp": {
        # XTRWarp.create(...) kwargs
        "build": {
            "nbits": "nbits",  # default 4
            "kmeans_niters": "kmeans_niters",  # default 4
            "max_points_per_centroid": "max_points_per_centroid",  # default 256
            "n_samples_kmeans": "n_samples_kmeans",  # default None -> heuristic
            "seed": "seed",  # default 42
            "num_partitions": "num_partitions",  # default None -> heuristic
            "codec_sample_max_tokens": "codec_sample_max_tokens",  # default 1_000_000
            "indexing_chunk_size": "indexing_chunk_size",  # default 256
            "compression_batch_size": "compression_batch_size",  # default 32_768
            "kmeans_sample_max_bytes": "kmeans_sample_max_bytes",  # default 2 GiB
            # True: create() streams the documents from a folder of .npy files with .doclens.npy
            # sidecars (its README's "Streaming from Disk" for large datasets) instead of a list
            # of tensors; handled here, not a create() keyword.
            "embeddings_from_disk": "embeddings_from_disk",
        },
        # XTRWarp.load(...) kwargs
        "load": {
            "dtype": "dtype",  # default float32 ("float16" accepted)
            "mmap": "mmap",  # default True on cpu
        },
        # XTRWarp.search(...) kwargs; None -> xtr_warp.hyperparams.optimize()
        "search": {
            "nprobe": "nprobe",
            "bound": "bound",
            "t_prime": "t_prime",
            "max_candidates": "max_candidates",
            "centroid_score_threshold": "centroid_score_threshold",
            "num_threads": "num_threads",  # default here: --threads (library default 1)
            "search_batch_size": "batch_size",  # default 8192
        },
    },
}


def _parse_value(text: str):
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low == "true":
        return True
    if low == "false":
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_settings(system: str, items: list[str]) -> tuple[dict, dict, dict, dict]:
    """Return (raw, build_kwargs, load_kwargs, search_kwargs)."""
    raw: dict = {}
    groups = {"build": {}, "load": {}, "search": {}}
    table = SETTINGS[system]
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--setting needs NAME=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        name = name.strip()
        for group, keys in table.items():
            if name in keys:
                groups[group][keys[name]] = _parse_value(value.strip())
                raw[name] = _parse_value(value.strip())
                break
        else:
            known = sorted(k for keys in table.values() for k in keys)
            raise SystemExit(f"unknown setting {name!r} for {system}; known: {', '.join(known)}")
    return raw, groups["build"], groups["load"], groups["search"]


def setting_label(raw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in raw.items()) or "default"


def parse_sweep(system: str, text: str | None, base: dict) -> list[tuple[str, dict, dict]]:
    """(label, raw settings, search kwargs) of every ``--sweep`` entry (one entry of the
    ``--setting`` search keys alone without ``--sweep``); build or load keys are refused."""
    if not text:
        return [(setting_label(base), dict(base), _search_kwargs(system, base))]
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--sweep: not JSON ({exc}); give a list of objects") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SystemExit('--sweep: expected a JSON list of objects, e.g. [{"n_ivf_probe": 1}]')
    out = []
    for entry in entries:
        unknown = sorted(set(entry) - set(SETTINGS[system]["search"]))
        if unknown:
            known = ", ".join(sorted(SETTINGS[system]["search"]))
            raise SystemExit(
                f"--sweep: {unknown[0]!r} is not a search setting of {system}; known: {known}"
            )
        raw = {**base, **entry}
        out.append((setting_label(entry), raw, _search_kwargs(system, raw)))
    return out


def _search_kwargs(system: str, raw: dict) -> dict:
    table = SETTINGS[system]["search"]
    return {table[k]: v for k, v in raw.items() if k in table}


def dir_bytes(path: str) -> tuple[int, dict]:
    total = 0
    files = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            size = os.path.getsize(full)
            total += size
            files[os.path.relpath(full, path)] = size
    return total, files


def peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True, choices=sorted(SETTINGS))
    ap.add_argument("--vectors", required=True, help="input vector folder")
    ap.add_argument("--work_dir", required=True, help="folder for the peer index")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="torch device the peer builds, loads and searches on (cuda: a GPU host)",
    )
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a build/load/search parameter (repeatable)",
    )
    ap.add_argument(
        "--reuse_index",
        action="store_true",
        help="skip the build when work_dir/index holds a finished index (work_dir/build.json, "
        "written when a build finishes, gives its build_s)",
    )
    ap.add_argument(
        "--max_queries",
        type=int,
        default=None,
        help="search only the first N queries (after the warm-up)",
    )
    ap.add_argument(
        "--time_limit_s",
        type=float,
        default=0,
        help="kill the run after this many seconds and record a TimeoutError (0 = no limit)",
    )
    ap.add_argument(
        "--sweep",
        default=None,
        help="JSON list of objects of search settings (or @FILE): each is searched in turn",
    )
    ap.add_argument(
        "--retry_setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="build/load settings of one retry if the build fails (repeatable)",
    )
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    raw, build_kw, load_kw, search_kw = parse_settings(args.system, args.setting)
    retry_raw, retry_build, retry_load, retry_search = parse_settings(
        args.system, args.retry_setting
    )
    if retry_search:
        raise SystemExit(f"--retry_setting: {sorted(retry_search)} are search settings")
    search_raw = {k: v for k, v in raw.items() if k in SETTINGS[args.system]["search"]}
    sweep = parse_sweep(args.system, args.sweep, search_raw)
    result = new_result(args, raw)

    if not args._child:
        return supervise(args, result, argv)
    retry = (retry_raw, retry_build, retry_load) if args.retry_setting else None
    return work(args, result, build_kw, load_kw, sweep, retry)


def new_result(args, raw) -> dict:
    return {
        "system": args.system,
        "setting": ",".join(f"{k}={v}" for k, v in raw.items()) or "default",
        "settings": raw,
        "threads": args.threads,
        "device": args.device,
        "k": args.k,
        "phase": "start",
        "build_s": None,
        "load_s": None,
        "index_bytes": None,
        "index_files": None,
        "index_bytes_search": None,
        "num_docs": None,
        "num_tokens": None,
        "dim": None,
        "peak_rss_bytes": None,
        "latency_ms": [],
        "cpu_ms": [],
        "results": {},
        "params": {},
        "versions": {},
        "build_settings": None,
        "build_attempts": [],
        "sweep": [],
        "error": None,
    }


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def supervise(args, result, argv) -> int:
    """Run the work in a child process; record timeouts and crashes as errors.

    The child writes ``OUT.partial`` at every phase change and ``OUT`` at the
    end.  If the child is killed (time limit, OOM killer, segfault) the parent
    writes ``OUT`` from the last partial state with an ``error``.
    """
    import resource
    import signal
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    for path in (args.out, args.out + ".partial"):
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_child"]
    proc = subprocess.Popen(cmd, start_new_session=True)

    class _Terminated(Exception):
        pass

    def _on_term(signum, _frame):
        raise _Terminated(signal.Signals(signum).name)

    # If this supervisor is told to stop (e.g. by `timeout`), take the child
    # (its own session) down with it and still write a result.
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_term)
    error = None
    try:
        proc.wait(timeout=args.time_limit_s or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        error = f"TimeoutError: time limit of {args.time_limit_s:g} s exceeded"
    except (KeyboardInterrupt, _Terminated) as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        error = f"Interrupted: supervisor received {exc or 'SIGINT'}"
    if error is None and os.path.exists(args.out):
        if os.path.exists(args.out + ".partial"):
            os.remove(args.out + ".partial")
        return 0
    if error is None:
        rc = proc.returncode
        how = f"signal {-rc} ({signal.Signals(-rc).name})" if rc < 0 else f"exit code {rc}"
        error = f"ChildProcessError: peer process died with {how} and wrote no result"
    if os.path.exists(args.out + ".partial"):
        with open(args.out + ".partial") as f:
            result = json.load(f)
        os.remove(args.out + ".partial")
    result["error"] = f"{error} (during {result.get('phase')})"
    # The partial file holds the RSS of its last phase change; the kernel's
    # figure for the (reaped) child is the true peak.
    result["peak_rss_bytes"] = max(
        result.get("peak_rss_bytes") or 0,
        int(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024,
    )
    write_json(args.out, result)
    print(result["error"], file=sys.stderr)
    return 0


def _die_with_parent() -> None:
    """Linux: SIGKILL this child if the supervising parent dies (best effort)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


def _error_text(exc: BaseException) -> str:
    """'<Type>: <first line> ... <last line>' (at most 2000 characters of message)."""
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt: interrupted"
    msg = str(exc).strip().splitlines()
    text = msg[0] if msg else ""
    if len(msg) > 1 and msg[-1] != text:
        text = f"{text} ... {msg[-1].strip()}"
    return f"{type(exc).__name__}: {text[:2000]}"


def work(args, result, build_kw, load_kw, sweep, retry=None) -> int:
    _die_with_parent()
    # Thread limits must be in the environment before torch / the Rust
    # extensions start their pools.
    n = str(max(1, args.threads))
    for var in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "RAYON_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    ):
        os.environ[var] = n

    def write():
        result["peak_rss_bytes"] = peak_rss_bytes()
        write_json(args.out, result)

    def phase(name):
        result["phase"] = name
        result["peak_rss_bytes"] = peak_rss_bytes()
        write_json(args.out + ".partial", result)

    try:
        import numpy as np
        import torch

        torch.set_num_threads(args.threads)
        phase("load_inputs")
        result["versions"] = {"torch": torch.__version__, "numpy": np.__version__}

        vec = args.vectors
        doc_vectors = np.load(os.path.join(vec, "doc_vectors.npy"))
        doc_offsets = np.load(os.path.join(vec, "doc_offsets.npy")).astype(np.int64)
        with open(os.path.join(vec, "doc_ids.json")) as f:
            doc_ids = json.load(f)
        query_vectors = np.load(os.path.join(vec, "query_vectors.npy"))
        query_offsets = np.load(os.path.join(vec, "query_offsets.npy")).astype(np.int64)
        with open(os.path.join(vec, "query_ids.json")) as f:
            query_ids = json.load(f)
        n_docs = len(doc_offsets) - 1
        if len(doc_ids) != n_docs:
            raise ValueError(f"doc_ids has {len(doc_ids)} entries, offsets {n_docs}")
        if len(query_ids) != len(query_offsets) - 1:
            raise ValueError("query_ids and query_offsets disagree")
        result["num_docs"] = n_docs
        result["num_tokens"] = int(doc_vectors.shape[0])
        result["dim"] = int(doc_vectors.shape[1])

        # Peers take a list of per-document tensors.  Materialise the fp16
        # matrix once and slice views (no per-doc copies).
        doc_matrix = torch.from_numpy(np.ascontiguousarray(doc_vectors, dtype=np.float16))
        doc_list = [
            doc_matrix[int(doc_offsets[i]) : int(doc_offsets[i + 1])] for i in range(n_docs)
        ]
        q_all = torch.from_numpy(np.ascontiguousarray(query_vectors, dtype=np.float16))
        queries = [
            q_all[int(query_offsets[i]) : int(query_offsets[i + 1])] for i in range(len(query_ids))
        ]
        if args.max_queries is not None:
            queries = queries[: args.max_queries]
            query_ids = query_ids[: args.max_queries]

        index_dir = os.path.join(args.work_dir, "index")
        os.makedirs(args.work_dir, exist_ok=True)

        runner = FastPlaidRunner if args.system == "fast-plaid" else XtrWarpRunner
        engine = runner(index_dir, args, build_kw, load_kw, {})
        result["versions"].update(engine.versions())

        build_record = os.path.join(args.work_dir, "build.json")
        reuse = args.reuse_index and engine.index_exists() and os.path.exists(build_record)
        if reuse:  # the build's own time, memory and settings, recorded when it finished
            with open(build_record) as f:
                result.update(json.load(f), reused_index=True)
        else:
            if os.path.exists(build_record):
                os.remove(build_record)  # a build stopped half way must not look complete
            search_keys = SETTINGS[args.system]["search"]
            base = {k: v for k, v in result["settings"].items() if k not in search_keys}
            attempts = [(base, build_kw, load_kw)]
            if retry is not None:
                retry_raw, retry_build, retry_load = retry
                attempts.append(
                    (
                        {**base, **retry_raw},
                        {**build_kw, **retry_build},
                        {**load_kw, **retry_load},
                    )
                )
            for i, (raw, b_kw, l_kw) in enumerate(attempts):
                phase("build" if i == 0 else "build (retry)")
                engine.build_kw, engine.load_kw = dict(b_kw), dict(l_kw)
                t0 = time.perf_counter()
                try:
                    engine.build(doc_list)
                except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException is one
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    result["build_attempts"].append(
                        {
                            "settings": raw,
                            "error": _error_text(exc),
                            "seconds": time.perf_counter() - t0,
                        }
                    )
                    if i + 1 == len(attempts):
                        raise
                    continue
                result["build_s"] = time.perf_counter() - t0
                result["build_attempts"].append(
                    {"settings": raw, "error": None, "seconds": result["build_s"]}
                )
                result["build_settings"] = raw
                break
            with open(build_record + ".tmp", "w") as f:
                json.dump(
                    {
                        "build_s": result["build_s"],
                        "peak_rss_build_bytes": peak_rss_bytes(),
                        "build_settings": result["build_settings"],
                        "build_attempts": result["build_attempts"],
                    },
                    f,
                )
            os.replace(build_record + ".tmp", build_record)
        del doc_list, doc_matrix
        import gc

        gc.collect()
        result["peak_rss_build_bytes"] = peak_rss_bytes()
        result["index_bytes"], result["index_files"] = dir_bytes(index_dir)
        # Bytes of the files search actually needs (the peers also keep copies
        # for later add/update; removing those was checked to leave search
        # results unchanged -- see README.md).
        result["index_bytes_search"] = sum(
            size for name, size in result["index_files"].items() if not engine.mutation_only(name)
        )

        phase("load_index")
        t0 = time.perf_counter()
        engine.load()
        result["load_s"] = time.perf_counter() - t0

        last_flush = time.perf_counter()
        for label, raw, search_kw in sweep:
            entry = {
                "setting": label,
                "settings": raw,
                "latency_ms": [],
                "cpu_ms": [],
                "results": {},
                "params": {},
                "load_avg_1m": None,
                "error": None,
            }
            result["sweep"].append(entry)
            phase(f"search {label}")
            engine.search_kw = engine.search_settings(search_kw)
            engine.reset_params()
            try:
                if queries:
                    engine.search(queries[0], args.k)  # warm-up, untimed
                for qid, q in zip(query_ids, queries, strict=False):
                    if time.perf_counter() - last_flush > 10.0:
                        done = len(entry["latency_ms"])
                        phase(f"search {label} ({done}/{len(queries)} queries done)")
                        last_flush = time.perf_counter()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    hits = engine.search(q, args.k)
                    entry["latency_ms"].append((time.perf_counter() - t0) * 1000.0)
                    entry["cpu_ms"].append((time.process_time() - c0) * 1000.0)
                    entry["results"][qid] = [
                        [doc_ids[int(pid)], float(score)] for pid, score in hits
                    ]
            except BaseException as exc:  # noqa: BLE001 - this setting fails, the next one runs
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                entry["error"] = _error_text(exc)
                print(f"{label}: {entry['error']}", file=sys.stderr)
            entry["load_avg_1m"] = os.getloadavg()[0]
            entry["params"] = engine.params()
        first = result["sweep"][0] if result["sweep"] else {}
        for key in ("setting", "latency_ms", "cpu_ms", "results", "params"):
            result[key] = first.get(key, result[key])
        result["rss_after_search_bytes"] = current_rss_bytes()
        result["phase"] = "done"
    except BaseException as exc:  # noqa: BLE001 - record any peer failure
        result["error"] = _error_text(exc)
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["error"], file=sys.stderr)
    write()
    return 0


def _read_metadata(index_dir: str) -> dict:
    """The peer index's metadata.json ({} when it has none yet)."""
    try:
        with open(os.path.join(index_dir, "metadata.json")) as f:
            return json.load(f)
    except OSError:
        return {}


class FastPlaidRunner:
    DEFAULT_SEARCH = {"n_ivf_probe": 8, "n_full_scores": 4096, "batch_size": "auto"}
    DEFAULT_BUILD = {
        "nbits": 4,
        "kmeans_niters": 4,
        "max_points_per_centroid": 256,
        "n_samples_kmeans": None,
        "seed": 42,
        "batch_size": 25_000,
        "start_from_scratch": 1000,
    }

    def __init__(self, index_dir, args, build_kw, load_kw, search_kw):
        self.index_dir = index_dir
        self.args = args
        self.build_kw = build_kw
        self.load_kw = load_kw
        self.search_kw = search_kw
        self.index = None

    def versions(self):
        from importlib.metadata import version

        return {"fast-plaid": version("fast-plaid"), "fastkmeans": version("fastkmeans")}

    def index_exists(self):
        return os.path.exists(os.path.join(self.index_dir, "metadata.json"))

    @staticmethod
    def mutation_only(name):
        # Raw fp16 copy of the documents, written when num_docs <= start_from_scratch
        # (1000) so that update() can rebuild from scratch; search never reads it.
        return name == "embeddings.npy"

    def build(self, doc_list):
        import shutil

        from fast_plaid import search

        if os.path.isdir(self.index_dir):
            shutil.rmtree(self.index_dir)
        builder = search.FastPlaid(index=self.index_dir, device=self.args.device)
        builder.create(documents_embeddings=doc_list, **self.build_kw)
        builder.close()
        del builder

    def load(self):
        from fast_plaid import search

        self.index = search.FastPlaid(index=self.index_dir, device=self.args.device, **self.load_kw)

    def search_settings(self, search_kw):
        return dict(search_kw)

    def reset_params(self):
        pass

    def search(self, q, k):
        out = self.index.search(
            queries_embeddings=[q],
            top_k=k,
            show_progress=False,
            n_processes=1,
            **self.search_kw,
        )
        return out[0]

    def params(self):
        meta = _read_metadata(self.index_dir)
        return {
            "build": {**self.DEFAULT_BUILD, **self.build_kw},
            "search": {**self.DEFAULT_SEARCH, **self.search_kw},
            "index_metadata": meta,
        }


class XtrWarpRunner:
    DEFAULT_BUILD = {
        "nbits": 4,
        "kmeans_niters": 4,
        "max_points_per_centroid": 256,
        "n_samples_kmeans": None,
        "seed": 42,
        "num_partitions": None,
        "codec_sample_max_tokens": 1_000_000,
        "indexing_chunk_size": 256,
        "compression_batch_size": 32_768,
        "kmeans_sample_max_bytes": 2 * 1024**3,
    }

    def __init__(self, index_dir, args, build_kw, load_kw, search_kw):
        self.index_dir = index_dir
        self.args = args
        self.build_kw = build_kw
        self.load_kw = dict(load_kw)
        self.search_kw = self.search_settings(search_kw)
        self.index = None
        self._auto = None
        self._bound = None

    def versions(self):
        from importlib.metadata import version

        return {"xtr-warp-rs": version("xtr-warp-rs")}

    def index_exists(self):
        state = os.path.join(self.index_dir, "build_state.json")
        try:
            with open(state) as f:
                return json.load(f).get("stage") == "complete"
        except (OSError, ValueError):
            return False

    @staticmethod
    def mutation_only(name):
        # Per-chunk {i}.codes / {i}.residuals / {i}.passage_ids files; the
        # loaded searcher reads the *.compacted.npy copies.
        import re

        return re.fullmatch(r"\d+\.(codes|residuals|passage_ids)\.npy", name) is not None

    def search_settings(self, search_kw):
        return {"num_threads": self.args.threads, **search_kw}

    def reset_params(self):
        self._auto = None
        self._bound = None

    def build(self, doc_list):
        import shutil

        import numpy as np
        from xtr_warp import XTRWarp

        if os.path.isdir(self.index_dir):
            shutil.rmtree(self.index_dir)
        kw = dict(self.build_kw)
        source = doc_list
        if kw.pop("embeddings_from_disk", False):
            # The README's streaming input: one .npy of all token vectors and its
            # .doclens.npy sidecar (a link to the input file, not a copy).
            source = os.path.join(self.args.work_dir, "disk_embeddings")
            if os.path.isdir(source):
                shutil.rmtree(source)
            os.makedirs(source)
            os.symlink(
                os.path.abspath(os.path.join(self.args.vectors, "doc_vectors.npy")),
                os.path.join(source, "embeddings_0.npy"),
            )
            offsets = np.load(os.path.join(self.args.vectors, "doc_offsets.npy"))
            np.save(os.path.join(source, "embeddings_0.doclens.npy"), np.diff(offsets))
        builder = XTRWarp(index=self.index_dir)
        builder.create(embeddings_source=source, device=self.args.device, show_progress=False, **kw)
        builder.free()
        del builder

    def load(self):
        import torch
        from xtr_warp import XTRWarp

        kw = dict(self.load_kw)
        if isinstance(kw.get("dtype"), str):
            kw["dtype"] = getattr(torch, kw["dtype"])
        self.index = XTRWarp(index=self.index_dir)
        self.index.load(device=self.args.device, **kw)

    def search(self, q, k):
        if self._auto is None:
            # Record what the library's heuristic picks for this query length
            # (all our queries are searched one at a time, so it is per query).
            self._auto = self.index.optimize_hyperparams(k, q.unsqueeze(0))
            nprobe = self.search_kw.get("nprobe")
            if nprobe is not None and "bound" not in self.search_kw and self._auto:
                # A given nprobe with the library's bound rule, max(8·nprobe, 5 % of the
                # centroids): its automatic bound follows its own nprobe, which may be smaller
                # than the one given (bound is how many centroids are scored before the top
                # nprobe are taken).
                self._bound = max(int(self._auto[0]), 8 * int(nprobe))
        kw = dict(self.search_kw)
        if self._bound is not None:
            kw["bound"] = self._bound
        out = self.index.search(
            queries_embeddings=q.unsqueeze(0),
            top_k=k,
            show_progress=False,
            **kw,
        )
        return out[0]

    def params(self):
        meta = _read_metadata(self.index_dir)
        auto = None
        if self._auto is not None:
            auto = dict(
                zip(
                    ["bound", "nprobe", "centroid_score_threshold", "max_candidates", "t_prime"],
                    self._auto,
                    strict=False,
                )
            )
        return {
            "build": {**self.DEFAULT_BUILD, **self.build_kw},
            "load": {
                "dtype": "float32",
                "mmap": True,
                **{k: str(v) for k, v in self.load_kw.items()},
            },
            "search": {
                "batch_size": 8192,
                **self.search_kw,
                **({"bound": self._bound} if self._bound is not None else {}),
            },
            "search_auto_first_query": auto,
            "index_metadata": meta,
        }


if __name__ == "__main__":
    sys.exit(main())
