r"""Build (and encode) throughput on each JAX backend of the machine (issue 23, item 5).

**Build.** A token store is grown to each of ``--scales`` times the base store's documents
(``scale.make_store``: the base's real documents plus distractors made of its real token vectors,
jittered by ``--sigma`` and re-normalised), then its search index is built by
``aligner-index --index_dir=DIR --search_index --gin.CentroidIndexConfig.residual_bits=BITS`` in
a fresh child process per ``--platforms`` entry (the child's ``JAX_PLATFORMS``: ``cpu``,
``cuda``, ``tpu``), each with ``--threads`` BLAS threads (default: every core), peak RSS read
from outside. The k-means fit, the coarse assignment and the k-means updates are JAX (they run on
the accelerator); the fine assignment inside each cell, the residual codec and the inverted file
are NumPy on the host. Each row gives the index's own timing record (``kmeans_s``: sampling and
the k-means fit; ``seconds``: that plus compressing every token) and the child's wall time
(which adds the inverted file, the checksums and the process start), and the index's mean
centroid score (the fit's quality, comparable across backends).

**Encode** (``--encode_dataset``): ``aligner-index --dataset_dir=DIR`` of that BEIR corpus with
the trained architecture (``gin/models/minilm.gin``: MiniLM + 128-d projection + salience) and
``--encode_weights`` (``random`` measures the speed without the pretrained weights: the cost does
not depend on their values), no search index; tokens per second of the whole indexing job
(tokenize → encode → write the store) from its own summary.

  .venv/bin/python benchmarks/build_throughput.py --base_store=outputs/trained_scifact/index \
      --scales=1,10 --platforms=cpu
  python benchmarks/build_throughput.py --base_store=B --sigma=0.0488 --scales=100,300 \
      --platforms=cuda,cpu --encode_dataset=D --output_dir=$OUT      # on a GPU host

Writes ``OUTPUT_DIR/OUTPUT_NAME.{json,md}``; grown stores under ``--work_dir`` are deleted after
measuring.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import scale  # noqa: E402  (store growth, children with peak RSS)

FLAGS = flags.FLAGS
flags.DEFINE_string("base_store", "outputs/trained_scifact/index", "The store to grow.")
flags.DEFINE_list(
    "scales", ["1", "10"], "Sizes, as multiples of the base store's documents (0: none)."
)
flags.DEFINE_integer(
    "base_tokens",
    None,
    "Cut the base to its first documents holding at most this many tokens (a small base "
    "travels to an accelerator host; the GPU runs used 120000: 504 documents).",
)
flags.DEFINE_float("sigma", None, "Jitter per dimension (default: measured on the base index).")
flags.DEFINE_list("platforms", ["cpu"], "JAX_PLATFORMS of each build child (cpu, cuda, tpu).")
flags.DEFINE_integer("bits", 2, "Residual bits of the search index.")
flags.DEFINE_integer("threads", None, "BLAS threads of the children (default: every core).")
flags.DEFINE_list("encode_platforms", None, "Backends of the encode (default: --platforms).")
flags.DEFINE_string("encode_dataset", None, "BEIR folder whose corpus is indexed (encode).")
flags.DEFINE_integer(
    "encode_repeats",
    1,
    "Encode runs per backend; from the second on, compiled kernels come "
    "from JAX's persistent compilation cache (the steady state of a long job).",
    lower_bound=1,
)
flags.DEFINE_string("encode_weights", "random", "load_encoder.backbone_weights of the encode.")
flags.DEFINE_string("encode_tokenizer", "auto", "load_encoder.tokenizer of the encode.")
flags.DEFINE_integer("encode_batch_tokens", 16384, "EncodingConfig.max_tokens_per_batch.")
flags.DEFINE_string("work_dir", "/tmp/build_throughput", "Where grown stores are written.")
flags.DEFINE_string("log", None, "The children's log (default: WORK_DIR/children.log).")
flags.DEFINE_string("output_dir", "benchmarks/results", "Where the results go.")
flags.DEFINE_string("output_name", "build_throughput", "Stem of the result files.")


def cut_store(source_dir: Path, out: Path, max_tokens: int) -> Path:
    """The first documents of ``source_dir`` holding at most ``max_tokens`` tokens, written with
    the project's writer (with the source's ``encoder.json``)."""
    from aligner_jax.indexing import token_store as ts

    source = ts.TokenStore(source_dir)
    shutil.rmtree(out, ignore_errors=True)
    docs = int(np.searchsorted(source.offsets, max_tokens, side="right")) - 1
    shard_size = int(source.manifest["indexing"]["shard_size"])
    with ts.TokenStoreWriter(out, source.manifest["model"], shard_size=shard_size) as writer:
        for i in range(docs):
            rows = np.arange(source.offsets[i], source.offsets[i + 1])
            writer.add(
                source.doc_ids[i],
                *(source.take(k, rows) for k in ("vectors", "salience", "token_ids")),
            )
    shutil.copy(source_dir / "encoder.json", out / "encoder.json")
    return out


def device_of(platform_name: str) -> str:
    """What JAX sees under ``JAX_PLATFORMS=platform_name`` (a short child)."""
    env = dict(os.environ, JAX_PLATFORMS=platform_name)
    code = "import jax; d = jax.devices()[0]; print(jax.device_count(), d.platform, d.device_kind)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode:
        return f"unavailable: {proc.stderr.strip().splitlines()[-1]}"
    return proc.stdout.strip()


def build_row(store_dir: Path, platform_name: str, threads: int, log: Path) -> dict:
    """Builds ``store_dir``'s search index in a child on ``platform_name``; one result row."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts

    cmd = [sys.executable, "-m", "aligner_jax.index", f"--index_dir={store_dir}",
           "--search_index", f"--gin.CentroidIndexConfig.residual_bits={FLAGS.bits}"]  # fmt: skip
    child = scale.run_child(cmd, threads, log, platform=platform_name)
    store = ts.TokenStore(store_dir)
    index = ci.CentroidIndex.load(store)
    record = index.meta["updates"][0]
    row = {
        "job": "build",
        "platform": platform_name,
        "device": device_of(platform_name),
        "threads": threads,
        "tokens": store.num_tokens,
        "docs": store.num_docs,
        "dim": store.dim,
        "bits": FLAGS.bits,
        "num_centroids": index.num_centroids,
        "wall_s": child["wall_s"],
        "kmeans_s": record["kmeans_s"],
        "kmeans_and_compress_s": record["seconds"],
        "peak_rss_gib": child["peak_rss_gib"],
        "tokens_per_s": store.num_tokens / child["wall_s"],
        "mean_centroid_score": index.meta["mean_centroid_score"],
        "machine_load": os.getloadavg()[0],
    }
    del index
    return row


def encode_row(dataset: Path, platform_name: str, threads: int, log: Path, repeat: int) -> dict:
    """Indexes ``dataset``'s corpus (no search index) in a child on ``platform_name``; with
    ``--encode_repeats`` > 1 the children share a persistent compilation cache."""
    out = Path(FLAGS.work_dir) / f"encode_{platform_name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "aligner_jax.index", f"--dataset_dir={dataset}",
           f"--index_dir={out}", "--nosearch_index", "--gin_file=models/minilm.gin",
           "--gin_file=index/default.gin",
           f"--gin.load_encoder.backbone_weights='{FLAGS.encode_weights}'",
           f"--gin.load_encoder.tokenizer='{FLAGS.encode_tokenizer}'",
           f"--gin.EncodingConfig.max_tokens_per_batch={FLAGS.encode_batch_tokens}"]  # fmt: skip
    cache = Path(FLAGS.work_dir) / f"jax_cache_{platform_name}"
    if FLAGS.encode_repeats > 1:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    try:
        child = scale.run_child(cmd, threads, log, platform=platform_name)
    finally:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "job": "encode",
        "platform": platform_name,
        "device": device_of(platform_name),
        "threads": threads,
        "weights": FLAGS.encode_weights,
        "repeat": repeat,
        "compilation_cache": FLAGS.encode_repeats > 1,
        "max_tokens_per_batch": FLAGS.encode_batch_tokens,
        "docs": child.get("num_docs"),
        "tokens": child.get("num_tokens"),
        "wall_s": child["wall_s"],
        "encode_s": child.get("encode_seconds"),
        "peak_rss_gib": child["peak_rss_gib"],
        "tokens_per_s": (child.get("num_tokens") or 0) / child["wall_s"],
        "machine_load": os.getloadavg()[0],
    }


def markdown(result: dict) -> str:
    lines = [
        "# Build and encode throughput per backend (issue 23, item 5)",
        "",
        f"Written by `benchmarks/build_throughput.py` on `{result['host']}` "
        f"({result['cpus']} CPUs). Store grown from `{result['base_store']}` "
        f"(jitter σ {result['sigma']:.4f}). Times are wall seconds of a fresh child process "
        "(start, imports and compilation included).",
        "",
        "| job | platform | device | threads | tokens | centroids | wall s | k-means s | "
        "k-means + compress s | tokens/s | peak RSS GiB | mean centroid score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        job = r["job"] + (f" #{r['repeat']}" if "repeat" in r else "")
        lines.append(
            f"| {job} | {r['platform']} | {r['device']} | {r['threads']} | "
            f"{r.get('tokens') or 0:,} | {r.get('num_centroids', '')} | {r['wall_s']:.1f} | "
            f"{r.get('kmeans_s', '')} | {r.get('kmeans_and_compress_s', '')} | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_rss_gib']:.2f} | "
            f"{format(r['mean_centroid_score'], '.4f') if 'mean_centroid_score' in r else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    from aligner_jax.common import fileio

    threads = FLAGS.threads or os.cpu_count()
    base = (REPO / FLAGS.base_store).resolve()
    work = Path(FLAGS.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if FLAGS.base_tokens:
        base = cut_store(base, work / "base", FLAGS.base_tokens)
    log = Path(FLAGS.log) if FLAGS.log else work / "children.log"
    out_dir = (REPO / FLAGS.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    sigma = FLAGS.sigma if FLAGS.sigma is not None else scale.residual_sigma(base)
    result = {
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "base_store": FLAGS.base_store,
        "base_tokens": FLAGS.base_tokens,
        "sigma": sigma,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": [],
    }

    def save() -> None:
        fileio.atomic_write_json(out_dir / f"{FLAGS.output_name}.json", result)
        fileio.atomic_write_text(out_dir / f"{FLAGS.output_name}.md", markdown(result))

    for s in sorted(float(s) for s in FLAGS.scales if float(s) > 0):
        store_dir = work / f"x{s:g}"
        made = scale.make_store(base, store_dir, s, sigma, seed=int(s))
        print(f"x{s:g}: {made}", flush=True)
        for name in FLAGS.platforms:
            row = build_row(store_dir, name, threads, log)
            row.update(scale=s, write_s=made["write_s"])
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        shutil.rmtree(store_dir)
    if FLAGS.encode_dataset:
        for name in FLAGS.encode_platforms or FLAGS.platforms:
            for repeat in range(FLAGS.encode_repeats):
                row = encode_row(Path(FLAGS.encode_dataset).resolve(), name, threads, log, repeat)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
    print(f"wrote {out_dir / FLAGS.output_name}.json and .md")


if __name__ == "__main__":
    app.run(main)
