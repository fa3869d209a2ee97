r"""Search latency and quality against the peers at every system's operating points, on the same
token vectors, in one interleaved run per store.

    .venv/bin/python benchmarks/search_latency.py --reuse_index \
      --stores=scifact:zero_shot:outputs/zero_shot_scifact/index,scifact:trained:outputs/trained_scifact/index
    .venv/bin/python benchmarks/search_latency.py --replot --out=benchmarks/results/search_latency

**Systems**, each searching the token vectors of one aligner_jax token store (exported once for
the peers): ``aligner_jax`` (the compressed centroid index through ``Searcher``), ``exact``
(MaxSim brute force in NumPy over float32 vectors: the quality ceiling of top-1 alignment
without saliences), ``exact-aligner`` (added with ours on a store whose model has saliences: our ``Searcher`` in
exhaustive mode, every document scored by Eq. 1–2 with top-1 alignment and the saliences from
the float store: the quality ceiling of the function ours approximates, which exact MaxSim is
not; it runs in the first round only, its latency measured once), ``fast-plaid`` (PyPI
``fast-plaid``) and ``xtr-warp`` (PyPI ``xtr-warp-rs``), both run through
``benchmarks/peers/run_peer.py`` in their own virtualenv (``--peer_python``; they pin torch
2.11). ``aligner_jax-xtr`` (f_XTR′ scoring) and ``aligner_jax-nosal`` (saliences off) add one
setting each to ours.

**Sweeps** (each setting a row): ours ``--ours_grid`` (``CentroidSearchConfig``'s scale-free
``probe_docs`` × ``refine_per_k``) × ``--ours_bits`` (residual bits: one index per value, built
in a store under ``--work_dir`` that links the store's files, so the store itself is never
written); FastPlaid ``--fast_plaid_grid`` (``n_ivf_probe`` × ``n_full_scores``, its default 4
bits); XTR-WARP ``--warp_grid`` (``nprobe``: inverted lists probed per query token;
``max_candidates``: documents kept before its final sort; the knobs left out take its own
per-query choice, ``hyperparams.optimize``, with ``bound`` raised to 8·nprobe, its own ratio)
plus its library default (every knob its own choice); exact MaxSim. A peer's index is built
once per store (at the first thread count) and every later call reuses it; one
``run_peer.py`` process searches all of a peer's settings. If XTR-WARP's build fails, it is
retried once with the options its documentation gives for large inputs: the disk-streamed
input (README "Streaming from Disk") and ``codec_sample_max_tokens`` small enough that its
codec's held-out sample (5 % of it, D values a token) stays within ``torch.quantile``'s 2^24
elements; both attempts are in the row (``build_attempts``).

**Interleaving.** Round r encodes every query (timed), then runs every (thread count, system,
setting) over every query before round r + 1 starts (``--rounds``, ≥ 3 for latency intervals).
Batch 1; one untimed warm-up query per setting; ``--threads`` BLAS/torch/rayon threads.

**Operating points chosen off the test split.** Queries are split into tuning and reported
queries: a collection with ``qrels/train.tsv`` tunes on its train queries (``--tuning_queries``
of them, a seeded sample; SciFact) and reports its test queries; one without (CISI), or any
with ``--tuning_split=half`` (a model trained on the collection's train queries ranks them as
its training data), tunes on a seeded random half of its test queries and reports the other
half. Rows hold the reported queries' figures (and the tuning queries' under ``"tuning"``). Every system's operating point
per (store, thread count) follows one rule, ``RULE``: the setting with the lowest p50 on the
tuning queries among those whose tuning nDCG@10 and R@100 are each within ``--tolerance`` (0.5
point) of its reference's on the same queries (a row's ``"reference"``: ``exact-aligner`` for
our settings that weight by a trained model's saliences, exact MaxSim for every other). Its
row has ``"default": true`` and ``"tuned_on"`` naming the split; the other settings
``"default": false``, ``"tuned_on": null`` (the references, which have no knob: ``"default":
true``, ``"tuned_on": null``). No admissible setting: the system has no
default row and ``choices`` says so.

**Statistics.** ``ci95`` of a row: ``ndcg@10`` / ``recall@100``: paired bootstrap 95 %
interval (``--bootstrap`` resamples of the reported queries, seeded) of the *difference* of the
mean against the row's reference (``delta_vs_exact``: row − reference; exact's own is [0, 0];
exact-aligner's is against exact MaxSim); ``p50_ms``: the range (min, max)
of the per-round p50 over the rounds (``--rounds`` ≥ 3, else null): it holds the median of the
per-round p50's distribution with probability 1 − 2^(1−R) (75 % at R = 3, 94 % at 5, 97 % at
6), not 95 % below 6 rounds. ``load_avg_1m``: the machine's 1-minute load average after each of
the row's rounds (mean; every round's in ``load_avg_1m_rounds``).

**Latency.** ``p50_ms`` / ``p90_ms`` / ``p99_ms``: search of one encoded query, pooled over the
rounds. ``e2e_*``: query encoding (batch 1, timed in the same round, its XLA thread pool not
limited by ``--threads``; every query length bucket compiled at load, ``Encoder.warm_up``) plus
search. The peers search our encoded vectors, so their end to end is their search plus *our*
encoding of the same query.

**Bytes, one rule for every system** (``BYTES_RULE``): ``bytes_per_token_resident`` = bytes of
the files the search opens (loads or maps) to answer queries — centroids and codec tables,
codes, residuals, saliences, inverted lists, document lengths/offsets and their small metadata
files — divided by the indexed tokens; ``bytes_per_token_disk`` = those plus the files kept for
updates, rebuilds or exhaustive search (float vectors, per-chunk copies), divided by the same.
Document ids, document text, token ids, locks and checksum records are counted for no system.
Ours: the published search index's files and the store's offsets and manifests are opened; its
float vectors and stored saliences are kept for the rest. A setting that reads the centroid →
token lists (residual candidates, the XTR scorer) opens the index's token-list files
(``--ours_token_lists``; on disk only for the other settings), or, on an index without them,
builds them in memory at load: a document id and a packed residual per kept token, counted
resident as exact search's matrix is. Peers: the files in their index
folder, those ``run_peer.py``'s ``mutation_only`` names (copies for later updates, never
opened: deleting them left results unchanged) on disk only. Exact: the float32 matrix it holds
(4·D bytes a token, an array in memory) plus the offsets resident; the store's float16 vectors
plus offsets on disk. ``bytes_per_token`` (the earlier runs' column) = ``bytes_per_token_disk``.

Writes ``--out``.{json,md,png} (the .png: every system's default point per store) and
``--out``_{dataset}_{model}_t{threads}.png (p50 against R@100 and against nDCG@10, one curve per
system through its Pareto-optimal settings, every setting's point labelled, defaults starred);
``--replot`` redraws them from the .json (JSON of earlier runs too); ``--merge`` combines runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import threadpoolctl  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from aligner_jax.common import cli, fileio  # noqa: E402
from aligner_jax.data import beir  # noqa: E402
from aligner_jax.encoding import loading  # noqa: E402
from aligner_jax.encoding.encoder import Encoder, EncodingConfig  # noqa: E402
from aligner_jax.evaluation import metrics, plotting  # noqa: E402
from aligner_jax.indexing import centroid_index as ci  # noqa: E402
from aligner_jax.indexing import indexer  # noqa: E402
from aligner_jax.indexing import inverted_lists as lists_lib  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402
from aligner_jax.retrieval import centroid_search as cs  # noqa: E402
from aligner_jax.retrieval import searcher as search_lib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
import run_peer  # noqa: E402  (standard library only at import: the peers' settings and files)

SYSTEMS = (
    "aligner_jax", "aligner_jax-xtr", "aligner_jax-nosal", "exact", "exact-aligner", "fast-plaid",
    "xtr-warp",
)  # fmt: skip
#: The exhaustive references: MaxSim for every system that scores MaxSim (the peers, ours with
#: saliences off or without them), ALIGNER's Eq. 1–2 with the model's saliences for ours with
#: them (the function our search approximates).
REFERENCES = ("exact", "exact-aligner")
PEERS = ("fast-plaid", "xtr-warp")
TUNING_SPLITS = ("train", "half")
#: Our variants beside the grid: one setting each of the system ``aligner_jax``.
VARIANTS = {
    "aligner_jax-xtr": ("xtr scorer (f_XTR', WARP-style)", {"refine": "xtr"}),
    "aligner_jax-nosal": ("salience off (ColBERT sum of maxima)", {"salience": False}),
}
RULE = (
    "per (store, thread count), each system's setting with the lowest p50 on the tuning "
    "queries among those whose tuning nDCG@10 and R@100 are each within {tol:g} point of its "
    "exhaustive reference's on the same queries (exact MaxSim; for our settings that weight "
    "the alignment by a trained model's saliences, exhaustive ALIGNER search with them, "
    "exact-aligner) (every tuning query answered, no error)"
)
BYTES_RULE = (
    "bytes_per_token_resident: files the search opens (loads or maps) to answer queries, "
    "divided by the indexed tokens; bytes_per_token_disk: those plus the files kept for "
    "updates, rebuilds or exhaustive search; document ids, text, token ids, locks and "
    "checksum records counted for no system; exact: its float32 matrix in memory (4·D per "
    "token) + offsets resident, the store's float16 vectors + offsets on disk; ours, settings "
    "that read centroid → token lists: the index's token-list files, or the copy built in "
    "memory at load (4 + W bytes per kept token), resident"
)
P50_INTERVAL = "range (min, max) of the per-round p50; null below 3 rounds"
QUANTILE_LIMIT = 1 << 24  # torch.quantile's largest input (elements)
WARP_DEFAULT_CODEC_SAMPLE = 1_000_000  # XTRWarp.create's codec_sample_max_tokens

_STORES = flags.DEFINE_list(
    "stores",
    [
        "scifact:zero_shot:outputs/zero_shot_scifact/index",
        "cisi:zero_shot:outputs/zero_shot_cisi/index",
    ],
    "DATASET:MODEL:INDEX_DIR; a missing zero_shot store is built with models/minilm_identity.gin.",
)
_DATA_ROOT = flags.DEFINE_string(
    "data_root", "../shared/data/beir", "BEIR folders by dataset name."
)
_SYSTEMS = flags.DEFINE_list(
    "systems", ["aligner_jax", "exact", "fast-plaid", "xtr-warp"], f"Any of {SYSTEMS}."
)
_THREADS = flags.DEFINE_list("threads", ["2", "1"], "Thread counts (peers build at the first).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds (>= 3 for p50 intervals).")
_K = flags.DEFINE_integer("k", 100, "Documents per query.")
_MAX_QUERIES = flags.DEFINE_integer(
    "max_queries", None, "Only the first N tuning and the first N reported queries (smoke runs)."
)
_TUNING_QUERIES = flags.DEFINE_integer(
    "tuning_queries", 200, "Train-split tuning queries (a seeded sample; 0 = all)."
)
_TUNING_SPLIT = flags.DEFINE_enum(
    "tuning_split",
    "train",
    list(TUNING_SPLITS),
    "Tuning queries: 'train' (the collection's train queries where it has them, else a seeded "
    "half of its test queries) or 'half' (a seeded half of the test queries, the other half "
    "reported: for a model trained on the train queries).",
)
_SPLIT_SEED = flags.DEFINE_integer("split_seed", 0, "Seed of the tuning sample / half split.")
_TOLERANCE = flags.DEFINE_float(
    "tolerance", 0.005, "The rule's distance to exact on the tuning queries (0.005 = 0.5 point)."
)
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Paired bootstrap resamples.")
_BOOTSTRAP_SEED = flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the bootstrap.")
_EXACT_ROUNDS = flags.DEFINE_integer(
    "exact_rounds",
    None,
    "Rounds that run exact MaxSim, a quality reference (its latency is tens of times the "
    "others'; exact-aligner runs in round 0 only): None = every round.",
)
_OURS_GRID = flags.DEFINE_string(
    "ours_grid",
    "probe_docs=320,640,1280,2560;refine_per_k=1,2,3,4",
    "CentroidSearchConfig fields and salience (SearchConfig's: false scores without the "
    "stored saliences): NAME=V1,V2;NAME=... (every combination).",
)
_OURS_BITS = flags.DEFINE_list(
    "ours_bits", ["4", "2"], "Residual bits of our index (one build each)."
)
_OURS_TOKEN_LISTS = flags.DEFINE_bool(
    "ours_token_lists",
    False,
    "Build our index with CentroidIndexConfig.token_lists (residual candidates and the XTR "
    "scorer map them; without, they build them in memory at load, counted as resident).",
)
_FAST_PLAID_GRID = flags.DEFINE_string(
    "fast_plaid_grid",
    "n_ivf_probe=1,2,4,8,16;n_full_scores=256,1024,4096",
    "FastPlaid search settings (run_peer.py names), NAME=V1,V2;NAME=...",
)
_WARP_GRID = flags.DEFINE_string(
    "warp_grid",
    "nprobe=2,4,8,16,32;max_candidates=2048,8192,32768",
    "XTR-WARP search settings (run_peer.py names), NAME=V1,V2;NAME=... (its default is added).",
)
_PEER_PYTHON = flags.DEFINE_string("peer_python", "/work/peer-venv/bin/python", "Peers' Python.")
_PEER_DEVICE = flags.DEFINE_enum(
    "peer_device", "cpu", ["cpu", "cuda"], "Torch device of the peers (cuda: on a GPU host)."
)
_PEER_TIME_LIMIT = flags.DEFINE_float(
    "peer_time_limit_s", 21600, "Per run_peer.py process (one peer, all its settings)."
)
_WORK_DIR = flags.DEFINE_string(
    "work_dir", "/tmp/aligner_search_latency", "Exports, our indexes, peer indexes."
)
_REUSE_INDEX = flags.DEFINE_bool(
    "reuse_index",
    False,
    "Reuse our indexes of the same settings (the store's own, or --work_dir's) and the peers' "
    "finished indexes (each build's recorded time is reported).",
)
_MERGE = flags.DEFINE_list(
    "merge", [], "Only combine these result JSONs (separate runs) into --out."
)
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks/results/search_latency"), "Output prefix.")
_REPLOT = flags.DEFINE_bool("replot", False, "Only redraw --out's .md and .png from its .json.")


# -- pure pieces (tests/test_search_latency_harness.py) ---------------------------------------
def parse_grid(text: str, flag: str) -> list[dict]:
    """'a=1,2;b=x' → [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'x'}] (every combination, in order)."""
    names, values = [], []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, vals = part.partition("=")
        if not sep or not name.strip() or not vals.strip():
            raise app.UsageError(f"--{flag}={text!r}: expected NAME=V1,V2;NAME=V1,...")
        names.append(name.strip())
        values.append([run_peer._parse_value(v.strip()) for v in vals.split(",")])
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values)]


def runs_in_round(system: str, r: int, exact_rounds: int | None) -> bool:
    """Whether ``system`` runs in round ``r`` (from 0). The references are there for their
    quality, at tens of times the others' latency: exact-aligner runs in round 0 only, exact
    MaxSim in the first ``exact_rounds`` (None: every round, for a p50 interval)."""
    if system == "exact-aligner":
        return r == 0
    if system == "exact":
        return exact_rounds is None or r < exact_rounds
    return True


def half_split(qids, seed: int) -> tuple[list[str], list[str]]:
    """A fixed random half of ``qids`` (tuning) and the rest (reported), each in sorted order:
    the same for the same ids and seed, whatever order they come in."""
    ordered = sorted(qids)
    perm = np.random.default_rng(seed).permutation(len(ordered))
    half = len(ordered) // 2
    tuning = sorted(ordered[i] for i in perm[:half])
    return tuning, sorted(ordered[i] for i in perm[half:])


@dataclasses.dataclass
class QuerySplit:
    tuning: list[str]
    report: list[str]
    qrels: dict  # both splits' judgements (their ids are disjoint)
    description: str


def split_queries(
    dataset_dir: Path, test_qrels: dict, seed: int, tuning_queries: int = 0, tuning: str = "train"
) -> QuerySplit:
    """Tuning and reported queries: the train split's judged queries (``tuning_queries`` of them,
    a seeded sample; 0 = all; ids also judged in test left out) against every test query, or,
    without ``qrels/train.tsv`` or with ``tuning="half"``, ``half_split`` of the test queries
    (for a model trained on the collection's train queries: its rankings of them are its
    training data, not held-out queries)."""
    if tuning not in TUNING_SPLITS:
        raise app.UsageError(f"--tuning_split={tuning!r}: choose one of {TUNING_SPLITS}")
    train_path = Path(dataset_dir) / "qrels" / "train.tsv"
    name = Path(dataset_dir).name
    if train_path.is_file() and tuning == "train":
        train = {q: j for q, j in beir.load_qrels(train_path).items() if j and q not in test_qrels}
        tuning = sorted(train)
        total = len(tuning)
        if 0 < tuning_queries < total:
            picks = np.random.default_rng(seed).choice(total, tuning_queries, replace=False)
            tuning = sorted(tuning[i] for i in picks)
        report = sorted(test_qrels)
        description = (
            f"{name} train queries (qrels/train.tsv): {len(tuning)} of {total}"
            + (f", seeded sample (seed {seed})" if len(tuning) < total else "")
            + f"; reported: the {len(report)} test queries"
        )
        return QuerySplit(tuning, report, {**train, **test_qrels}, description)
    tuning, report = half_split(test_qrels, seed)
    why = "no train split" if not train_path.is_file() else "--tuning_split=half"
    description = (
        f"{name}: {why}; a random half of the {len(test_qrels)} test queries "
        f"({len(tuning)}, seed {seed}) tunes, the other {len(report)} are reported"
    )
    return QuerySplit(tuning, report, dict(test_qrels), description)


def choose(rows: list[dict], exact: dict | None, tolerance: float) -> dict:
    """The rule (``RULE``) over one system's settings at one thread count: ``rows`` have
    ``setting`` and ``tuning`` = {"ndcg@10", "recall@100", "p50_ms", "complete"} (metrics in
    [0, 1]) and optionally ``reference`` (one of ``REFERENCES``, default ``exact``); ``exact``
    is the references' ``tuning`` by name ({"exact": ..., "exact-aligner": ...}), or exact
    MaxSim's alone. Returns {"setting": the chosen label or None, "admissible": [labels],
    "reason": why none (or None)}."""
    refs = exact if exact is None or "ndcg@10" not in exact else {"exact": exact}
    ok, missing = [], set()
    for r in rows:
        t = r.get("tuning") or {}
        name = r.get("reference", "exact")
        ref = (refs or {}).get(name)
        if ref is None or ref.get("ndcg@10") is None:
            missing.add(name)
            continue
        if r.get("error") or not t.get("complete") or t.get("p50_ms") is None:
            continue
        if (
            t["ndcg@10"] >= ref["ndcg@10"] - tolerance - 1e-12
            and t["recall@100"] >= ref["recall@100"] - tolerance - 1e-12
        ):
            ok.append(r)
    if missing:  # a setting the rule cannot judge: no choice among the others either
        names = " and ".join("exact MaxSim" if n == "exact" else n for n in sorted(missing))
        return {
            "setting": None,
            "admissible": [],
            "reason": f"no {names} on the tuning queries",
        }
    if not ok:
        return {
            "setting": None,
            "admissible": [],
            "reason": f"no setting within {100 * tolerance:g} point of its reference on both "
            "metrics",
        }
    best = min(ok, key=lambda r: (r["tuning"]["p50_ms"], r["setting"]))
    return {"setting": best["setting"], "admissible": [r["setting"] for r in ok], "reason": None}


def p50_interval(round_p50s: list[float]) -> list[float] | None:
    """``P50_INTERVAL``: [min, max] of the per-round p50 with 3 or more rounds, else None."""
    return [float(min(round_p50s)), float(max(round_p50s))] if len(round_p50s) >= 3 else None


def bytes_rule(files: dict[str, int], kind, num_tokens: int) -> dict:
    """``BYTES_RULE`` over a file listing: ``kind(name)`` is "search" (opened by the search),
    "update" (kept for updates, rebuilds or exhaustive search) or None (counted for no
    system)."""
    kinds = {name: kind(name) for name in files}
    resident = sum(size for name, size in files.items() if kinds[name] == "search")
    disk = resident + sum(size for name, size in files.items() if kinds[name] == "update")
    return {
        "index_bytes_resident": int(resident),
        "index_bytes": int(disk),
        "bytes_per_token_resident": resident / num_tokens,
        "bytes_per_token_disk": disk / num_tokens,
        "bytes_per_token": disk / num_tokens,
    }


def peer_kind(system: str):
    runner = run_peer.FastPlaidRunner if system == "fast-plaid" else run_peer.XtrWarpRunner
    return lambda name: "update" if runner.mutation_only(name) else "search"


_STORE_SEARCH = re.compile(r"shard-\d+\.(offsets\.npy|json)|manifest\.json")
_STORE_UPDATE = re.compile(r"shard-\d+\.(vectors|salience)\.npy")


def store_files(store_dir: Path) -> dict[str, int]:
    """Sizes of a token store's files and of its published search index's (``search_index/``
    names), links followed."""
    store_dir = Path(store_dir)
    files = {p.name: p.stat().st_size for p in store_dir.iterdir() if p.is_file()}
    out = store_dir / ci.SUBDIR
    if out.is_dir():
        files |= {f"{ci.SUBDIR}/{p.name}": p.stat().st_size for p in out.iterdir() if p.is_file()}
    return files


def ours_kind(store_dir: Path):
    """``bytes_rule``'s kinds of our store and its published search index."""
    pointer = ts.read_manifest(store_dir).get("search_index") or {}
    published = set()
    if pointer:
        meta = json.loads((Path(store_dir) / pointer["meta"]).read_text())
        published = {f"{ci.SUBDIR}/{n}.npy" for n in meta["files"]} | {pointer["meta"]}

    def kind(name: str):
        if name.startswith(f"{ci.SUBDIR}/"):
            return "search" if name in published else None
        if _STORE_SEARCH.fullmatch(name):
            return "search"
        return "update" if _STORE_UPDATE.fullmatch(name) else None

    return kind


def ours_bytes(store: ts.TokenStore, index: ci.CentroidIndex, token_lists: bool) -> dict:
    """``BYTES_RULE`` for our store and its published index, for a setting that reads the
    centroid → token lists (``token_lists``: residual candidates, the XTR scorer) or not: the
    index's token-list files are opened by the first only (on disk for both); an index without
    them has the first build them in memory at load (a document id and a packed residual per
    kept token, and the offsets), counted resident like exact search's matrix."""
    kind = ours_kind(store.directory)
    tok = {
        f"{ci.SUBDIR}/{stem}.npy"
        for group in lists_lib.groups_of(index.meta)
        for table, stem in group["tables"].items()
        if table in lists_lib.TOKEN_LISTS
    }

    def setting_kind(name: str):
        return "update" if name in tok and not token_lists else kind(name)

    size = bytes_rule(store_files(store.directory), setting_kind, store.num_tokens)
    if token_lists and not index.lists.has_token_lists:
        kept = len(ci.kept_rows(store, index.meta["config"]["beta_d"]))
        copy = kept * (4 + index.codec.bytes_per_token) + 8 * (index.num_centroids + 1)
        size["index_bytes_resident"] += copy
        size["bytes_per_token_resident"] = size["index_bytes_resident"] / store.num_tokens
    return size


def exact_bytes(store_dir: Path, num_tokens: int, dim: int, salience: bool = False) -> dict:
    """Exact MaxSim: its float32 matrix in memory + the offsets resident, the store's float16
    vectors + offsets on disk. ``salience`` (exact-aligner): the store's vectors, saliences and
    offsets, mapped where they lie, both resident and on disk."""
    files = store_files(store_dir)
    offsets = sum(s for n, s in files.items() if n.endswith(".offsets.npy"))
    kinds = ("vectors", "salience") if salience else ("vectors",)
    vectors = sum(
        s
        for n, s in files.items()
        if _STORE_UPDATE.fullmatch(n) and any(f".{kind}." in n for kind in kinds)
    )
    resident = vectors + offsets if salience else 4 * dim * num_tokens + offsets
    return {
        "index_bytes_resident": int(resident),
        "index_bytes": int(vectors + offsets),
        "bytes_per_token_resident": resident / num_tokens,
        "bytes_per_token_disk": (vectors + offsets) / num_tokens,
        "bytes_per_token": (vectors + offsets) / num_tokens,
    }


def warp_large_input(dim: int) -> list[str]:
    """XTR-WARP's retry settings: the disk-streamed input and a codec sample whose held-out 5 %
    of D-value tokens fits ``torch.quantile`` (2^24 elements), with a 2 % margin."""
    cap = min(WARP_DEFAULT_CODEC_SAMPLE, int(0.98 * QUANTILE_LIMIT / (0.05 * dim)))
    return ["embeddings_from_disk=true", f"codec_sample_max_tokens={cap}"]


def short_label(settings: dict) -> str:
    """A figure label: the settings' values joined ('8/4096'), 'default' without any; the
    switches by name ('4/no salience', '4/xtr')."""
    names = {("salience", False): "no salience", ("salience", True): "salience"}

    def value(k, v):
        if (k, v) in names:
            return names[(k, v)]
        return f"{v:g}" if isinstance(v, float) else str(v)

    return "/".join(value(k, v) for k, v in settings.items()) or "default"


# -- measuring --------------------------------------------------------------------------------
def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO / p


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _encoder(index_dir: Path) -> Encoder:
    spec = json.loads((index_dir / indexer.ENCODER_FILE).read_text())
    return search_lib.whole_query_encoder(loading.encoder_from_spec(spec))


def _ensure_store(dataset: beir.BeirDataset, model: str, index_dir: Path) -> None:
    if (index_dir / ts.MANIFEST).exists():
        return
    if model != "zero_shot":
        raise app.UsageError(
            f"--stores: {index_dir} holds no token store; build it with aligner-index first"
        )
    cli.parse_gin(["models/minilm_identity.gin"])
    encoder = Encoder(loading.load_encoder(), EncodingConfig())
    corpus = Path(dataset.path) / "corpus.jsonl"
    info = {"path": str(Path(dataset.path).resolve()), "sha256": fileio.sha256_file(corpus)}
    indexer.build_token_store(dataset.corpus.values(), encoder, index_dir, corpus_info=info)


def _export(store: ts.TokenStore, qids, encoded, out: Path) -> Path:
    """The peers' input folder: the store's vectors and our encoded queries."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "done").exists():
        np.save(out / "doc_vectors.npy", np.asarray(store.vectors(), np.float16))
        np.save(out / "doc_offsets.npy", store.offsets.astype(np.int64))
        (out / "doc_ids.json").write_text(json.dumps(store.doc_ids))
    np.save(
        out / "query_vectors.npy", np.concatenate([e.vectors for e in encoded]).astype(np.float16)
    )
    q_off = np.concatenate([[0], np.cumsum([len(e.vectors) for e in encoded])]).astype(np.int64)
    np.save(out / "query_offsets.npy", q_off)
    (out / "query_ids.json").write_text(json.dumps(list(qids)))
    (out / "done").write_text("ok")
    return out


def _timed_queries(fn, items) -> tuple[dict, dict]:
    """Every query once after one untimed warm-up: (results, ms) by query id."""
    fn(*items[0])  # warm-up, untimed
    results, latency = {}, {}
    for qid, e in items:
        t = time.perf_counter()
        results[qid] = fn(qid, e)
        latency[qid] = 1000.0 * (time.perf_counter() - t)
    return results, latency


class ExactMaxSim:
    """Top-1 alignment (sum of max, normalised by the number of query tokens) over every token.

    In NumPy on the CPU; on an accelerator (JAX's default backend is not the CPU, or
    ``on_device``) the token matrix stays on the device and one jitted MaxSim answers a query."""

    def __init__(self, store: ts.TokenStore, k: int, on_device: bool | None = None):
        self.vectors = np.asarray(store.vectors(), np.float32)
        self.starts = store.offsets[:-1]
        self.ids = store.doc_ids
        self.k = k
        self.on_device = jax.default_backend() != "cpu" if on_device is None else on_device
        if self.on_device:
            import jax.numpy as jnp

            doc_of_token = np.repeat(np.arange(len(self.starts)), np.diff(store.offsets))
            self.device_vectors = jnp.asarray(self.vectors)
            self.device_docs = jnp.asarray(doc_of_token, jnp.int32)
            num_docs = len(self.starts)

            @jax.jit
            def top(q, vectors, docs):
                best = jax.ops.segment_max(
                    (q @ vectors.T).T, docs, num_segments=num_docs, indices_are_sorted=True
                )
                return jax.lax.top_k(best.mean(1), k)

            self._top = top

    def __call__(self, qid, e) -> dict[str, float]:
        if self.on_device:
            scores, top = jax.device_get(
                self._top(e.vectors.astype(np.float32), self.device_vectors, self.device_docs)
            )
            return {self.ids[i]: float(s) for i, s in zip(top, scores, strict=True)}
        best = np.maximum.reduceat(e.vectors @ self.vectors.T, self.starts, axis=1)
        scores = best.mean(0)
        top = np.argpartition(-scores, self.k - 1)[: self.k]
        return {self.ids[i]: float(scores[i]) for i in top}


class ExactAligner:
    """Exhaustive ALIGNER search: every document scored by Eq. 1–2 (top-1 alignment weighted by
    the model's saliences, A = Ã ⊙ (u^q ⊗ u^d)) from the float store, through our ``Searcher``
    in exhaustive mode (``Searcher.load(mode="exhaustive")``'s settings): the quality ceiling
    of what our search approximates on a model with saliences."""

    def __init__(self, store: ts.TokenStore, k: int):
        config = search_lib.SearchConfig(backend="exact", k_prime=0, top_k=k)
        self.searcher = search_lib.Searcher(store, config)

    def __call__(self, qid, e) -> dict[str, float]:
        return self.searcher.run([qid], [e], show_progress=False).results["top_k:1"][qid]


def reference(system: str, setting: dict, salient: bool) -> str:
    """The exhaustive reference a row is judged against (``REFERENCES``)."""
    if system == "exact-aligner":
        return "exact"
    ours = system == "aligner_jax" and setting.get("refine", "full") != "xtr"
    return "exact-aligner" if ours and salient and setting.get("salience", True) else "exact"


def store_view(src: Path, dst: Path) -> Path:
    """A token store at ``dst`` whose files are links to ``src``'s and whose manifest is a copy
    without ``src``'s search index: an index built there leaves ``src`` as it is."""
    dst.mkdir(parents=True, exist_ok=True)
    skip = {ts.MANIFEST, ts.VERIFIED}
    for path in src.iterdir():
        link = dst / path.name
        if path.is_file() and path.name not in skip and not path.name.startswith("."):
            if not link.is_symlink():
                link.symlink_to(path.resolve())
    manifest = ts.read_manifest(src)
    manifest.pop("search_index", None)
    ts.write_manifest(dst, manifest)
    return dst


def _our_index(index_dir: Path, bits: int, work: Path) -> tuple[ts.TokenStore, ci.CentroidIndex]:
    """Our index with ``bits``-bit residuals and otherwise default settings: with
    ``--reuse_index``, the store's own (if its settings are these) or --work_dir's earlier
    build; else built in a ``store_view`` under --work_dir."""
    wanted = ci.CentroidIndexConfig(residual_bits=bits, token_lists=_OURS_TOKEN_LISTS.value)
    config = dataclasses.asdict(wanted)
    view = work / (f"ours-b{bits}" + ("-tl" if wanted.token_lists else ""))
    if _REUSE_INDEX.value:
        for directory in (index_dir, view):
            if ci.CentroidIndex.exists(directory):
                store = ts.TokenStore(directory)
                index = ci.CentroidIndex.load(store)
                recorded = index.meta["config"] | {"token_lists": wanted.token_lists}
                if recorded == config and lists_lib.writes_lists(index.meta) == wanted.token_lists:
                    return store, index
    store = ts.TokenStore(store_view(index_dir, view))
    return store, ci.CentroidIndex.build(store, wanted)


def _peer(system, vectors, work, threads, sweep, reuse, retry) -> tuple[dict, float]:
    out = work / f"{system}-t{threads}-{time.time_ns()}.json"
    cmd = [
        _PEER_PYTHON.value, str(REPO / "benchmarks/peers/run_peer.py"), f"--system={system}",
        f"--vectors={vectors}", f"--work_dir={work / system}", f"--threads={threads}",
        f"--device={_PEER_DEVICE.value}", f"--k={_K.value}", f"--out={out}",
        f"--time_limit_s={_PEER_TIME_LIMIT.value}",
        f"--sweep={json.dumps(sweep)}",
    ] + [f"--retry_setting={s}" for s in retry]  # fmt: skip
    if reuse:
        cmd.append("--reuse_index")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if not out.exists():
        return {
            "error": f"run_peer.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        }, seconds
    payload = json.loads(out.read_text())
    out.unlink()  # large (every setting's rankings); what matters goes into the rows
    return payload, seconds


def _per_query(qrels: dict, results: dict) -> dict[str, dict[str, float]]:
    """nDCG@10 and R@100 of every answered judged query."""
    answered = {q: j for q, j in qrels.items() if q in results}
    if not answered:
        return {}
    ev = metrics.evaluate_run(answered, results, k_values=(10, 100), metrics=("ndcg", "recall"))
    return {q: {m: v[m] for m in ("ndcg@10", "recall@100")} for q, v in ev.per_query.items()}


@dataclasses.dataclass
class Measured:
    """One (system, setting, threads): per-query metrics (first round) and latencies by round."""

    system: str
    setting: str
    settings: dict
    threads: int
    per_query: dict | None = None
    latency: dict = dataclasses.field(default_factory=dict)  # round → {qid: ms}
    load: dict = dataclasses.field(default_factory=dict)  # round → 1-minute load average
    extra: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


def bench_store(dataset_name: str, model: str, index_dir: Path, payload: dict) -> None:
    data_dir = _resolve(_DATA_ROOT.value) / dataset_name
    dataset = beir.load_beir(data_dir)
    _ensure_store(dataset, model, index_dir)
    split = split_queries(
        data_dir, dataset.qrels, _SPLIT_SEED.value, _TUNING_QUERIES.value, _TUNING_SPLIT.value
    )
    if _MAX_QUERIES.value:
        split.tuning = split.tuning[: _MAX_QUERIES.value]
        split.report = split.report[: _MAX_QUERIES.value]
        split.description += f" (smoke: the first {_MAX_QUERIES.value} of each)"
    texts = beir.load_queries(data_dir / "queries.jsonl")
    qids = split.tuning + split.report
    store = ts.TokenStore(index_dir)
    encoder = _encoder(index_dir)
    t0 = time.perf_counter()
    buckets = encoder.warm_up("query")
    warm_up_s = time.perf_counter() - t0
    encoded = [encoder.encode([texts[q]], "query")[0] for q in qids]
    items = list(zip(qids, encoded, strict=True))
    systems = _SYSTEMS.value
    threads_list = [int(t) for t in _THREADS.value]
    work = _resolve(_WORK_DIR.value) / f"{dataset_name}-{model}"
    work.mkdir(parents=True, exist_ok=True)
    vectors = _export(store, qids, encoded, work / "vectors") if set(PEERS) & set(systems) else None

    # every system's settings: (label, settings, search function or None for a peer)
    plan: dict[str, list] = {}
    built: dict[str, dict] = {}
    if "aligner_jax" in systems or set(VARIANTS) & set(systems):
        ours = []
        grid = parse_grid(_OURS_GRID.value, "ours_grid") if "aligner_jax" in systems else []
        for bits in [int(b) for b in _OURS_BITS.value]:
            our_store, index = _our_index(index_dir, bits, work)
            for lists in (False, True):  # settings that read token lists count them resident
                built[f"b{bits}" + ("-lists" if lists else "")] = {
                    "build_s": index.meta["updates"][0]["seconds"],
                    **ours_bytes(our_store, index, lists),
                }
            variants = [(n, v) for n, v in VARIANTS.items() if n in systems and bits == 4]
            for setting in grid + [dict(v[1], variant=v[0]) for _, v in variants]:
                setting = {"bits": bits, **setting}
                knobs = {
                    k: v
                    for k, v in setting.items()
                    if k not in ("bits", "variant", "refine", "salience")
                }
                search_cfg = search_lib.SearchConfig(
                    backend="centroid", top_k=_K.value, refine=setting.get("refine", "full"),
                    salience=setting.get("salience", True),
                )  # fmt: skip
                centroid_cfg = cs.CentroidSearchConfig(**knobs)
                searcher = search_lib.Searcher(
                    our_store, search_cfg, centroid_index=index, centroid_config=centroid_cfg
                )
                key = "xtr" if search_cfg.refine == "xtr" else "top_k:1"
                probes, interaction, refine = searcher.centroid.counts(_K.value)

                def fn(qid, e, searcher=searcher, key=key):
                    return searcher.run([qid], [e], show_progress=False).results[key][qid]

                label = setting.get("variant") or " ".join(f"{k}={v}" for k, v in setting.items())
                stages = {"probes": probes, "interaction_docs": interaction, "refine_docs": refine}
                lists = searcher.centroid.config.residual_candidates or search_cfg.refine == "xtr"
                size = f"b{bits}" + ("-lists" if lists else "")
                ours.append((label, setting, fn, {"built": size, "stages": stages}))
        plan["aligner_jax"] = ours
    if "exact" in systems:
        plan["exact"] = [("exhaustive", {}, ExactMaxSim(store, _K.value), {})]
    if ("exact-aligner" in systems or "aligner_jax" in plan) and store.has_saliences:
        plan["exact-aligner"] = [("exhaustive", {}, ExactAligner(store, _K.value), {})]
    peer_sweeps = {}
    if "fast-plaid" in systems:
        grid = parse_grid(_FAST_PLAID_GRID.value, "fast_plaid_grid")
        peer_sweeps["fast-plaid"] = grid
    if "xtr-warp" in systems:
        grid = parse_grid(_WARP_GRID.value, "warp_grid")
        peer_sweeps["xtr-warp"] = grid + ([{}] if {} not in grid else [])
    for system, grid in peer_sweeps.items():
        plan[system] = [(run_peer.setting_label(s), s, None, {}) for s in grid]

    measured: dict[tuple, Measured] = {}
    enc_ms: dict[int, dict[str, float]] = {}
    timing = []
    failed: dict[str, dict] = {}
    for r in range(_ROUNDS.value):
        enc_ms[r] = {}
        for q in qids:
            t = time.perf_counter()
            encoder.encode([texts[q]], "query")
            enc_ms[r][q] = 1000.0 * (time.perf_counter() - t)
        for threads in threads_list:
            for system, settings in plan.items():
                if not runs_in_round(system, r, _EXACT_ROUNDS.value):
                    continue
                logging.info("%s/%s round %d: %s, %d threads, %d settings", dataset_name, model,
                             r, system, threads, len(settings))  # fmt: skip
                t0 = time.perf_counter()
                if system in PEERS:
                    if system in failed:
                        continue
                    first = system not in built
                    reuse = _REUSE_INDEX.value or not first
                    retry = warp_large_input(store.dim) if system == "xtr-warp" else []
                    sweep = [s for _, s, _, _ in settings]
                    out, _ = _peer(system, vectors, work, threads, sweep, reuse, retry)
                    _record_peer(system, out, threads, r, split, measured, built, failed, first)
                else:
                    for label, setting, fn, extra in settings:
                        with threadpoolctl.threadpool_limits(threads):
                            res, lat = _timed_queries(fn, items)
                        m = measured.setdefault(
                            (system, label, threads),
                            Measured(system, label, setting, threads, extra=dict(extra)),
                        )
                        if m.per_query is None:
                            m.per_query = _per_query(split.qrels, res)
                        m.latency[r] = lat
                        m.load[r] = os.getloadavg()[0]
                seconds = time.perf_counter() - t0
                timing.append({"round": r, "threads": threads, "system": system,
                               "settings": len(settings), "seconds": seconds})  # fmt: skip
                logging.info("%s/%s round %d: %s, %d threads: %d settings × %d queries in %.0f s",
                             dataset_name, model, r, system, threads, len(settings), len(qids),
                             seconds)  # fmt: skip

    enc_pooled = [v for r in enc_ms for v in enc_ms[r].values()]
    payload["query_encoding"].append(
        {"dataset": dataset_name, "model": model, "batch": 1, "queries": len(qids),
         "p50_ms": float(np.percentile(enc_pooled, 50)), "p90_ms": float(np.percentile(enc_pooled, 90)),
         "p99_ms": float(np.percentile(enc_pooled, 99)), "warm_up_s": warm_up_s,
         "buckets": list(buckets), "rounds": _ROUNDS.value}
    )  # fmt: skip
    payload["splits"][f"{dataset_name}/{model}"] = {
        "description": split.description,
        "tuning": len(split.tuning),
        "reported": len(split.report),
        "seed": _SPLIT_SEED.value,
    }
    payload["timing"] += [{"dataset": dataset_name, "model": model, **t} for t in timing]
    rows = _rows(dataset_name, model, store, index_dir, split, measured, built, failed, enc_ms)
    _choose_defaults(rows, dataset_name, model, split, payload)
    payload["rows"] += rows


def _record_peer(system, out, threads, r, split, measured, built, failed, first) -> None:
    if first:
        built[system] = {k: out.get(k) for k in (
            "build_s", "index_files", "num_tokens", "build_settings", "build_attempts", "versions"
        )}  # fmt: skip
        if out.get("error") and out.get("build_s") is None:
            failed[system] = {"error": out["error"], "threads": threads, "round": r,
                              "build_attempts": out.get("build_attempts"),
                              "peak_rss_bytes": out.get("peak_rss_bytes")}  # fmt: skip
            return
    for entry in out.get("sweep") or []:
        m = measured.setdefault(
            (system, entry["setting"], threads),
            Measured(system, entry["setting"], entry["settings"], threads),
        )
        results = {q: dict(map(tuple, hits)) for q, hits in entry["results"].items()}
        if m.per_query is None:
            m.per_query = _per_query(split.qrels, results)
        m.latency[r] = dict(zip(list(results), entry["latency_ms"], strict=False))
        m.load[r] = entry.get("load_avg_1m")
        m.error = m.error or entry.get("error") or out.get("error")
        m.extra = {"params": entry.get("params"), "peak_rss_bytes": out.get("peak_rss_bytes")}
    if out.get("error") and not out.get("sweep"):
        failed.setdefault(system, {"error": out["error"], "threads": threads, "round": r})


def _summary(m: Measured, qids: list[str], enc_ms: dict) -> dict:
    """Latency figures of ``m`` over ``qids`` (pooled over its rounds)."""
    rounds = sorted(m.latency)
    lat = [m.latency[r][q] for r in rounds for q in qids if q in m.latency[r]]
    e2e = [m.latency[r][q] + enc_ms[r][q] for r in rounds for q in qids if q in m.latency[r]]
    per_round = [
        float(np.percentile(v, 50))
        for v in ([m.latency[r][q] for q in qids if q in m.latency[r]] for r in rounds)
        if v
    ]
    pct = lambda v, p: float(np.percentile(v, p)) if v else None  # noqa: E731
    return {
        "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99),
        "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
        "p50_ms_rounds": per_round, "p50_interval": p50_interval(per_round),
    }  # fmt: skip


def _quality(per_query: dict, qids: list[str]) -> dict:
    have = [q for q in qids if q in per_query]
    mean = lambda m: math.fsum(per_query[q][m] for q in have) / len(have) if have else None  # noqa: E731
    return {"ndcg@10": mean("ndcg@10"), "recall@100": mean("recall@100"), "answered": len(have)}


def _rows(dataset_name, model, store, index_dir, split, measured, built, failed, enc_ms) -> list:
    refs = {
        name: next((m.per_query for m in measured.values() if m.system == name), None)
        for name in REFERENCES
    }
    salient = store.has_saliences  # else top-1 is MaxSim, every system's reference
    rows = []
    for (system, label, threads), m in measured.items():
        per_query = m.per_query or {}
        ref_name = reference(system, m.settings, salient)
        exact_pq = refs[ref_name]
        quality = _quality(per_query, split.report)
        tuning = _quality(per_query, split.tuning)
        lat = _summary(m, split.report, enc_ms)
        tuning_lat = _summary(m, split.tuning, enc_ms)
        ci95 = {"ndcg@10": None, "recall@100": None, "p50_ms": lat.pop("p50_interval")}
        delta = {"ndcg@10": None, "recall@100": None}
        if exact_pq is not None:
            common = [q for q in split.report if q in per_query and q in exact_pq]
            for metric in ("ndcg@10", "recall@100"):
                x = [per_query[q][metric] for q in common]
                y = [exact_pq[q][metric] for q in common]
                if common:
                    delta[metric] = float(np.mean(np.subtract(x, y)))
                    ci95[metric] = metrics.paired_bootstrap(
                        x, y, _BOOTSTRAP.value, _BOOTSTRAP_SEED.value
                    )
        if system == "aligner_jax":
            info = built[m.extra["built"]]
            size = {k: info[k] for k in info if k.startswith(("index_bytes", "bytes_per_token"))}
            build_s = info["build_s"]
        elif system == "exact":
            size, build_s = exact_bytes(index_dir, store.num_tokens, store.dim), 0.0
        elif system == "exact-aligner":  # the float store, every token's vector and salience
            size, build_s = exact_bytes(index_dir, store.num_tokens, store.dim, salience=True), 0.0
        else:
            info = built.get(system) or {}
            files = info.get("index_files") or {}
            size = bytes_rule(files, peer_kind(system), store.num_tokens) if files else {}
            build_s = info.get("build_s")
        loads = [m.load[r] for r in sorted(m.load) if m.load[r] is not None]
        rows.append(
            {
                "system": system,
                "setting": label,
                "settings": m.settings,
                "short": short_label({k: v for k, v in m.settings.items() if k != "variant"})
                if system not in REFERENCES
                else "exhaustive",
                "model": model,
                "dataset": dataset_name,
                "threads": threads,
                "device": _PEER_DEVICE.value if system in PEERS else jax.default_backend(),
                "split": "reported",
                "num_queries": quality.pop("answered"),
                **quality,
                **lat,
                "ci95": ci95,
                "delta_vs_exact": delta,
                "reference": ref_name,
                "tuning": {
                    **tuning,
                    "p50_ms": tuning_lat["p50_ms"],
                    "complete": tuning["answered"] == len(split.tuning),
                },  # fmt: skip
                "tuned_on": None,
                "default": system in REFERENCES,
                "build_s": build_s,
                **size,
                "num_tokens": store.num_tokens,
                "dim": store.dim,
                "load_avg_1m": float(np.mean(loads)) if loads else None,
                "load_avg_1m_rounds": loads,
                "rounds": len(m.latency),
                "peak_rss_bytes": m.extra.get("peak_rss_bytes") or _peak_rss(),
                "error": m.error,
                **({"stages": m.extra["stages"]} if "stages" in m.extra else {}),
                **({"params": m.extra["params"]} if m.extra.get("params") else {}),
                **(
                    {
                        "build_attempts": built[system].get("build_attempts"),
                        "build_settings": built[system].get("build_settings"),
                    }
                    if system in PEERS and system in built
                    else {}
                ),  # fmt: skip
            }
        )
    for system, info in failed.items():  # no index: one row with the error
        if any(r["system"] == system for r in rows):
            continue
        rows.append(
            {"system": system, "setting": "—", "settings": {}, "short": "—", "model": model,
             "dataset": dataset_name, "threads": info["threads"], "split": "reported",
             "num_queries": 0, "ndcg@10": None, "recall@100": None, "p50_ms": None,
             "p90_ms": None, "p99_ms": None, "e2e_p50_ms": None, "e2e_p99_ms": None,
             "ci95": {"ndcg@10": None, "recall@100": None, "p50_ms": None},
             "tuning": None, "tuned_on": None, "default": False, "build_s": None,
             "bytes_per_token_resident": None, "bytes_per_token": None,
             "num_tokens": store.num_tokens, "dim": store.dim,
             "load_avg_1m": os.getloadavg()[0], "error": info["error"],
             "build_attempts": info.get("build_attempts"),
             "peak_rss_bytes": info.get("peak_rss_bytes")}
        )  # fmt: skip
    return rows


def _choose_defaults(rows, dataset_name, model, split, payload) -> None:
    for threads in sorted({r["threads"] for r in rows}):
        here = [r for r in rows if r["threads"] == threads]
        refs = {
            name: next((r["tuning"] for r in here if r["system"] == name), None)
            for name in REFERENCES
        }
        for system in dict.fromkeys(r["system"] for r in here if r["system"] not in REFERENCES):
            mine = [r for r in here if r["system"] == system]
            choice = choose(mine, refs, _TOLERANCE.value)
            for r in mine:
                if r["setting"] == choice["setting"]:
                    r["default"], r["tuned_on"] = True, split.description
            payload["choices"].append(
                {"dataset": dataset_name, "model": model, "threads": threads, "system": system,
                 "settings_swept": len(mine), **choice}
            )  # fmt: skip


# -- reporting --------------------------------------------------------------------------------
def _fmt(x, f: str) -> str:
    return "—" if x is None else format(x, f)


def _pts(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def _interval(ci, scale: float = 100.0, f: str = "+.1f") -> str:
    return "" if not ci else f" [{format(scale * ci[0], f)}, {format(scale * ci[1], f)}]"


def summary(payload: dict) -> str:
    """The end-of-run screen: the operating points' rows (and the errors) and the choices."""
    rows = [
        r
        for r in payload["rows"]
        if r.get("tuned_on") or r["system"] in REFERENCES or r.get("error")
    ]
    return markdown({**payload, "rows": rows})


def markdown_earlier(payload: dict) -> str:
    """The table of runs before the sweeps (rows without ``tuned_on``), as they were written."""
    lines = [
        "# Search latency against the peers (batch 1, CPU)",
        "",
        f"Machine: {payload['machine']}. Same token vectors for every system; query encoding "
        "excluded (below). nDCG@10 / R@100 ×100; p50/p90 ms per query.",
        "",
        "| dataset | model | system | setting | threads | nDCG@10 | R@100 | p50 ms | p90 ms | build s | bytes/token | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r['system']} | {r.get('setting', '')} | {r['threads']} | "
            f"{_fmt(r['ndcg@10'] and 100 * r['ndcg@10'], '.1f')} | "
            f"{_fmt(r['recall@100'] and 100 * r['recall@100'], '.1f')} | {_fmt(r['p50_ms'], '.1f')} | "
            f"{_fmt(r['p90_ms'], '.1f')} | {_fmt(r['build_s'], '.1f')} | "
            f"{_fmt(r['bytes_per_token'], '.0f')} | {(r.get('error') or '')[:120]} |"
        )
    lines += ["", "Query encoding (batch 1):", ""]
    for e in payload["query_encoding"]:
        lines.append(
            f"- {e['dataset']}/{e['model']}: p50 {e['p50_ms']:.1f} ms, p90 {e['p90_ms']:.1f} ms"
        )
    return "\n".join(lines) + "\n"


def markdown(payload: dict) -> str:
    if payload["rows"] and not any("tuned_on" in r for r in payload["rows"]):
        return markdown_earlier(payload)
    devices = sorted({f"{r['system']} on {r['device']}" for r in payload["rows"] if "device" in r})
    where = "; ".join(devices) if any(not d.endswith(" on cpu") for d in devices) else "CPU"
    lines = [
        f"# Search latency against the peers (batch 1, {where})",
        "",
        f"Machine: {payload['machine']}. k = {payload.get('k', '?')}, "
        f"{payload.get('rounds', '?')} interleaved round(s). Same token vectors for every system. "
        "nDCG@10 / R@100 ×100 on the reported queries, [paired bootstrap 95 % interval of the "
        "difference against exact]; p50 [range over rounds] / p99 ms of search alone; e2e = "
        "our query encoding + search (the peers search our encoded vectors); bytes per token "
        "resident / on disk (one rule); load = 1-minute load average; ★ = the operating point "
        "the rule chose on the tuning queries.",
        "",
    ]
    if payload.get("rule"):
        lines += [f"Rule: {payload['rule']}.", ""]
    for name, s in (payload.get("splits") or {}).items():
        lines.append(f"- split {name}: {s['description']}")
    if payload.get("splits"):
        lines.append("")
    lines += [
        "| dataset | model | threads | system | setting | nDCG@10 | R@100 | p50 ms | p99 ms | "
        "e2e p50 | e2e p99 | B/tok res. | B/tok disk | load | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        ci = r.get("ci95") or {}
        star = " ★" if r.get("tuned_on") else ""
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r['threads']} | {r['system']} | "
            f"{r.get('setting', '')}{star} | {_pts(r['ndcg@10'])}{_interval(ci.get('ndcg@10'))} | "
            f"{_pts(r['recall@100'])}{_interval(ci.get('recall@100'))} | "
            f"{_fmt(r['p50_ms'], '.1f')}{_interval(ci.get('p50_ms'), 1.0, '.1f')} | "
            f"{_fmt(r.get('p99_ms'), '.1f')} | {_fmt(r.get('e2e_p50_ms'), '.1f')} | "
            f"{_fmt(r.get('e2e_p99_ms'), '.1f')} | {_fmt(r.get('bytes_per_token_resident'), '.0f')} | "
            f"{_fmt(r.get('bytes_per_token'), '.0f')} | {_fmt(r.get('load_avg_1m'), '.1f')} | "
            f"{_first_line(r.get('error') or '', 120)} |"
        )
    if payload.get("choices"):
        lines += ["", "Operating points (the rule on the tuning queries):", ""]
        for c in payload["choices"]:
            lines.append(
                f"- {c['dataset']}/{c['model']} ×{c['threads']} {c['system']}: "
                + (f"**{c['setting']}** ({len(c['admissible'])} of {c['settings_swept']} "
                   "settings admissible)" if c["setting"] else f"none ({c['reason']})")
            )  # fmt: skip
    lines += ["", "Query encoding (batch 1):", ""]
    for e in payload["query_encoding"]:
        p99 = f", p99 {e['p99_ms']:.1f} ms" if "p99_ms" in e else ""
        lines.append(
            f"- {e['dataset']}/{e['model']}: p50 {e['p50_ms']:.1f} ms, p90 {e['p90_ms']:.1f} ms{p99}"
        )
    return "\n".join(lines) + "\n"


_NOTE_MARKS = "*†‡§¶"


def _notes(rows: list[dict]) -> dict[str, str]:
    """A footnote mark for each run note ('default (quiet re-run)' → 'quiet re-run')."""
    notes = dict.fromkeys(_note(r["setting"]) for r in rows if "tuned_on" not in r)
    notes.pop("", None)
    return {note: _NOTE_MARKS[i % len(_NOTE_MARKS)] for i, note in enumerate(notes)}


def _label(row: dict, notes: dict[str, str]) -> str:
    """'system ×threads', with the footnote mark of the run's note if it has one."""
    mark = "" if "tuned_on" in row else notes.get(_note(row["setting"]), "")
    return f"{row['system']} ×{row['threads']}" + mark


def _note(setting: str) -> str:
    """A run's note: 'default (quiet re-run)' → 'quiet re-run', 'default' → '', others as is."""
    note = setting.removeprefix("default").strip()
    return note[1:-1] if note.startswith("(") and note.endswith(")") else note


def _first_line(text: str, width: int) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 1] + "…"


MARKERS = {
    "aligner_jax": "o",
    "exact": "s",
    "exact-aligner": "P",
    "fast-plaid": "^",
    "xtr-warp": "D",
}
COLORS = {
    "aligner_jax": "C0",
    "exact": "C3",
    "exact-aligner": "C1",
    "fast-plaid": "C2",
    "xtr-warp": "C5",
}


def figure(payload: dict):
    """One panel per (dataset, model): nDCG@10 against p50 latency (log) of every system's
    operating point (``"default": true``; every row of a run without sweeps) labelled
    ('system ×threads', a footnote mark for a run's note; filled: the most threads, hollow:
    fewer), a y range of at least 2 nDCG points (so equal systems look equal), and the
    systems without a result named with their error."""
    plt = plotting.pyplot()
    shown = [r for r in payload["rows"] if r.get("default", True) or r.get("p50_ms") is None]
    groups = sorted({(r["dataset"], r["model"]) for r in shown})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    panels = []
    for ax, (dataset, model) in zip(axes[0], groups, strict=True):
        rows = [r for r in shown if (r["dataset"], r["model"]) == (dataset, model)]
        done = [r for r in rows if r["p50_ms"] is not None]
        top_threads = max((r["threads"] for r in rows), default=0)
        for r in done:
            color = COLORS.get(r["system"], "k")
            ax.plot(r["p50_ms"], 100 * r["ndcg@10"], linestyle="none",
                    marker=MARKERS.get(r["system"], "x"), color=color, markersize=8,
                    markerfacecolor=color if r["threads"] == top_threads else "none")  # fmt: skip
        ax.set_xscale("log")
        plotting.plain_log_axis(ax.xaxis)
        ys = [100 * r["ndcg@10"] for r in done] or [0.0]
        mid, half = (max(ys) + min(ys)) / 2, max(1.0, 0.6 * (max(ys) - min(ys)))
        ax.set_ylim(mid - half, mid + half)
        ax.margins(x=0.15)
        xs = [r["p50_ms"] for r in done]
        if xs and max(xs) < 5 * min(xs):  # at least a decade and a half: ticks, honest spread
            centre = (max(xs) * min(xs)) ** 0.5
            ax.set_xlim(centre / 5.6, centre * 5.6)
        ax.set_xlabel("p50 ms per query (batch 1, log scale)")
        ax.set_ylabel("nDCG@10 (×100)")
        ax.set_title(f"{dataset} / {model}", fontsize=10)
        ax.grid(True, alpha=0.3)
        notes = _notes(rows)
        lines = [f"{mark} {note}" for note, mark in notes.items()]
        lines += [
            f"no result: {_label(r, notes)}: {_first_line(r.get('error') or '', 100)}"
            for r in rows
            if r["p50_ms"] is None
        ]
        if lines:
            ax.text(0.01, 0.01, "\n".join(lines), transform=ax.transAxes, fontsize=6.5, va="bottom")
        panels.append((ax, done, notes))

    fig.suptitle(f"Search latency and quality (k={payload.get('k', '?')})", fontsize=11)
    fig.tight_layout()
    for ax, done, notes in panels:
        plotting.annotate_points(
            ax,
            [r["p50_ms"] for r in done],
            [100 * r["ndcg@10"] for r in done],
            [_label(r, notes) for r in done],
        )
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats (lower x and higher or equal y, or equal x
    and higher y), by increasing x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def sweep_groups(payload: dict) -> list[tuple[str, str, int]]:
    """(dataset, model, threads) of the rows with a ``tuned_on`` key (this harness's runs)."""
    rows = [r for r in payload["rows"] if "tuned_on" in r]
    return sorted({(r["dataset"], r["model"], r["threads"]) for r in rows})


def sweep_figure(payload: dict, dataset: str, model: str, threads: int):
    """p50 against R@100 (left) and against nDCG@10 (right) for one store and thread count: one
    curve per system through its Pareto-optimal settings, every setting's point labelled with
    its values, the rule's operating points starred."""
    plt = plotting.pyplot()
    rows = [
        r for r in payload["rows"]
        if (r["dataset"], r["model"], r["threads"]) == (dataset, model, threads)
        and r.get("p50_ms") is not None and r.get("ndcg@10") is not None
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    for ax, metric in zip(axes, ("recall@100", "ndcg@10"), strict=True):
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == system]
            pts = [(r["p50_ms"], 100 * r[metric]) for r in mine]
            color = COLORS.get(system, "k")
            front = pareto_front(pts)
            ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-", color=color,
                    alpha=0.6, label=system)  # fmt: skip
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", color=color,
                    marker=MARKERS.get(system, "x"), markersize=5)  # fmt: skip
            chosen = [p for p, r in zip(pts, mine, strict=True) if r.get("tuned_on")]
            if chosen:
                ax.plot(*zip(*chosen, strict=True), linestyle="none", marker="*", markersize=14,
                        markerfacecolor="none", markeredgecolor="k")  # fmt: skip
        ax.set_xscale("log")
        plotting.plain_log_axis(ax.xaxis)
        ax.set_xlabel(f"p50 ms per query (batch 1, {threads} thread(s), log scale)")
        ax.set_ylabel(f"{'R@100' if metric == 'recall@100' else 'nDCG@10'} (×100)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        ax.margins(x=0.1, y=0.1)
    failed = [r for r in payload["rows"] if (r["dataset"], r["model"]) == (dataset, model)
              and r.get("p50_ms") is None and r.get("error")]  # fmt: skip
    note = "; ".join(f"{r['system']}: {_first_line(r['error'], 90)}" for r in failed)
    fig.suptitle(
        f"{dataset} / {model}, {threads} thread(s), k={payload.get('k', '?')}: every setting "
        "(labels: its values), ★ the rule's operating point"
        + (f"\nno result: {note}" if note else ""),
        fontsize=9,
    )
    fig.tight_layout()
    for ax, metric in zip(axes, ("recall@100", "ndcg@10"), strict=True):
        plotting.annotate_points(
            ax,
            [r["p50_ms"] for r in rows],
            [100 * r[metric] for r in rows],
            [r.get("short") or r["setting"] for r in rows],
            fontsize=5.5,
        )
    return fig


def write_outputs(payload: dict, out: Path) -> list[Path]:
    """The .md, the overview .png and one .png per (dataset, model, threads) of a sweep run."""
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(payload))
    written = [out.with_suffix(".md"), out.with_suffix(".png")]
    plotting.save(figure(payload), out.with_suffix(".png"), dpi=120)
    for dataset, model, threads in sweep_groups(payload):
        path = out.parent / f"{out.name}_{dataset}_{model}_t{threads}.png"
        plotting.save(sweep_figure(payload, dataset, model, threads), path, dpi=110)
        written.append(path)
    return written


def check_flags() -> None:
    """Every grid's names are its system's knobs, every bit count one our codec has."""
    # SearchConfig.salience too: a trained model's u^d off, against exact MaxSim (no u^d)
    ours = sorted([f.name for f in dataclasses.fields(cs.CentroidSearchConfig)] + ["salience"])
    grids = (
        ("ours_grid", _OURS_GRID.value, ours),
        (
            "fast_plaid_grid",
            _FAST_PLAID_GRID.value,
            sorted(run_peer.SETTINGS["fast-plaid"]["search"]),
        ),
        ("warp_grid", _WARP_GRID.value, sorted(run_peer.SETTINGS["xtr-warp"]["search"])),
    )
    for flag, text, known in grids:
        for name in parse_grid(text, flag)[0] if text.strip() else {}:
            if name not in known:
                raise app.UsageError(f"--{flag}: {name!r} is not one of {', '.join(known)}")
    for bits in _OURS_BITS.value:
        if bits not in ("2", "4", "8"):
            raise app.UsageError(f"--ours_bits: {bits!r}; residual bits are 2, 4 or 8")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for s in _SYSTEMS.value:
        if s not in SYSTEMS:
            raise app.UsageError(f"--systems: {s!r} is not one of {SYSTEMS}")
    if _EXACT_ROUNDS.value is not None and _EXACT_ROUNDS.value < 1:
        raise app.UsageError(f"--exact_rounds={_EXACT_ROUNDS.value}: expected at least 1")
    out = _resolve(_OUT.value)
    if _REPLOT.value:
        if not out.with_suffix(".json").is_file():
            raise app.UsageError(f"--replot: {out.with_suffix('.json')} does not exist")
        payload = json.loads(out.with_suffix(".json").read_text())
        written = write_outputs(payload, out)
        print("wrote " + ", ".join(str(p) for p in written))
        return
    check_flags()  # a malformed grid fails before any work
    payload = {
        "rows": [],
        "query_encoding": [],
        "choices": [],
        "splits": {},
        "timing": [],
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "rounds": _ROUNDS.value,
        "k": _K.value,
        "rule": RULE.format(tol=100 * _TOLERANCE.value),
        "tolerance": _TOLERANCE.value,
        "statistics": {
            "ci95_metrics": f"paired bootstrap of the difference against exact, "
            f"{_BOOTSTRAP.value} resamples of the reported queries, seed {_BOOTSTRAP_SEED.value}",
            "ci95_p50_ms": P50_INTERVAL,
        },
        "bytes_rule": BYTES_RULE,
        "grids": {
            "aligner_jax": _OURS_GRID.value,
            "aligner_jax_bits": _OURS_BITS.value,
            "fast-plaid": _FAST_PLAID_GRID.value,
            "xtr-warp": _WARP_GRID.value + " + the library default",
        },  # fmt: skip
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "load_avg_1m_start": os.getloadavg()[0],
    }
    t0 = time.perf_counter()
    if _MERGE.value:
        parts = [json.loads(_resolve(p).read_text()) for p in _MERGE.value]
        for key in ("rows", "query_encoding", "choices", "timing"):
            payload[key] = [x for p in parts for x in p.get(key, [])]
        payload["splits"] = {k: v for p in parts for k, v in p.get("splits", {}).items()}
        rounds = sorted({p.get("rounds") for p in parts}, key=str)
        payload["rounds"] = rounds[0] if len(rounds) == 1 else rounds
        payload["parts"] = [
            {"file": f, "command": p.get("command"), "seconds": p.get("seconds")}
            for f, p in zip(_MERGE.value, parts, strict=True)
        ]
    for spec in [] if _MERGE.value else _STORES.value:
        try:
            dataset_name, model, index_dir = spec.split(":", 2)
        except ValueError:
            raise app.UsageError(f"--stores={spec!r}: expected DATASET:MODEL:INDEX_DIR") from None
        bench_store(dataset_name, model, _resolve(index_dir), payload)
    payload["seconds"] = time.perf_counter() - t0
    payload["load_avg_1m_end"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(out.with_suffix(".json"), payload, sort_keys=False)
    written = write_outputs(payload, out)
    print(summary(payload))
    print(f"wrote {out.with_suffix('.json')}, " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    app.run(main)
