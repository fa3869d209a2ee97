r"""Tokens of zero salience in the store: kept (the old default) against dropped (the default).

    .venv/bin/python benchmarks/zero_salience.py        # SciFact + CISI test, SciFact's model

A trained ALIGNER model's LP salience (Eq. 3–5) gives about half of a document's tokens
u^d = 0. Eq. 2's ``A = Ã ⊙ (u^q ⊗ u^d)`` gives them no weight, so they add nothing to a
score; but top-1 alignment (Ã) still lets one win a query token's maximum, and that query
token then drops out of the score altogether (its row of A is 0 and Σ A loses it too). This
benchmark indexes each collection twice with the same model, ``IndexingConfig.
drop_zero_salience`` False then True, and evaluates each store with the default centroid
search and exhaustively (``eval/exhaustive.gin``: every document refined with all its stored
tokens), through ``aligner-eval``'s library (``beir_eval.evaluate``) in this process.

Quality only: no latency is reported (the runs may share the machine). Writes
``benchmarks/results/<name>.{json,md,png}``; each run's folder (metrics.json, run file)
under ``--work_dir``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gin
import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import result_files  # noqa: E402

from aligner_jax.common import cli  # noqa: E402
from aligner_jax.evaluation import beir_eval  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402

_COLLECTIONS = flags.DEFINE_list("collections", ["scifact", "cisi"], "BEIR folders to measure.")
_DATA_ROOT = flags.DEFINE_string("data_root", str(REPO.parent / "shared/data/beir"), "BEIR root.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "outputs/scifact_minilm", "The trained model.")
_MODEL_GIN = flags.DEFINE_string("model_gin", "models/minilm.gin", "The model's gin file.")
_WORK_DIR = flags.DEFINE_string("work_dir", "/tmp/zero_salience", "Stores and run folders.")
_NAME = flags.DEFINE_string("name", "zero_salience", "Result files benchmarks/results/<name>.*")
_REUSE = flags.DEFINE_bool("reuse", False, "Read a run's metrics.json when its folder has one.")

STORES = (("kept", False), ("dropped", True))  # IndexingConfig.drop_zero_salience
SEARCHES = (  # (name, gin files, bindings)
    ("centroid", [], ["SearchConfig.backend = 'centroid'"]),
    ("exhaustive", ["eval/exhaustive.gin"], []),
)


def run(collection: str, store: str, drop: bool, search: str, files: list, bindings: list) -> dict:
    """One ``aligner-eval`` run; the centroid run builds the store the exhaustive one reuses."""
    folder = Path(_WORK_DIR.value) / collection / store
    out = folder / search
    if _REUSE.value and (out / "metrics.json").exists():
        return json.loads((out / "metrics.json").read_text())
    gin.clear_config()
    cli.parse_gin(
        [_MODEL_GIN.value, *files],
        [
            f"load_encoder.checkpoint = '{_CHECKPOINT.value}'",
            f"IndexingConfig.drop_zero_salience = {drop}",
            *bindings,
        ],
    )
    return beir_eval.evaluate(
        dataset_dir=str(Path(_DATA_ROOT.value) / collection),
        output_dir=str(out),
        index_dir=str(folder / "index"),
    )


def store_row(directory: Path) -> dict:
    store = ts.TokenStore(directory)
    zero = float(np.mean(np.asarray(store.salience()) == 0))
    return {"tokens": store.num_tokens, "store_bytes": store.nbytes(), "zero_salience": zero}


def markdown(results: dict) -> str:
    lines = [
        f"Model: `{results['checkpoint']}` (`{results['model_gin']}`). nDCG@10 and R@100 ×100 "
        "on each collection's test queries.",
        "",
        "| collection | zero-salience tokens | tokens stored | share with u^d = 0 | store MB | "
        "nDCG@10 centroid | nDCG@10 exhaustive | R@100 centroid | R@100 exhaustive |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for collection, stores in results["collections"].items():
        for store, r in stores.items():
            c, e = r["centroid"], r["exhaustive"]
            lines.append(
                f"| {collection} | {store} | {r['tokens']:,} | {r['zero_salience']:.2f} | "
                f"{r['store_bytes'] / 1e6:.0f} | {100 * c['ndcg@10']:.1f} | "
                f"{100 * e['ndcg@10']:.1f} | {100 * c['recall@100']:.1f} | "
                f"{100 * e['recall@100']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    cells = [
        (collection, search) for collection in results["collections"] for search, _, _ in SEARCHES
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.38
    for i, (store, _) in enumerate(STORES):
        ys = [100 * results["collections"][c][store][s]["ndcg@10"] for c, s in cells]
        ax.bar(np.arange(len(cells)) + i * width, ys, width, label=f"zero-salience tokens {store}")
        for x, y in zip(np.arange(len(cells)) + i * width, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(cells)) + width / 2)
    ax.set_xticklabels([f"{c}\n{s}" for c, s in cells], fontsize=8)
    ax.set_ylabel("nDCG@10 (test)")
    ax.set_title("Tokens of zero salience kept in the store or dropped", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    plotting.save(fig, path)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    results = {
        "machine": result_files.machine(),
        "checkpoint": _CHECKPOINT.value,
        "model_gin": _MODEL_GIN.value,
        "collections": {},
    }
    for collection in _COLLECTIONS.value:
        stores = results["collections"][collection] = {}
        for store, drop in STORES:
            runs = {s: run(collection, store, drop, s, f, b) for s, f, b in SEARCHES}
            stores[store] = store_row(Path(_WORK_DIR.value) / collection / store / "index")
            for search, report in runs.items():
                stores[store][search] = {
                    "ndcg@10": report["metrics"]["ndcg@10"],
                    "recall@100": report["metrics"]["recall@100"],
                }
            print(json.dumps({collection: {store: stores[store]}}), flush=True)
    result_files.save(results, _NAME.value, markdown, plot)


if __name__ == "__main__":
    app.run(main)
