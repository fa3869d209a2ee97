r"""Encoder throughput: our jitted Flax BERT vs sentence-transformers (PyTorch) on one corpus.

Both encode the same texts (BEIR ``title + " " + text``, at most ``--max_length`` tokens) into
token vectors of all-MiniLM-L6-v2:

  (a) JAX: ``aligner_jax`` tokenizer, then ``batching.iter_encoded_batches`` (length buckets of
      ``tokenization.length_buckets``, one batch in flight per core, the jitted ``BertEncoder``);
      every bucket shape is compiled once before timing (compile time reported apart), and the
      timed region covers tokenize → pad → encode → copy to host.
  (b) PyTorch: ``SentenceTransformer(model_dir, device=--torch_device).encode(texts,
      output_value='token_embeddings', batch_size=--torch_batch_size)`` (its own tokenization,
      length sorting and padding), in ``--torch_dtype``.

Both run on the default JAX backend / ``--torch_device``: the CPU here, a GPU with
``--torch_device=cuda`` (and a CUDA jaxlib); there, raise ``--max_tokens_per_batch`` and
``--torch_batch_size``.

The corpus is cut into ``--rounds`` chunks and the two run alternately chunk by chunk (the order
flips every round), so both see the same background load on a shared machine. Throughput counts
real (non-padding) tokens. A few documents' vectors are compared between the two as a check.

  .venv/bin/python benchmarks/encoder_throughput.py --limit=1000
  .venv/bin/python benchmarks/encoder_throughput.py            # full SciFact corpus
  python benchmarks/encoder_throughput.py --torch_device=cuda --max_tokens_per_batch=32768 \
      --torch_batch_size=128 --output_name=encoder_throughput_gpu_f32   # on a GPU

Writes ``--output_dir``/``--output_name``.{json,md} and prints a one-screen summary.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time

from absl import app, flags, logging

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from aligner_jax.encoding import batching, tokenization  # noqa: E402
from aligner_jax.weights import minilm  # noqa: E402

_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir",
    str(REPO.parent / "shared" / "data" / "beir" / "scifact"),
    "BEIR folder whose corpus.jsonl is encoded.",
)
_LIMIT = flags.DEFINE_integer("limit", None, "Encode only the first N documents.", lower_bound=1)
_MAX_LENGTH = flags.DEFINE_integer(
    "max_length", tokenization.DEFAULT_DOC_MAXLEN, "Max tokens per doc.", lower_bound=2
)
_BUCKET_STEP = flags.DEFINE_integer(
    "bucket_step",
    tokenization.DEFAULT_BUCKET_STEP,
    "Bucket boundaries: multiples of this.",
    lower_bound=1,
)
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens_per_batch",
    tokenization.DEFAULT_MAX_TOKENS_PER_BATCH,
    "JAX batch budget: rows x padded length.",
    lower_bound=1,
)
_CONCURRENT = flags.DEFINE_integer(
    "concurrent_batches",
    None,
    "JAX batches in flight at once (default: one per usable core on CPU).",
    lower_bound=1,
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "JAX compute dtype.")
_TORCH_BATCH = flags.DEFINE_integer(
    "torch_batch_size", 32, "sentence-transformers batch size.", lower_bound=1
)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 4, "Interleave JAX and PyTorch over this many chunks.", lower_bound=1
)
_TORCH_DEVICE = flags.DEFINE_string("torch_device", "cpu", "PyTorch device: cpu or cuda.")
_TORCH_DTYPE = flags.DEFINE_enum(
    "torch_dtype", "float32", ["float32", "bfloat16"], "PyTorch model dtype."
)
_SKIP_TORCH = flags.DEFINE_bool("skip_torch", False, "Time only the JAX encoder.")
_CHECK_DOCS = flags.DEFINE_integer(
    "check_docs", 8, "Docs whose vectors are compared.", lower_bound=1
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", str(REPO / "benchmarks" / "results"), "Where the JSON and Markdown go."
)
_OUTPUT_NAME = flags.DEFINE_string(
    "output_name", "encoder_throughput", "File stem of the JSON and Markdown."
)


def read_corpus_texts(dataset_dir: pathlib.Path, limit: int | None) -> list[str]:
    path = dataset_dir / "corpus.jsonl"
    if not path.is_file():
        raise app.UsageError(
            f"--dataset_dir={dataset_dir}: {path} not found (expected a BEIR folder)."
        )
    texts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(texts) >= limit:
                break
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise app.UsageError(f"{path}:{line_no}: invalid JSON ({e}).") from e
            texts.append(f"{doc.get('title', '')} {doc.get('text', '')}".strip())
    return texts


def _cpu_info() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class JaxEncoder:
    """Tokenize → bucket → jitted encode → host copy, as the indexing job does it."""

    def __init__(self, dtype, max_length, step, max_tokens, concurrent_batches):
        self.config, self.params, self.tokenizer = batching.load_minilm()
        if concurrent_batches is None:
            concurrent_batches = batching.default_concurrent_batches()
        self.concurrent_batches = concurrent_batches
        self.encode_fn = batching.make_encode_fn(self.config, dtype=dtype)
        self.max_length = max_length
        self.boundaries = tokenization.default_bucket_boundaries(max_length, step)
        self.max_tokens = max_tokens

    def shapes(self, seqs) -> set[tuple[int, int]]:
        batches = tokenization.length_buckets(
            [len(s) for s in seqs], self.boundaries, self.max_tokens
        )
        return {(b.rows, b.length) for b in batches}

    def warm_up(self, shapes) -> float:
        start = time.perf_counter()
        for rows, length in sorted(shapes):
            ids = np.zeros((rows, length), np.int32)
            jax.block_until_ready(self.encode_fn(self.params, ids, np.ones_like(ids, bool)))
        return time.perf_counter() - start

    def encode(self, texts, keep: int = 0):
        """Returns (number of real tokens, padded tokens, the first ``keep`` docs' vectors)."""
        seqs = self.tokenizer.encode_batch(texts, self.max_length)
        kept, real = {}, 0
        for indices, vectors in batching.iter_encoded_batches(
            self.encode_fn,
            self.params,
            seqs,
            self.boundaries,
            self.max_tokens,
            self.tokenizer.pad_id,
            self.concurrent_batches,
        ):
            for i, v in zip(indices, vectors, strict=True):
                real += v.shape[0]
                if i < keep:
                    kept[int(i)] = v
        batches = tokenization.length_buckets(
            [len(s) for s in seqs], self.boundaries, self.max_tokens
        )
        padded = sum(b.rows * b.length for b in batches)
        return real, padded, [kept[i] for i in range(min(keep, len(texts)))]


class TorchEncoder:
    def __init__(self, batch_size, device, dtype):
        import torch
        from sentence_transformers import SentenceTransformer

        self.torch = torch
        self.device = device
        self.model = SentenceTransformer(str(minilm.minilm_model_dir()), device=device)
        self.model.to(getattr(torch, dtype))
        self.batch_size = batch_size

    def encode(self, texts, keep: int = 0):
        out = self.model.encode(
            texts,
            output_value="token_embeddings",
            batch_size=self.batch_size,
            show_progress_bar=False,
            convert_to_numpy=False,
        )
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()
        real = sum(int(o.shape[0]) for o in out)
        return (
            real,
            [np.asarray(o.float().cpu().numpy()) for o in out[:keep]],
            [o.shape[0] for o in out],
        )


def run(argv) -> dict:
    del argv
    dataset_dir = pathlib.Path(_DATASET_DIR.value)
    texts = read_corpus_texts(dataset_dir, _LIMIT.value)
    if not texts:
        raise app.UsageError(f"--dataset_dir={dataset_dir}: the corpus is empty.")
    rounds = max(1, min(_ROUNDS.value, len(texts)))
    chunks = [c.tolist() for c in np.array_split(np.arange(len(texts)), rounds)]
    load_start = os.getloadavg()

    dtype = jnp.bfloat16 if _DTYPE.value == "bfloat16" else jnp.float32
    jax_enc = JaxEncoder(
        dtype, _MAX_LENGTH.value, _BUCKET_STEP.value, _MAX_TOKENS.value, _CONCURRENT.value
    )
    start = time.perf_counter()
    all_seqs = jax_enc.tokenizer.encode_batch(texts, _MAX_LENGTH.value)
    tokenize_s = time.perf_counter() - start
    shapes = set()
    for chunk in chunks:
        shapes |= jax_enc.shapes([all_seqs[i] for i in chunk])
    logging.info("Compiling %d bucket shapes: %s", len(shapes), sorted(shapes))
    compile_s = jax_enc.warm_up(shapes)

    torch_enc = None
    if not _SKIP_TORCH.value:
        torch_enc = TorchEncoder(_TORCH_BATCH.value, _TORCH_DEVICE.value, _TORCH_DTYPE.value)
        torch_enc.encode(texts[: min(len(texts), 2 * _TORCH_BATCH.value)])  # warm-up

    jax_time = torch_time = 0.0
    jax_cpu = torch_cpu = 0.0
    jax_tokens = jax_padded = torch_tokens = 0
    check_jax = check_torch = None
    torch_lengths = []
    for r, chunk in enumerate(chunks):
        chunk_texts = [texts[i] for i in chunk]
        keep = _CHECK_DOCS.value if r == 0 else 0
        order = ("jax", "torch") if r % 2 == 0 else ("torch", "jax")
        for which in order:
            if which == "torch" and torch_enc is None:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            if which == "jax":
                real, padded, kept = jax_enc.encode(chunk_texts, keep)
                jax_time += time.perf_counter() - t0
                jax_cpu += time.process_time() - c0
                jax_tokens += real
                jax_padded += padded
                if keep:
                    check_jax = kept
            else:
                real, kept, lengths = torch_enc.encode(chunk_texts, keep)
                torch_time += time.perf_counter() - t0
                torch_cpu += time.process_time() - c0
                torch_tokens += real
                torch_lengths.extend(lengths)
                if keep:
                    check_torch = kept
        logging.info(
            "round %d/%d: %d docs; JAX %.0f tok/s%s",
            r + 1,
            rounds,
            len(chunk),
            jax_tokens / max(jax_time, 1e-9),
            f", PyTorch {torch_tokens / max(torch_time, 1e-9):.0f} tok/s" if torch_enc else "",
        )

    lengths = np.array([len(s) for s in all_seqs])
    result = {
        "dataset_dir": str(dataset_dir),
        "docs": len(texts),
        "real_tokens": int(lengths.sum()),
        "mean_tokens_per_doc": float(lengths.mean()),
        "truncated_docs": int((lengths == _MAX_LENGTH.value).sum()),
        "max_length": _MAX_LENGTH.value,
        "rounds": rounds,
        "jax": {
            "dtype": _DTYPE.value,
            "bucket_boundaries": list(jax_enc.boundaries),
            "max_tokens_per_batch": _MAX_TOKENS.value,
            "concurrent_batches": jax_enc.concurrent_batches,
            "compiled_shapes": [list(s) for s in sorted(shapes)],
            "compile_s": compile_s,
            "tokenize_corpus_s": tokenize_s,
            "encode_s": jax_time,
            "process_cpu_s": jax_cpu,
            "tokens_per_s": jax_tokens / jax_time,
            "docs_per_s": len(texts) / jax_time,
            "padding_efficiency": jax_tokens / jax_padded,
        },
        "conditions": {
            "cpu": _cpu_info(),
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "jax_device": jax.devices()[0].device_kind,
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "python": platform.python_version(),
        },
    }
    if jax_tokens != result["real_tokens"]:
        raise RuntimeError(f"JAX encoded {jax_tokens} tokens, expected {result['real_tokens']}.")
    if torch_enc is not None:
        torch = torch_enc.torch
        if torch_lengths != lengths.tolist():
            raise RuntimeError("sentence-transformers tokenized the corpus differently.")
        diffs = [float(np.abs(a - b).max()) for a, b in zip(check_jax, check_torch, strict=True)]
        result["torch"] = {
            "batch_size": _TORCH_BATCH.value,
            "device": _TORCH_DEVICE.value,
            "dtype": _TORCH_DTYPE.value,
            "threads": torch.get_num_threads(),
            "version": torch.__version__,
            "encode_s": torch_time,
            "process_cpu_s": torch_cpu,
            "tokens_per_s": torch_tokens / torch_time,
            "docs_per_s": len(texts) / torch_time,
        }
        result["jax_over_torch"] = result["jax"]["tokens_per_s"] / result["torch"]["tokens_per_s"]
        result["check_max_abs_diff"] = max(diffs)
        result["check_docs"] = len(diffs)
    return result


def to_markdown(r: dict) -> str:
    j, c = r["jax"], r["conditions"]
    lines = [
        f"# Encoder throughput ({c['jax_device']}): aligner_jax BERT vs sentence-transformers",
        "",
        f"Corpus: `{r['dataset_dir']}` — {r['docs']:,} docs, {r['real_tokens']:,} real tokens "
        f"(mean {r['mean_tokens_per_doc']:.1f}/doc, {r['truncated_docs']:,} truncated at "
        f"{r['max_length']}); JAX and PyTorch alternate over {r['rounds']} chunks.",
        "",
        "| encoder | tokens/s | docs/s | encode s | process CPU s |",
        "|---|---:|---:|---:|---:|",
        f"| JAX/Flax ({j['dtype']}, jit, buckets) | {j['tokens_per_s']:,.0f} | "
        f"{j['docs_per_s']:.1f} | {j['encode_s']:.1f} | {j['process_cpu_s']:.1f} |",
    ]
    if "torch" in r:
        t = r["torch"]
        lines.append(
            f"| PyTorch sentence-transformers ({t['dtype']}, {t['device']}, batch "
            f"{t['batch_size']}, {t['threads']} threads) | "
            f"{t['tokens_per_s']:,.0f} | {t['docs_per_s']:.1f} | {t['encode_s']:.1f} | "
            f"{t['process_cpu_s']:.1f} |"
        )
        lines += [
            "",
            f"**JAX / PyTorch: {r['jax_over_torch']:.2f}×** (real tokens per second). "
            f"Max |JAX − PyTorch| over {r['check_docs']} docs' token vectors: "
            f"{r['check_max_abs_diff']:.1e}.",
        ]
    lines += [
        "",
        f"JAX: buckets {j['bucket_boundaries']}, ≤ {j['max_tokens_per_batch']} padded tokens per "
        f"batch, {j['concurrent_batches']} batches in flight, {len(j['compiled_shapes'])} "
        f"compiled shapes (compile {j['compile_s']:.1f} s, excluded), padding efficiency "
        f"{j['padding_efficiency']:.1%}, tokenizing the corpus {j['tokenize_corpus_s']:.2f} s "
        "(tokenization is inside the timed region, chunk by chunk).",
        "",
        f"Conditions: {c['cpu']}, {c['cpus_usable']} usable cores, load average "
        f"{c['loadavg_start'][0]:.2f} → {c['loadavg_end'][0]:.2f} (other jobs share the cores), "
        f"jax {c['jax']} on {c['jax_device']} (matmul precision "
        f"{c['jax_default_matmul_precision']}), XLA_FLAGS={c['xla_flags']!r}.",
        "",
    ]
    return "\n".join(lines)


def main(argv):
    result = run(argv)
    out_dir = pathlib.Path(_OUTPUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / _OUTPUT_NAME.value
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = to_markdown(result)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"Wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    app.run(main)
