r"""Cost of an ``--add`` at scale (issue 23): a fraction more documents appended to a grown store.

Takes a store grown and indexed by ``benchmarks/scale.py --keep_stores`` (its search index built,
its exhaustive reference ``exhaustive.json`` computed) and:

  1. writes the documents to add (``--fraction`` of the store's, distractors made as
     ``scale.py`` makes them, another seed) into a staging store, and scores them exhaustively
     (``scale.py``'s exhaustive child: the staged documents alone);
  2. **add**, in a fresh process whose wall time and peak RSS are measured from outside: the
     staged documents appended with ``updates.add_encoded`` (new store shards, then the search
     index's next generation: a segment and a delta list group) — what ``aligner-index --add``
     does after encoding;
  3. **search** after the add (``scale.py``'s search child: latency, the default settings);
  4. **exhaustive** over the updated store (``--check_exhaustive``), compared with what a
     rebuild must return: the top k of the store's earlier exhaustive ranking merged with the
     staged documents' (same documents, same scores, same order), and the search's quality
     against it.

The add's cost is compared with the store's full build (``aligner-index --search_index``) as
``scale.json`` records it for the same store (``--build_s`` overrides).

  .venv/bin/python benchmarks/scale_add.py --index_dir=/work/scale_work/trained/x100 \
      --scale_json=benchmarks/results/scale.json --check_exhaustive

Writes ``OUTPUT_DIR/scale_add.{json,md,png}`` (rows merged by store and fraction).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import scale  # noqa: E402

FLAGS = flags.FLAGS
SCALE = [sys.executable, str(REPO / "benchmarks" / "scale.py")]  # its children


def add_child(index_dir: Path, staged: Path) -> None:
    """(child) Appends every document of the staging store to ``index_dir``."""
    from aligner_jax.indexing import indexer, updates
    from aligner_jax.indexing import token_store as ts

    source = ts.TokenStore(staged)

    def documents():
        for i, (shard, token_start, doc_start) in enumerate(source.shard_spans()):
            vectors, salience, local = source.shard_arrays(i)
            token_ids = source.token_ids(token_start, token_start + shard["num_tokens"])
            for j in range(shard["num_docs"]):
                lo, hi = int(local[j]), int(local[j + 1])
                yield ts.EncodedDocument(
                    source.doc_ids[doc_start + j],
                    np.asarray(vectors[lo:hi]),
                    np.asarray(salience[lo:hi]),
                    np.asarray(token_ids[lo:hi]),
                )

    with indexer.writer_lock(index_dir):
        summary = updates.add_encoded(index_dir, documents())
    index = json.loads((Path(index_dir) / ts.MANIFEST).read_text())["search_index"]
    meta = json.loads((Path(index_dir) / index["meta"]).read_text())
    summary["index_update"] = meta["updates"][-1]
    print(json.dumps(summary))


def merged_top(runs: list[tuple[dict, dict]], k: int) -> tuple[dict, dict]:
    """The top ``k`` of several exhaustive rankings of disjoint documents (``(ids, scores)``
    per run), by score, earlier runs first on ties (their documents precede in the store)."""
    ids, scores = {}, {}
    for q in runs[0][0]:
        all_ids = [d for run_ids, _ in runs for d in run_ids[q]]
        all_scores = np.concatenate([np.asarray(s[q], np.float32) for _, s in runs])
        top = np.argsort(-all_scores, kind="stable")[:k]
        ids[q] = [all_ids[t] for t in top]
        scores[q] = all_scores[top].tolist()
    return ids, scores


def _read_ranking(path: Path) -> tuple[dict, dict]:
    return (
        json.loads(path.read_text()),
        json.loads(scale.exhaustive_scores_path(path).read_text()),
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Cost of an --add at scale (issue 23)",
        "",
        "Written by `benchmarks/scale_add.py` (see its docstring). The add ran in a fresh "
        "process (peak RSS from outside); it appends documents encoded elsewhere "
        "(`updates.add_encoded`: store shards, then the search index's next generation), "
        "so query and document encoding are excluded, as in the build it is compared with. "
        "Search after the add: 2 BLAS threads, k = 100, the default settings.",
        "",
        "| store | tokens before | added docs / tokens | add s | of which index update s | "
        "add peak RSS GiB | full build s | add / build | list groups | p50 / p99 ms after | "
        "exhaustive after = merged rebuild | top-10 overlap | top-10 overlap, k = 10 | "
        "distractors in exh. top 10 | top-10 overlap, own docs | nDCG@10 (exh.) | R@100 (exh.) | "
        "load avg |",
        "|" + "---|" * 18,
    ]
    for r in rows:
        check = r.get("exhaustive_equals_rebuild")
        lines.append(
            f"| {r['store']} | {r['tokens_before'] / 1e6:.1f}M | {r['added_docs']} / "
            f"{r['added_tokens'] / 1e6:.2f}M | {r['add_s']:.1f} | {r['index_update_s']:.1f} | "
            f"{r['add_peak_rss_gib']:.2f} | {r['build_s']:.0f} | "
            f"{100 * r['add_fraction_of_build']:.2f} % | {r['list_groups']} | "
            f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} | "
            f"{'not checked' if check is None else ('yes' if check else 'NO')} | "
            f"{scale.quality_cells(r)} | {r['machine_load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.8 * len(rows)))
    labels = [f"{r['store']}, +{100 * r['fraction']:g} %" for r in rows]
    y = np.arange(len(rows))
    ax.barh(y + 0.2, [r["build_s"] for r in rows], 0.4, label="full build")
    ax.barh(y - 0.2, [r["add_s"] for r in rows], 0.4, label="--add (store shards + index)")
    ax.set_yticks(y, labels)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.set_title("cost of an --add against a full build", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    plotting.save(fig, path)


def write_results(out_dir: Path, row: dict) -> None:
    from aligner_jax.common import fileio

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "scale_add.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in rows if (r["store"], r["fraction"]) != (row["store"], row["fraction"])]
    rows.append(row)
    fileio.atomic_write_json(path, {"rows": rows})
    fileio.atomic_write_bytes(out_dir / "scale_add.md", markdown(rows).encode())
    plot(rows, out_dir / "scale_add.png")


def define_flags() -> None:
    flags.DEFINE_string("index_dir", None, "A grown, indexed store (scale.py --keep_stores).")
    flags.DEFINE_float("fraction", 0.01, "Documents added, as a fraction of the store's.")
    flags.DEFINE_string("source_index", None, "The real store (default: scale.SOURCES[model]).")
    flags.DEFINE_enum("model", "trained", list(scale.SOURCES), "The grown store's model.")
    flags.DEFINE_string("scale_json", None, "scale.json holding the store's full build time.")
    flags.DEFINE_float("build_s", None, "The store's full build time (default: scale_json's).")
    flags.DEFINE_string("dataset_dir", "../shared/data/beir/scifact", "BEIR folder (qrels).")
    flags.DEFINE_string("output_dir", "benchmarks/results", "Where scale_add.* go.")
    flags.DEFINE_bool("check_exhaustive", False, "Score the updated store exhaustively too.")
    flags.DEFINE_integer("seed", 1000, "Seed of the added distractors.")
    flags.DEFINE_enum("child", None, ["add"], "(internal)")
    flags.DEFINE_string("staged", None, "(internal) the staging store of an add child.")
    flags.mark_flag_as_required("index_dir")


def main(argv) -> None:
    del argv
    from aligner_jax.data import beir
    from aligner_jax.indexing import token_store as ts

    index_dir = Path(FLAGS.index_dir).resolve()
    staged = index_dir.with_name(index_dir.name + "_added")
    if FLAGS.child == "add":
        return add_child(index_dir, Path(FLAGS.staged))
    out_dir = (REPO / FLAGS.output_dir).resolve()
    work = index_dir.parent
    log = work / "children.log"
    queries_npz = work / "queries.npz"
    before = ts.TokenStore(index_dir)
    store_name = f"{FLAGS.model} {index_dir.name}"
    build_s = FLAGS.build_s
    if build_s is None:
        rows = json.loads(Path(FLAGS.scale_json).read_text())["rows"]
        meta = json.loads((index_dir / before.manifest["search_index"]["meta"]).read_text())
        bits = meta["config"]["residual_bits"]
        (build_s,) = [
            r["build_s"]
            for r in rows
            if (r["model"], r["tokens"], r["bits"]) == (FLAGS.model, before.num_tokens, bits)
        ]
    source_dir = (REPO / (FLAGS.source_index or scale.SOURCES[FLAGS.model])).resolve()
    source = ts.TokenStore(source_dir)
    sigma = scale.residual_sigma(work / "x1")
    count = int(round(FLAGS.fraction * before.num_docs))
    if staged.exists():
        shutil.rmtree(staged)
    real = scale.source_arrays(source)
    shard_size = int(before.manifest["indexing"]["shard_size"])
    with ts.TokenStoreWriter(staged, before.manifest["model"], shard_size=shard_size) as writer:
        for doc in scale.distractors(source, real, count, sigma, FLAGS.seed, "added", shard_size):
            writer.add(doc.doc_id, doc.vectors, doc.salience, doc.token_ids)
    del real
    staged_exact = staged / "exhaustive.json"
    scale.run_child(SCALE + ["--child=exhaustive", f"--index_dir={staged}", f"--queries_npz={queries_npz}", f"--out={staged_exact}"], 2, log)  # fmt: skip
    me = [sys.executable, str(Path(__file__).resolve())]
    added = scale.run_child(me + [f"--index_dir={index_dir}", "--child=add", f"--staged={staged}"], 2, log)  # fmt: skip
    after = ts.TokenStore(index_dir)
    found_path = index_dir / "search_after_add.json"
    search = scale.run_child(SCALE + ["--child=search", f"--index_dir={index_dir}", f"--queries_npz={queries_npz}", f"--out={found_path}"], 2, log)  # fmt: skip
    update = added["index_update"]
    row = {
        "store": store_name,
        "fraction": FLAGS.fraction,
        "tokens_before": before.num_tokens,
        "docs_before": before.num_docs,
        "added_docs": after.num_docs - before.num_docs,
        "added_tokens": after.num_tokens - before.num_tokens,
        "add_s": added["wall_s"],
        "index_update_s": added["commit_s"],
        "add_peak_rss_gib": added["peak_rss_gib"],
        "build_s": build_s,
        "add_fraction_of_build": added["wall_s"] / build_s,
        "list_groups": update["list_groups"],
        "drift": update.get("drift"),
        "p50_ms": search["p50_ms"],
        "p99_ms": search["p99_ms"],
        "p50_ms_k10": search["p50_ms_k10"],
        "p99_ms_k10": search["p99_ms_k10"],
        "machine_load": search["machine_load"],
        "threads": 2,
    }
    if FLAGS.check_exhaustive:
        exact_path = index_dir / "exhaustive_after_add.json"
        scale.run_child(SCALE + ["--child=exhaustive", f"--index_dir={index_dir}", f"--queries_npz={queries_npz}", f"--out={exact_path}"], 2, log)  # fmt: skip
        exact_ids, exact_scores = _read_ranking(exact_path)
        merged_ids, merged_scores = merged_top(
            [_read_ranking(index_dir / "exhaustive.json"), _read_ranking(staged_exact)],
            len(next(iter(exact_ids.values()))),
        )
        row["exhaustive_equals_rebuild"] = merged_ids == exact_ids and all(
            np.array_equal(merged_scores[q], exact_scores[q]) for q in exact_ids
        )
        row["queries_with_added_docs_in_top100"] = sum(
            any(d.startswith("added-") for d in exact_ids[q]) for q in exact_ids
        )
        qrels = beir.load_qrels((REPO / FLAGS.dataset_dir).resolve() / "qrels" / "test.tsv")
        row.update(scale.quality(json.loads(found_path.read_text()), exact_ids, qrels))
    print(json.dumps(row), flush=True)
    write_results(out_dir, row)
    print(f"wrote {out_dir / 'scale_add.json'}, scale_add.md, scale_add.png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
