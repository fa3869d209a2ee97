r"""Does ``--compact``'s drift rule tell new documents of the same corpus from another corpus's?

    .venv/bin/python benchmarks/compaction_drift.py \
        --index_dir=outputs/zero_shot_scifact/index \
        --other_corpus=/work/shared/data/beir/cisi/corpus.jsonl

From an index's token store (``make demo``'s zero-shot SciFact index by default; nothing is
encoded again for it), in ``--work_dir``:

1. a store of a random ``--base_fraction`` of its documents (seeded; their stored vectors,
   written with ``TokenStoreWriter``) and its search index with the default settings
   (``CentroidIndex.build``);
2. the reference an update's tokens are compared with, both ways: today's (the mean max centroid
   score of up to 65,536 build-time tokens outside the k-means sample, ``_held_out_score``) and
   the rule before it (the mean over every build-time token, the sample's included, streamed
   here with the same assignment);
3. two copies of that index, each given one ``updates.add_encoded``: the store's other
   documents (the same corpus, drawn at random), and ``--other_docs`` documents of ``--other_corpus`` encoded by
   the index's own model (another corpus);
4. per addition, the drift under each reference and whether ``--compact`` (``DRIFT_LIMIT``)
   would re-cluster.

Writes ``compaction_drift.{json,md,png}`` in ``--output_dir`` (default ``benchmarks/results``),
with the machine's load average.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import types
from pathlib import Path

import numpy as np
from absl import app, flags

from aligner_jax.common import fileio
from aligner_jax.data import beir
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.evaluation import plotting
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer, kmeans, updates
from aligner_jax.indexing import token_store as ts

REPO = Path(__file__).resolve().parents[1]
F = types.SimpleNamespace()


def _define_flags() -> None:
    F.index_dir = flags.DEFINE_string(
        "index_dir", str(REPO / "outputs/zero_shot_scifact/index"), "An index (its store)."
    )
    F.other_corpus = flags.DEFINE_string(
        "other_corpus", "/work/shared/data/beir/cisi/corpus.jsonl", "Another corpus.jsonl."
    )
    F.other_docs = flags.DEFINE_integer("other_docs", 500, "Documents of it to add.")
    F.base_fraction = flags.DEFINE_float("base_fraction", 0.9, "Documents of the first build.")
    F.work_dir = flags.DEFINE_string("work_dir", "/tmp/compaction_drift", "Scratch folder.")
    F.output_dir = flags.DEFINE_string(
        "output_dir", str(REPO / "benchmarks/results"), "Where the results go."
    )


def _write_store(store: ts.TokenStore, directory: Path, docs) -> ts.TokenStore:
    model = {k: v for k, v in store.manifest["model"].items()}
    with ts.TokenStoreWriter(directory, model) as writer:
        for d in docs:
            vectors, salience, token_ids = store.document(int(d))
            writer.add(store.doc_ids[d], vectors, salience, token_ids)
    shutil.copy(store.directory / indexer.ENCODER_FILE, directory / indexer.ENCODER_FILE)
    return writer.store


def _all_token_reference(store: ts.TokenStore, index: ci.CentroidIndex) -> float:
    """The rule before: the mean max centroid score of every build-time token."""
    centroids, cells = np.asarray(index.centroids), np.asarray(index.cells)
    total, count = 0.0, 0
    for i in range(store.num_shards):
        vectors = store.shard_arrays(i)[0]
        for lo in range(0, len(vectors), ci.CHUNK):
            best = kmeans.assign_two_level(
                np.asarray(vectors[lo : lo + ci.CHUNK], np.float32), centroids, cells
            )[1]
            total += float(best.sum(dtype=np.float64))
            count += len(best)
    return total / count


def _added(directory: Path, documents) -> dict:
    updates.add_encoded(directory, documents)
    index = ci.CentroidIndex.load(ts.TokenStore(directory))
    record = index.meta["updates"][-1]
    return {"tokens": record["new_tokens"], "mean_score": record["mean_centroid_score"]}


def main(argv) -> None:
    del argv
    work = Path(F.work_dir.value)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    load_before = os.getloadavg()
    source = ts.TokenStore(F.index_dir.value)
    cut = int(source.num_docs * F.base_fraction.value)
    order = np.random.default_rng(0).permutation(source.num_docs)
    first, rest = np.sort(order[:cut]), np.sort(order[cut:])
    t0 = time.perf_counter()
    base = _write_store(source, work / "base", first)
    index = ci.CentroidIndex.build(base)
    build_s = time.perf_counter() - t0
    held_out = index.meta["mean_centroid_score"]
    every_token = _all_token_reference(base, index)

    same = [ts.EncodedDocument(source.doc_ids[d], *source.document(int(d))) for d in rest]
    spec = ts.read_json(source.directory / indexer.ENCODER_FILE)
    encoder = Encoder(loading.encoder_from_spec(spec), EncodingConfig())
    other = list(beir.iter_corpus(F.other_corpus.value))[: F.other_docs.value]
    encoded = encoder.encode([beir.document_text(d) for d in other], "doc")
    other_docs = [
        ts.EncodedDocument(f"other-{d.doc_id}", e.vectors, e.salience, e.token_ids)
        for d, e in zip(other, encoded, strict=True)
    ]
    rows = []
    for name, docs in (("the same corpus's other documents", same), ("another corpus", other_docs)):
        copy = work / f"copy-{len(rows)}"
        shutil.copytree(work / "base", copy)
        added = _added(copy, docs)
        drift_now, drift_before = held_out - added["mean_score"], every_token - added["mean_score"]
        rows.append(
            {
                "added": name,
                "docs": len(docs),
                **added,
                "drift": drift_now,
                "drift_all_token_reference": drift_before,
                "compacts": drift_now > ci.DRIFT_LIMIT,
                "compacted_before": drift_before > ci.DRIFT_LIMIT,
            }
        )
        print(json.dumps(rows[-1]))
    result = {
        "index_dir": str(source.directory),
        "other_corpus": F.other_corpus.value,
        "base_docs": cut,
        "base_tokens": base.num_tokens,
        "num_centroids": index.num_centroids,
        "build_s": build_s,
        "reference_held_out": held_out,
        "reference_every_token": every_token,
        "drift_limit": ci.DRIFT_LIMIT,
        "rows": rows,
        "machine_load": {"before": load_before, "after": os.getloadavg()},
    }
    _save(result, Path(F.output_dir.value))
    shutil.rmtree(work, ignore_errors=True)


def _save(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The drift rule of --compact (benchmarks/compaction_drift.py)",
        "",
        f"Index `{result['index_dir']}`: {result['base_docs']} documents "
        f"({result['base_tokens']:,} tokens, {result['num_centroids']:,} centroids) built, "
        "then one addition to a copy each. Reference: held-out tokens "
        f"{result['reference_held_out']:.4f} (today), every build token "
        f"{result['reference_every_token']:.4f} (before). `--compact` re-clusters above "
        f"{result['drift_limit']}.",
        "",
        "| added | docs | tokens | mean score | drift (today) | compacts | drift (before) "
        "| compacted |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['added']} | {r['docs']} | {r['tokens']:,} | {r['mean_score']:.4f} | "
            f"{r['drift']:.4f} | {r['compacts']} | {r['drift_all_token_reference']:.4f} | "
            f"{r['compacted_before']} |"
        )
    load = result["machine_load"]
    lines += ["", f"Load average before → after: {load['before']} → {load['after']}."]
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    x = np.arange(len(result["rows"]))
    ax.bar(x - 0.2, [r["drift"] for r in result["rows"]], 0.4, label="held-out reference (today)")
    ax.bar(
        x + 0.2,
        [r["drift_all_token_reference"] for r in result["rows"]],
        0.4,
        label="every build token (before)",
    )
    ax.axhline(result["drift_limit"], color="k", linestyle="--", label="DRIFT_LIMIT")
    ax.set_xticks(x, [r["added"] for r in result["rows"]])
    ax.set_ylabel("drift (mean max centroid score)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compaction_drift.png", dpi=120)
    fileio.atomic_write_json(out / "compaction_drift.json", result)
    fileio.atomic_write_text(out / "compaction_drift.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}/compaction_drift.{{json,md,png}}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
