"""The compressed search index: token centroids, centroid ids, packed residuals and an inverted
file, persisted beside the token store (PLAID §4.1, WARP §3).

Built once from a complete token store (``aligner-index --search_index``, or by ``aligner-eval``
the first time it searches a store) and loaded by every later search without rebuilding anything:

  ``search_index/search_index.json``          settings, counts, files with sizes and sha256,
                                              the store's fingerprint and manifest sha256,
                                              update log (with centroid drift)
  ``search_index/centroids.npy``              float32 ``[C, D]`` (spherical k-means, JAX)
  ``search_index/codec.npy``                  float32 ``[2, D]`` residual grid (lower, step)
  ``search_index/shard-N.codes.npy``          uint16/int32 ``[T_N]`` centroid id of each token
  ``search_index/shard-N.residuals.npy``      uint8 ``[T_N, W]`` packed b-bit residuals
  ``search_index/ivf_offsets.npy``, ``ivf_docs.npy``  centroid → documents owning one of its
                                              tokens kept by β^d pruning (CSR, int32)
  ``search_index/doc_code_offsets.npy``, ``doc_codes.npy``  document → its distinct centroid
                                              ids (CSR; centroid interaction)

Per-shard code files follow the store's shards, so adding documents (new store shards) only
compresses the new tokens with the existing centroids; the inverted file is rebuilt from the codes
(a sort, no encoding). Deleted documents are tombstones of the store's manifest: kept on
disk, never returned.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import gin
import numpy as np
from absl import logging

from aligner_jax.common import checks, errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import pruning
from aligner_jax.indexing import codec as codec_lib
from aligner_jax.indexing import kmeans
from aligner_jax.indexing import token_store as ts

SUBDIR = "search_index"
DRIFT_LIMIT = 0.02  # drift above which --compact re-clusters (mean max centroid score)
META = "search_index.json"
FORMAT = "aligner_jax.indexing.centroid_index/2"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CentroidIndexConfig:
    """How the compressed index is built.

    Attributes:
      num_centroids: None = 2^⌊log2(centroids_per_sqrt_token·√T)⌋ for T indexed tokens, capped
        by ``max_centroid_product`` and ``centroid_bytes_per_token``.
      centroids_per_sqrt_token: 16, as PLAID. Centroid interaction (stage 3 of
        ``retrieval.centroid_search``) ranks with centroid scores alone, so finer centroids
        choose the refined documents better: on the trained 128-d SciFact store, SciFact
        *train* queries (809), 16 against 8 gives nDCG@10 75.98 vs 75.48 (exhaustive 76.16)
        and top-10 agreement with exhaustive search 92.4 % vs 91.1 %, at the same probes and
        refinement counts, for +0.2 ms per query and a 3× longer k-means.
      max_centroid_product: at most the largest power of two C with C·D ≤ this (D: the vector
        dimension), a cap on the query–centroid product per query token: 2^22 (16,384
        centroids at 128-d, 8,192 at 384-d).
      centroid_bytes_per_token: and with 4·C·D ≤ this × T, a cap on the float32 centroid
        table's share of the index size. 16 bytes per token holds 384-d stores at the count
        their size affords (SciFact zero-shot, 1.24M tokens: 8,192 rather than 16,384, whose
        product alone would cost about half of the 10 ms query budget; CISI zero-shot, 219k
        tokens: 2,048, where 4,096 centroids would add 29 bytes per token and make the index
        larger per token than FastPlaid's) and leaves 128-d stores at 16·√T (SciFact trained
        16,384, CISI trained 4,096).
      kmeans_iterations: k-means iterations on the sample.
      sample_per_centroid: k-means sample size = this × centroids (≤ all indexed tokens).
      residual_bits: 2, 4 (default, as FastPlaid and WARP) or 8 bits per residual dimension.
      beta_d: fraction of each document's tokens (top by salience) in the inverted file (§3.2);
        refinement still scores every stored token.
      seed: k-means initialisation and sampling.
    """

    num_centroids: int | None = None
    centroids_per_sqrt_token: float = 16.0
    max_centroid_product: int = 1 << 22
    centroid_bytes_per_token: float = 16.0
    kmeans_iterations: int = 8
    sample_per_centroid: int = 32
    residual_bits: int = 4
    beta_d: float = 1.0
    seed: int = 0

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.residual_bits", self.residual_bits, codec_lib.BITS)
        checks.integer(f"{name}.num_centroids", self.num_centroids, minimum=1, allow_none=True)
        for field in ("centroids_per_sqrt_token", "centroid_bytes_per_token"):
            checks.number(f"{name}.{field}", getattr(self, field), 0.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        for field in ("kmeans_iterations", "sample_per_centroid", "max_centroid_product"):
            checks.integer(f"{name}.{field}", getattr(self, field), minimum=1)
        checks.integer(f"{name}.seed", self.seed)


def _code_dtype(num_centroids: int):
    return np.uint16 if num_centroids <= 1 << 16 else np.int32


def _kept_rows(store: ts.TokenStore, beta_d: float) -> np.ndarray:
    return pruning.top_fraction_segments(store.salience(), store.offsets, beta_d)


def _doc_codes(codes: np.ndarray, offsets: np.ndarray, num_centroids: int):
    """CSR document → its distinct centroid ids (what centroid interaction reads; about half
    as many entries as tokens on SciFact)."""
    docs = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    pairs = np.unique(docs * num_centroids + codes)
    doc_of, code = np.divmod(pairs, num_centroids)
    doc_offsets = np.zeros(len(offsets), np.int64)
    np.cumsum(np.bincount(doc_of, minlength=len(offsets) - 1), out=doc_offsets[1:])
    return doc_offsets, code.astype(codes.dtype)


def _inverted_file(
    codes: np.ndarray, offsets: np.ndarray, kept: np.ndarray, num_centroids: int
) -> tuple[np.ndarray, np.ndarray]:
    """CSR centroid → sorted unique documents owning a kept token of that centroid."""
    docs = np.searchsorted(offsets, kept, side="right") - 1
    pairs = np.unique(codes[kept].astype(np.int64) * (len(offsets) + 1) + docs)
    cents, docs = np.divmod(pairs, len(offsets) + 1)
    ivf_offsets = np.zeros(num_centroids + 1, np.int64)
    np.cumsum(np.bincount(cents, minlength=num_centroids), out=ivf_offsets[1:])
    return ivf_offsets, docs.astype(np.int32)


class CentroidIndex:
    """A loaded compressed index over a token store (see the module docstring)."""

    def __init__(
        self, directory: Path, meta: dict, centroids, codec, codes, residuals, ivf, doc_codes
    ):
        self.directory = Path(directory)
        self.meta = meta
        self.centroids = centroids
        self.codec = codec
        self.codes = codes  # [T] all tokens, store order
        self.residuals = residuals  # [T, W]
        self.ivf_offsets, self.ivf_docs = ivf
        self.doc_code_offsets, self.doc_codes = doc_codes

    @property
    def num_centroids(self) -> int:
        return len(self.centroids)

    def nbytes(self) -> int:
        return int(sum(f["bytes"] for f in self.meta["files"].values()))

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def build(
        cls, store: ts.TokenStore, config: CentroidIndexConfig | None = None
    ) -> CentroidIndex:
        """k-means on a sample of the kept tokens, then every token's code and residual."""
        config = config or CentroidIndexConfig()
        start = time.perf_counter()
        kept = _kept_rows(store, config.beta_d)
        if not len(kept):
            raise ConfigError(f"{store.directory}: the store holds no tokens to index")
        table_cap = config.centroid_bytes_per_token * len(kept) / 4  # float32 entries
        c = config.num_centroids or kmeans.default_num_centroids(
            len(kept),
            config.centroids_per_sqrt_token,
            store.dim,
            min(config.max_centroid_product, table_cap),
        )
        c = min(c, len(kept))
        rng = np.random.default_rng(config.seed)
        size = min(len(kept), config.sample_per_centroid * c)
        sample_rows = np.sort(rng.choice(kept, size, replace=False))
        sample = np.asarray(store.vectors()[sample_rows], np.float32)
        centroids = kmeans.fit(sample, c, config.kmeans_iterations, config.seed)
        codes_s, _ = kmeans.assign(sample, centroids)
        codec = codec_lib.ResidualCodec.fit(sample - centroids[codes_s], config.residual_bits)
        del sample
        kmeans_s = time.perf_counter() - start
        out = Path(store.directory) / SUBDIR
        out.mkdir(exist_ok=True)
        fileio.atomic_save_npy(out / "centroids.npy", centroids)
        fileio.atomic_save_npy(out / "codec.npy", np.stack([codec.lower, codec.step]))
        shards, scores = [], []
        todo = sorted(store.manifest["shards"], key=lambda s: s["index"])
        with progress.Progress(len(todo), "search index: compress shards", "shard") as bar:
            for shard in todo:
                shards.append(_compress_shard(store, shard, centroids, codec, out, scores))
                bar.update(1, tokens=shard["num_tokens"])
        meta = {
            "format": FORMAT,
            "config": dataclasses.asdict(config),
            "num_centroids": c,
            "dim": store.dim,
            "store_fingerprint": store.manifest["model"].get("fingerprint"),
            # mean max centroid score of every token at build time: the reference of the drift
            # measure (not the k-means sample's, which the centroids were fitted to)
            "mean_centroid_score": float(np.concatenate(scores).mean()),
            "shards": [s["name"] for s in shards],
            "updates": [
                {
                    "op": "build",
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "num_docs": store.num_docs,
                    "num_tokens": store.num_tokens,
                    "kmeans_s": round(kmeans_s, 3),
                    "seconds": round(time.perf_counter() - start, 3),
                }
            ],
        }
        index = cls._finish(store, out, meta, centroids, codec)
        logging.info(
            "search index: %d centroids, %d-bit residuals, %d tokens in %.1fs (k-means %.1fs)",
            c,
            config.residual_bits,
            store.num_tokens,
            time.perf_counter() - start,
            kmeans_s,
        )
        return index

    @classmethod
    def _finish(cls, store, out: Path, meta: dict, centroids, codec) -> CentroidIndex:
        """Writes the inverted file and the metadata (last: the commit marker); returns the
        loaded index."""
        codes = np.concatenate([np.load(out / f"{s}.codes.npy") for s in meta["shards"]])
        kept = _kept_rows(store, meta["config"]["beta_d"])
        ivf = _inverted_file(codes, store.offsets, kept, len(centroids))
        doc_codes = _doc_codes(codes, store.offsets, len(centroids))
        fileio.atomic_save_npy(out / "ivf_offsets.npy", ivf[0])
        fileio.atomic_save_npy(out / "ivf_docs.npy", ivf[1])
        fileio.atomic_save_npy(out / "doc_code_offsets.npy", doc_codes[0])
        fileio.atomic_save_npy(out / "doc_codes.npy", doc_codes[1])
        names = ["centroids", "codec", "ivf_offsets", "ivf_docs", "doc_code_offsets", "doc_codes"]
        names += [f"{s}.{kind}" for s in meta["shards"] for kind in ("codes", "residuals")]
        meta["files"] = {n: _file_entry(out / f"{n}.npy") for n in names}
        meta["store_manifest_sha256"] = fileio.sha256_file(Path(store.directory) / ts.MANIFEST)
        fileio.atomic_write_json(out / META, meta)
        # hashed just now from the bytes written: the first load need not hash them again
        fileio.record_verified(
            {out / f"{n}.npy": e["sha256"] for n, e in meta["files"].items()},
            out / META,
            out / ts.VERIFIED,
        )
        residuals = np.concatenate([np.load(out / f"{s}.residuals.npy") for s in meta["shards"]])
        return cls(out, meta, centroids, codec, codes, residuals, ivf, doc_codes)

    # -- updates ----------------------------------------------------------------------------------
    def update(self, store: ts.TokenStore, op: str, **record) -> CentroidIndex:
        """Brings the index up to date with ``store`` after ``aligner-index --add/--delete``:
        compresses the store's new shards with the existing centroids, rebuilds the inverted
        file, and logs the update with its centroid drift (see ``drift``)."""
        known = set(self.meta["shards"])
        new = [s for s in store.manifest["shards"] if s["name"] not in known]
        scores = []
        for shard in sorted(new, key=lambda s: s["index"]):
            _compress_shard(store, shard, self.centroids, self.codec, self.directory, scores)
            self.meta["shards"].append(shard["name"])
        if scores:
            mean = float(np.concatenate(scores).mean())
            record.update(
                new_tokens=int(sum(len(x) for x in scores)),
                mean_centroid_score=mean,
                drift=self.meta["mean_centroid_score"] - mean,
            )
        record.update(op=op, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.meta["updates"].append(record)
        return CentroidIndex._finish(store, self.directory, self.meta, self.centroids, self.codec)

    def drift(self) -> float:
        """How much worse the centroids fit the tokens added since the build: the mean max
        centroid score of the tokens indexed at build time minus that of all added tokens
        (token-weighted);
        0 without additions. ``--compact`` re-clusters when it exceeds ``DRIFT_LIMIT``."""
        adds = [u for u in self.meta["updates"] if u.get("new_tokens")]
        if not adds:
            return 0.0
        tokens = sum(u["new_tokens"] for u in adds)
        mean = sum(u["mean_centroid_score"] * u["new_tokens"] for u in adds) / tokens
        return self.meta["mean_centroid_score"] - mean

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def exists(cls, store_dir: Path) -> bool:
        return (Path(store_dir) / SUBDIR / META).exists()

    @classmethod
    def load_unchecked(cls, store: ts.TokenStore) -> CentroidIndex:
        """Loads the index even when the store's manifest changed since (for updates)."""
        return cls.load(store, _check_store=False)

    @classmethod
    def load(
        cls, store: ts.TokenStore, verify_checksums: bool = False, _check_store: bool = True
    ) -> CentroidIndex:
        """Loads the index of ``store``: sizes always checked; every file's sha256 on the first
        open and whenever a file changed (``fileio.verify_once``), always with
        ``verify_checksums``."""
        out = Path(store.directory) / SUBDIR
        path = out / META
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise errors.IndexIntegrityError(
                f"{path} does not exist: build the search index with aligner-index "
                "--search_index (or aligner-eval builds it on first use)"
            ) from e
        except json.JSONDecodeError as e:
            raise errors.IndexIntegrityError(f"{path}: not valid JSON ({e})") from e
        if meta.get("format") != FORMAT:
            raise errors.IndexIntegrityError(
                f"{path}: format {meta.get('format')!r}, this version reads {FORMAT!r}; rebuild "
                "it (aligner-index --index_dir=DIR --force_compact)"
            )
        stale = meta["store_manifest_sha256"] != fileio.sha256_file(
            Path(store.directory) / ts.MANIFEST
        )
        if meta["store_fingerprint"] != store.manifest["model"].get("fingerprint") or (
            stale and _check_store
        ):
            raise errors.IndexIntegrityError(
                f"{path}: built for another version of the token store in {store.directory}; "
                "rebuild it with aligner-index --search_index --rebuild_search_index"
            )
        for name, entry in meta["files"].items():
            f = out / f"{name}.npy"
            if not f.exists() or f.stat().st_size != entry["bytes"]:
                raise errors.IndexIntegrityError(
                    f"{f} is missing or has another size than {path} records; rebuild the index"
                )
        # sha256 on the first open (and whenever a file changed), then a record: as the store
        fileio.verify_once(
            {out / f"{n}.npy": e["sha256"] for n, e in meta["files"].items()},
            path,
            out / ts.VERIFIED,
            force=verify_checksums,
            log=logging.warning,
        )
        load = lambda n: np.load(out / f"{n}.npy", allow_pickle=False)  # noqa: E731
        centroids = load("centroids")
        lower, step = load("codec")
        codec = codec_lib.ResidualCodec(meta["config"]["residual_bits"], lower, step)
        codes = np.concatenate([load(f"{s}.codes") for s in meta["shards"]])
        residuals = np.concatenate([load(f"{s}.residuals") for s in meta["shards"]])
        if _check_store and (len(codes) != store.num_tokens or len(residuals) != store.num_tokens):
            raise errors.IndexIntegrityError(
                f"{path}: {len(codes)} tokens, the store has {store.num_tokens}; rebuild"
            )
        ivf = (load("ivf_offsets"), load("ivf_docs"))
        doc_codes = (load("doc_code_offsets"), load("doc_codes"))
        return cls(out, meta, centroids, codec, codes, residuals, ivf, doc_codes)


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": fileio.sha256_tracked(path)}


def _compress_shard(
    store, shard: dict, centroids, codec, out: Path, scores: list | None = None, chunk=1 << 17
) -> dict:
    """Codes and packed residuals of one store shard's tokens (max centroid scores appended to
    ``scores`` when given)."""
    vectors = np.load(Path(store.directory) / shard["files"]["vectors"]["path"], mmap_mode="r")
    codes = np.empty(len(vectors), _code_dtype(len(centroids)))
    packed = np.empty((len(vectors), codec.bytes_per_token), np.uint8)
    for lo in range(0, len(vectors), chunk):
        v = np.asarray(vectors[lo : lo + chunk], np.float32)
        c, best = kmeans.assign(v, centroids)
        if scores is not None:
            scores.append(best)
        codes[lo : lo + len(v)] = c
        packed[lo : lo + len(v)] = codec.encode(v - centroids[c])
    fileio.atomic_save_npy(out / f"{shard['name']}.codes.npy", codes)
    fileio.atomic_save_npy(out / f"{shard['name']}.residuals.npy", packed)
    return shard
