"""Tiny BEIR folders for tests (the real datasets are never copied into the repository).

`write_beir_fixture` writes any small corpus in the BEIR layout; `write_toy_beir` writes the
default toy collection below: 12 short documents on distinct topics and 4 queries whose relevant
documents share their distinctive words, so any reasonable retriever (BM25, a pretrained encoder)
should rank the relevant documents first (nDCG@10 at or near 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from aligner_jax.models.bert import BertConfig
from aligner_jax.models.t5 import T5Config

REPO = Path(__file__).resolve().parent.parent
# Tiny encoders: a forward pass takes milliseconds, every code path (layers, heads, padding) runs.
TINY_BERT = BertConfig(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=24,
    max_position_embeddings=12,
    type_vocab_size=2,
)
TINY_T5 = T5Config(
    vocab_size=64,
    emb_dim=32,
    num_heads=4,
    num_layers=2,
    head_dim=8,
    mlp_dim=64,
    dropout_rate=0.1,
)
# Without dropout: losses and gradients are deterministic.
TINY_BERT_NO_DROPOUT = dataclasses.replace(
    TINY_BERT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
)
# For checkpoint import: vocabulary, width, MLP and heads all differ, so a transposed or misnamed
# array cannot pass a shape check.
TINY_T5_IMPORT = dataclasses.replace(
    TINY_T5, vocab_size=40, emb_dim=16, num_heads=2, mlp_dim=24, dropout_rate=0.0
)
# Logical axis names of every parameter and activation (t5x style; models.partitioning maps them).
LOGICAL_AXES = frozenset(
    {
        "batch",
        "length",
        "embed",
        "mlp",
        "heads",
        "kv",
        "joined_kv",
        "vocab",
        "relpos_buckets",
        "abspos_buckets",
        "token_type",
        "proj",
        "salience",
    }
)

TOY_DOCS: dict[str, dict[str, str]] = {
    "d0": {
        "title": "Volcanoes",
        "text": "A volcano erupts when magma and lava rise through the crust of the earth.",
    },
    "d1": {
        "title": "Honey bees",
        "text": "Honey bees collect nectar from flowers and store honey in wax combs in the hive.",
    },
    "d2": {
        "title": "Chess openings",
        "text": "The Sicilian defence is a sharp chess opening where black answers with the c5 pawn.",
    },
    "d3": {
        "title": "Sourdough bread",
        "text": "Sourdough bread rises with a wild yeast starter and is baked in a hot oven.",
    },
    "d4": {
        "title": "Black holes",
        "text": "A black hole is a region of spacetime where gravity is so strong that no light escapes.",
    },
    "d5": {
        "title": "Photosynthesis",
        "text": "Plants use chlorophyll and sunlight to turn carbon dioxide and water into glucose.",
    },
    "d6": {
        "title": "The Roman Empire",
        "text": "Augustus became the first emperor of Rome and the Roman Empire lasted for centuries.",
    },
    "d7": {
        "title": "Insulin and diabetes",
        "text": "Insulin lowers blood glucose; in type 1 diabetes the pancreas makes no insulin.",
    },
    "d8": {
        "title": "Jazz music",
        "text": "Jazz musicians improvise on the saxophone and trumpet over swing rhythms.",
    },
    "d9": {
        "title": "Glaciers",
        "text": "Glaciers are slow rivers of ice that carve valleys as they move down mountains.",
    },
    "d10": {
        "title": "Beekeeping",
        "text": "A beekeeper wears a veil and uses smoke to calm the bees before opening the hive.",
    },
    "d11": {
        "title": "Tides",
        "text": "Ocean tides rise and fall twice a day because of the gravity of the moon.",
    },
}

TOY_QUERIES: dict[str, str] = {
    "q0": "why does a volcano erupt lava and magma",
    "q1": "honey bees in the hive",
    "q2": "insulin and blood glucose in diabetes",
    "q3": "Sicilian defence chess opening",
}

TOY_QRELS: dict[str, dict[str, int]] = {
    "q0": {"d0": 1},
    "q1": {"d1": 2, "d10": 1},
    "q2": {"d7": 1},
    "q3": {"d2": 1},
}


def _doc_record(doc_id: str, doc: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(doc, str):
        return {"_id": doc_id, "title": "", "text": doc}
    return {"_id": doc_id, "title": doc.get("title", ""), "text": doc["text"]}


def write_beir_fixture(
    tmp_path: str | os.PathLike,
    docs: Mapping[str, str | Mapping[str, str]],
    queries: Mapping[str, str],
    qrels: Mapping[str, Mapping[str, int]],
    split: str = "test",
    name: str = "toy",
) -> Path:
    """Writes `tmp_path/name/` in the BEIR layout and returns that folder.

    Args:
      docs: `{doc_id: text}` or `{doc_id: {"title": ..., "text": ...}}`, written in order.
      queries: `{query_id: text}`.
      qrels: `{query_id: {doc_id: relevance}}`, written to `qrels/<split>.tsv`.
    """
    folder = Path(tmp_path) / name
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for doc_id, doc in docs.items():
            f.write(json.dumps(_doc_record(doc_id, doc), ensure_ascii=False) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as f:
        for query_id, text in queries.items():
            f.write(json.dumps({"_id": query_id, "text": text}, ensure_ascii=False) + "\n")
    with open(folder / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for query_id, judged in qrels.items():
            for doc_id, score in judged.items():
                f.write(f"{query_id}\t{doc_id}\t{score}\n")
    return folder


def write_toy_beir(tmp_path: str | os.PathLike, split: str = "test", name: str = "toy") -> Path:
    """Writes the default toy collection (TOY_DOCS, TOY_QUERIES, TOY_QRELS)."""
    return write_beir_fixture(tmp_path, TOY_DOCS, TOY_QUERIES, TOY_QRELS, split=split, name=name)


def parse_gin(*files: str, bindings=()) -> None:
    """A fresh gin config from ``files`` (paths under gin/) and ``bindings``, as binaries parse it."""
    import gin

    from aligner_jax.common import cli

    gin.clear_config()
    cli.parse_gin(list(files), list(bindings))


def scatter_add_dtypes(fn, *args) -> set[str]:
    """Dtypes of every scatter-add in ``fn(*args)``'s jaxpr (nested calls included).

    A gather's backward pass is a scatter-add; on GPUs a bfloat16 scatter-add has no native atomic
    and runs many times slower than a float32 one, so training code keeps them in float32.
    """
    import re

    import jax

    text = str(jax.make_jaxpr(fn)(*args))
    return set(re.findall(r":(\w+)\[[^\]]*\] = scatter-add", text))


CHILD_CACHE = "ALIGNER_JAX_TESTS_JAX_CACHE"  # the run's compilation cache folder (conftest.py)
# The tests' programs are tiny: compiling them dominates, running them does not. LLVM at -O0
# compiles the tiny BERT's train step in about two thirds of the time (aligner-train, 12 steps:
# 37 -> 25 s); XLA's own HLO passes still run. conftest.py sets it for the whole run.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a test's child: ``flags`` (e.g. a forced host device count) plus the
    run's own (``TEST_XLA_FLAGS``, from the environment conftest.py set)."""
    return " ".join([*flags, os.environ.get("XLA_FLAGS", "")]).strip()


def python_env(as_user: bool = False, **env: str) -> dict[str, str]:
    """The environment of a test's child process: quiet TensorFlow, on the CPU, plus ``env``;
    with ``as_user``, the environment a user has (no TF_CPP_MIN_LOG_LEVEL / JAX_PLATFORMS).

    Children share the test run's persistent compilation cache (``CHILD_CACHE``) for the
    compilations that take ≥ 0.3 s (aligner-index on the tiny BERT: 15 → 5 s from the second
    run on); the size bound turns on JAX's file lock around every read and write, since
    processes share the folder. A compile counter counts a cache hit as a compilation
    (``common/compilations.py``); ``env`` may name another folder."""
    quiet = ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS")
    environment = {k: v for k, v in os.environ.items() if not (as_user and k in quiet)}
    if not as_user:
        environment.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
    if os.environ.get(CHILD_CACHE) and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        environment.update(
            JAX_COMPILATION_CACHE_DIR=os.environ[CHILD_CACHE],
            JAX_COMPILATION_CACHE_MAX_SIZE=str(4 << 30),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.3",
        )
    environment.update(env)
    if "XLA_FLAGS" in env:  # a child's own flags (device counts) keep the run's
        environment["XLA_FLAGS"] = xla_flags(env["XLA_FLAGS"])
    return environment


def run_python(
    *args: str, cwd=REPO, timeout: float = 600, as_user: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """``python ARGS`` (a script, ``-c CODE`` or ``-m MODULE``) from the repository root in
    `python_env`; returns the finished process with its output as text."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=python_env(as_user, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_module(module: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS``, as `run_python` runs it."""
    return run_python("-m", module, *args, **kw)


def start_python(*args: str, cwd=REPO, capture: bool = False, **env: str) -> subprocess.Popen:
    """``python ARGS`` started in the background like `run_python`, for tests that signal or
    kill a job part-way; its output is discarded, or with ``capture`` piped as text."""
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=python_env(**env),
        stdout=output,
        stderr=output,
        text=capture,
    )


def trec_eval_run_file(run_path, qrels_path, k_values=(10, 100)) -> dict[str, float]:
    """Scores a TREC run file with pytrec_eval alone (no aligner_jax code): the independent
    evaluator metrics.json must agree with. MRR@k is ``recip_rank`` on each query's first k
    lines by rank (BEIR's MRR@k); means are over the judged queries."""
    import math

    import pytrec_eval

    qrels: dict[str, dict[str, int]] = {}
    for line in Path(qrels_path).read_text().splitlines()[1:]:
        qid, doc_id, score = line.split("\t")
        qrels.setdefault(qid, {})[doc_id] = int(score)
    run: dict[str, dict[str, float]] = {q: {} for q in qrels}
    top: dict[str, dict[int, dict[str, float]]] = {k: {q: {} for q in qrels} for k in k_values}
    for line in Path(run_path).read_text().splitlines():
        qid, _, doc_id, rank, score, _ = line.split()
        run.setdefault(qid, {})[doc_id] = float(score)
        for k in k_values:
            if int(rank) <= k and qid in qrels:
                top[k][qid][doc_id] = float(score)
    cuts = ",".join(map(str, k_values))
    per = pytrec_eval.RelevanceEvaluator(qrels, {f"ndcg_cut.{cuts}", f"recall.{cuts}"}).evaluate(
        {q: run[q] for q in qrels}
    )
    out = {}
    for k in k_values:
        out[f"ndcg@{k}"] = math.fsum(v[f"ndcg_cut_{k}"] for v in per.values()) / len(qrels)
        out[f"recall@{k}"] = math.fsum(v[f"recall_{k}"] for v in per.values()) / len(qrels)
        rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top[k])
        out[f"mrr@{k}"] = math.fsum(v["recip_rank"] for v in rr.values()) / len(qrels)
    return out


def pid_worker(host: str, port: int, app_args: dict) -> None:
    """A stand-in for ``serve_job._worker`` (``aligner-serve --workers``): on its own
    ``SO_REUSEPORT`` socket, answers every request with its pid; ``app_args["fail"]``: exits
    with code 3 at once."""
    if app_args.get("fail"):
        sys.exit(3)
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from aligner_jax.serving import serve_job

    app = Starlette(routes=[Route("/", lambda request: JSONResponse({"pid": os.getpid()}))])
    sock = serve_job._bound_socket(host, port, reuse_port=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
