r"""What ``aligner-index --vacuum`` gives back and costs, on a real index (SciFact zero-shot by
default).

    .venv/bin/python benchmarks/vacuum.py --index_dir=outputs/zero_shot_scifact/index \
      --dataset_dir=../shared/data/beir/scifact --delete_fraction=0.2

A copy of the index (under --work_dir) gets a seeded random ``--delete_fraction`` of its
documents deleted (``updates.delete_documents``, one commit). Then, measured:

  * bytes on disk of the store's shard files and of ``documents.sqlite``, and the number of
    files, before the vacuum, after it, and after a second vacuum (which deletes the replaced
    shards' table rows and shrinks the table);
  * the vacuum's wall time and peak RSS, the binary (``aligner-index --vacuum``) run in a fresh
    process (``scale.run_child``: GNU ``time -v``, from outside); for comparison, the same
    deletions on a second copy followed by ``--force_compact`` (the re-cluster a vacuum
    includes), in a fresh process right after;
  * answers: every test query searched before and after, exhaustive (``mode="exhaustive"``:
    every live document scored with all its stored vectors: the vacuum must not change one id
    or score) and fast (the default centroid search: its search index is re-clustered, so its
    top 10 may differ; nDCG@10 before and after, and the top-10 overlap).

With ``--grow=10,30`` (× SciFact, ``--grow_model``'s store grown with distractor documents as
``benchmarks/scale.py`` grows it, its search index built by ``aligner-index --search_index``),
the same deletion and vacuum at each size, for the vacuum's time and peak RSS against the
corpus (each store is deleted after).

Writes ``<output>/<name>.{json,md,png}`` (``benchmarks/results``); delete --work_dir after.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import result_files  # noqa: E402
import scale  # noqa: E402

from aligner_jax.data import beir  # noqa: E402
from aligner_jax.evaluation import metrics  # noqa: E402
from aligner_jax.indexing import documents as documents_lib  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402
from aligner_jax.indexing import updates  # noqa: E402
from aligner_jax.retrieval import searcher as search_lib  # noqa: E402

_INDEX_DIR = flags.DEFINE_string(
    "index_dir", str(REPO / "outputs" / "zero_shot_scifact" / "index"), "A built index."
)
_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir", str(REPO.parent / "shared" / "data" / "beir" / "scifact"), "Its BEIR folder."
)
_SPLIT = flags.DEFINE_string("split", "test", "Qrels split of the queries searched.")
_FRACTION = flags.DEFINE_float("delete_fraction", 0.2, "Share of the documents deleted.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the deleted documents.")
_WORK_DIR = flags.DEFINE_string("work_dir", "/tmp/vacuum_bench", "Where the copies go.")
_OUTPUT = flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Results folder.")
_NAME = flags.DEFINE_string("name", "vacuum", "Result files <output>/<name>.*")
_GROW = flags.DEFINE_list("grow", [], "Also grown stores of these scales (× SciFact).")
_GROW_MODEL = flags.DEFINE_enum("grow_model", "trained", list(scale.SOURCES), "Store to grow.")


def disk(directory: Path) -> dict:
    """Bytes and files of the store's shards and of the documents table."""
    shards = [p for p in directory.glob("shard-*") if p.is_file()]
    table = directory / documents_lib.FILE
    return {
        "store_bytes": sum(p.stat().st_size for p in shards),
        "store_files": len(shards),
        "table_bytes": table.stat().st_size if table.exists() else 0,
        "search_index_bytes": sum(
            p.stat().st_size for p in (directory / "search_index").glob("*") if p.is_file()
        ),
    }


def answers(directory: Path, queries: dict[str, str]) -> dict:
    """Top-100 of each query, exhaustive and fast, as ``{mode: {qid: [[doc_id, score], ...]}}``."""
    out = {}
    for mode in ("exhaustive", "fast"):
        searcher = search_lib.Searcher.load(str(directory), mode=mode)
        out[mode] = {
            qid: [[h.doc_id, float(h.score)] for h in searcher.search(text, k=100)]
            for qid, text in queries.items()
        }
    return out


def compare(before: dict, after: dict, qrels: dict) -> dict:
    """Exhaustive: ids and scores equal; fast: nDCG@10 before/after and top-10 overlap."""
    exact = before["exhaustive"]
    same_ids = sum(
        [d for d, _ in exact[q]] == [d for d, _ in after["exhaustive"][q]] for q in exact
    )
    score_diff = max(
        float(np.max(np.abs(np.subtract([s for _, s in exact[q]], [s for _, s in a]))))
        for q, a in after["exhaustive"].items()
    )

    def ndcg(run: dict) -> float:
        results = {q: {d: s for d, s in hits} for q, hits in run.items()}
        return 100 * metrics.evaluate_run(qrels, results).aggregate["ndcg@10"]

    overlap = [
        len({d for d, _ in before["fast"][q][:10]} & {d for d, _ in after["fast"][q][:10]}) / 10
        for q in before["fast"]
    ]
    return {
        "queries": len(exact),
        "exhaustive_same_ids": same_ids,
        "exhaustive_max_score_diff": score_diff,
        "ndcg@10_exhaustive": [ndcg(exact), ndcg(after["exhaustive"])],
        "ndcg@10_fast": [ndcg(before["fast"]), ndcg(after["fast"])],
        "fast_top10_overlap": float(np.mean(overlap)),
    }


def deleted_copy(source: Path, target: Path, fraction: float, seed: int) -> int:
    """A copy of ``source`` with a seeded ``fraction`` of its live documents deleted."""
    if target != source:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
    live = sorted(ts.TokenStore(target).live_positions())
    rng = np.random.default_rng(seed)
    ids = [live[i] for i in rng.choice(len(live), int(round(fraction * len(live))), False)]
    updates.delete_documents(str(target), ids)
    return len(ids)


def binary(directory: Path, flag: str, log: Path) -> dict:
    cmd = [sys.executable, "-m", "aligner_jax.index", f"--index_dir={directory}", flag]
    load = os.getloadavg()[0]
    result = scale.run_child(cmd, threads=2, log=log)
    return {**result, "machine_load": load}


def grown(scales: list[str], work: Path, log: Path) -> list[dict]:
    """The vacuum of ``--delete_fraction`` of each grown store: sizes, time, peak RSS."""
    source = scale.REPO / scale.SOURCES[_GROW_MODEL.value]
    one = work / "x1"
    scale.make_store(source, one, 1.0, 0.0)
    binary(one, "--search_index", log)  # residual_sigma reads its centroids
    sigma = scale.residual_sigma(one)
    shutil.rmtree(one)
    rows = []
    for factor in sorted(float(x) for x in scales):
        store_dir = work / f"x{factor:g}"
        made = scale.make_store(source, store_dir, factor, sigma, seed=int(factor))
        print(f"x{factor:g}: {made}", flush=True)
        build = binary(store_dir, "--search_index", log)
        deleted = deleted_copy(store_dir, store_dir, _FRACTION.value, _SEED.value)
        before = disk(store_dir)
        vacuum = binary(store_dir, "--vacuum", log)
        rows.append(
            {
                "model": _GROW_MODEL.value,
                "scale": factor,
                "tokens": made["tokens"],
                "docs": made["docs"],
                "deleted_docs": deleted,
                "build": build,
                "vacuum": vacuum,
                "disk": {"before": before, "after": disk(store_dir)},
            }
        )
        shutil.rmtree(store_dir)
    return rows


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    work = Path(_WORK_DIR.value)
    work.mkdir(parents=True, exist_ok=True)
    dataset = Path(_DATASET_DIR.value)
    qrels = beir.load_qrels(dataset / "qrels" / f"{_SPLIT.value}.tsv")
    queries = {q: t for q, t in beir.load_queries(dataset / "queries.jsonl").items() if q in qrels}
    index = work / "vacuumed"
    deleted = deleted_copy(Path(_INDEX_DIR.value), index, _FRACTION.value, _SEED.value)
    print(f"deleted {deleted:,} documents; searching {len(queries)} queries", flush=True)
    before_disk = disk(index)
    before = answers(index, queries)
    log = work / "vacuum.log"
    vacuum = binary(index, "--vacuum", log)
    after_disk = disk(index)
    after = answers(index, queries)
    second = binary(index, "--vacuum", log)  # the replaced shards' table rows go
    compact_copy = work / "compacted"
    deleted_copy(Path(_INDEX_DIR.value), compact_copy, _FRACTION.value, _SEED.value)
    compact = binary(compact_copy, "--force_compact", log)
    shutil.rmtree(compact_copy)
    manifest = ts.read_manifest(index)
    results = {
        "machine": result_files.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "index_dir": _INDEX_DIR.value,
        "dataset": dataset.name,
        "split": _SPLIT.value,
        "delete_fraction": _FRACTION.value,
        "deleted_docs": deleted,
        "live_docs": manifest["counts"]["num_docs"],
        "live_tokens": manifest["counts"]["num_tokens"],
        "disk": {"before": before_disk, "after": after_disk, "after_second": disk(index)},
        "vacuum": vacuum,
        "second_vacuum": second,
        "force_compact": compact,
        "answers": compare(before, after, qrels),
        "grown": grown(_GROW.value, work, log) if _GROW.value else [],
    }
    path = result_files.save(results, _NAME.value, markdown, plot, _OUTPUT.value)
    print(f"wrote {path}, .md, .png; copies under {work} (delete them)")


def markdown(r: dict) -> str:
    d, a, v, c = r["disk"], r["answers"], r["vacuum"], r["force_compact"]
    mib = 2**20
    lines = [
        "# Vacuum (`benchmarks/vacuum.py`)",
        "",
        f"{r['machine']}, {r['time']}. {r['dataset']}: {r['deleted_docs']:,} documents deleted "
        f"at random ({r['delete_fraction']:.0%}), then `aligner-index --vacuum` in a fresh "
        f"process; {r['live_docs']:,} documents ({r['live_tokens']:,} tokens) stay.",
        "",
        "| | store MiB | store files | documents.sqlite MiB | search index MiB |",
        "|---|---|---|---|---|",
    ]
    for name, key in (("before", "before"), ("after", "after"), ("second vacuum", "after_second")):
        x = d[key]
        lines.append(
            f"| {name} | {x['store_bytes'] / mib:.1f} | {x['store_files']} | "
            f"{x['table_bytes'] / mib:.2f} | {x['search_index_bytes'] / mib:.1f} |"
        )
    lines += [
        "",
        "| job | wall s | peak RSS GiB | load |",
        "|---|---|---|---|",
        f"| --vacuum | {v['wall_s']:.1f} | {v['peak_rss_gib']:.2f} | {v['machine_load']:.1f} |",
        f"| --vacuum again | {r['second_vacuum']['wall_s']:.1f} | "
        f"{r['second_vacuum']['peak_rss_gib']:.2f} | {r['second_vacuum']['machine_load']:.1f} |",
        f"| --force_compact (same deletions) | {c['wall_s']:.1f} | {c['peak_rss_gib']:.2f} | "
        f"{c['machine_load']:.1f} |",
        "",
        f"Answers, {a['queries']} {r['split']} queries: exhaustive top-100 ids identical on "
        f"{a['exhaustive_same_ids']} (largest score difference {a['exhaustive_max_score_diff']:.2g}); "
        f"nDCG@10 exhaustive {a['ndcg@10_exhaustive'][0]:.1f} → {a['ndcg@10_exhaustive'][1]:.1f}, "
        f"fast {a['ndcg@10_fast'][0]:.1f} → {a['ndcg@10_fast'][1]:.1f} (re-clustered); fast "
        f"top-10 overlap before/after {a['fast_top10_overlap']:.3f}.",
    ]
    if r.get("grown"):
        lines += [
            "",
            f"Grown stores ({r['grown'][0]['model']}, distractors as `scale.py`), the same "
            "deletion, `--vacuum` in a fresh process:",
            "",
            "| scale | tokens | documents | deleted | search index build s / peak GiB | "
            "vacuum s / peak GiB | store GiB before → after | load |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for g in r["grown"]:
            b, v, gib = g["build"], g["vacuum"], 2**30
            lines.append(
                f"| {g['scale']:g}× | {g['tokens']:,} | {g['docs']:,} | {g['deleted_docs']:,} | "
                f"{b['wall_s']:.0f} / {b['peak_rss_gib']:.2f} | {v['wall_s']:.0f} / "
                f"{v['peak_rss_gib']:.2f} | {g['disk']['before']['store_bytes'] / gib:.2f} → "
                f"{g['disk']['after']['store_bytes'] / gib:.2f} | {v['machine_load']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = ["before", "after", "after_second"]
    labels = ["before", "after vacuum", "after 2nd vacuum"]
    x = np.arange(len(names))
    for offset, key, label in (
        (-0.27, "store_bytes", "store shards"),
        (0.0, "search_index_bytes", "search index"),
        (0.27, "table_bytes", "documents.sqlite"),
    ):
        ax.bar(x + offset, [r["disk"][n][key] / 2**20 for n in names], 0.27, label=label)
    ax.set_xticks(x, labels)
    ax.set_ylabel("MiB on disk")
    ax.set_title(
        f"{r['dataset']}, {r['delete_fraction']:.0%} deleted: --vacuum "
        f"{r['vacuum']['wall_s']:.0f} s, peak RSS {r['vacuum']['peak_rss_gib']:.2f} GiB",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    plotting.save(fig, path)


if __name__ == "__main__":
    app.run(main)
