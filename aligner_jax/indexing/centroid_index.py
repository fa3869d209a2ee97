"""The compressed search index: token centroids, centroid ids, packed residuals and an inverted
file, persisted beside the token store (PLAID §4.1, WARP §3).

Built once from a complete token store (``aligner-index --index_dir=DIR --search_index``, or by
``aligner-eval`` the first time it searches a store) and loaded by every later search without
rebuilding anything:

  ``search_index/search_index.json``          settings, counts, files with sizes and sha256,
                                              the store's fingerprint and manifest sha256,
                                              segments, update log (with centroid drift)
  ``search_index/centroids.npy``              float32 ``[C, D]`` (two-level spherical k-means)
  ``search_index/cells.npy``                  float32 ``[cells, D]`` its coarse cells
  ``search_index/codec.npy``                  float32 ``[2, D]`` residual grid (lower, step)
  ``search_index/segment-N.codes.npy``        uint16/int32 ``[T_N]`` centroid id of each token
  ``search_index/segment-N.residuals.npy``    uint8 ``[T_N, W]`` packed b-bit residuals
  ``search_index/segment-N.salience.npy``     float16 ``[T_N]`` u^d (models with saliences)
  ``search_index/ivf_offsets.npy``, ``ivf_docs.npy``  centroid → documents owning one of its
                                              tokens kept by β^d pruning (CSR, int32)
  ``search_index/doc_code_offsets.npy``, ``doc_codes.npy``  document → its distinct centroid
                                              ids (CSR; centroid interaction)

**Bounded memory.** Every step streams over the store shard by shard: the k-means sample is
gathered shard by shard; codes, residuals and saliences are computed per shard and appended to
their segment files (written, never mapped); the inverted file and the document → centroid
lists are built in two passes over the segments' codes, one shard at a time. Each shard is
unmapped when done, so the build's peak resident memory is O(centroids + sample + one shard +
the inverted file's document ids (4 bytes per (centroid, document) pair)), not O(tokens × D).
**Loading maps** every array (``mmap_mode='r'``): nothing is concatenated or copied, resident
memory after load is the centroid table plus what searches touch, and an index larger than RAM
answers from the page cache.

A segment covers consecutive store shards: the build writes one, each ``--add`` one more for
the new shards (compressed with the existing centroids), so the files open at search time are a
handful per segment, not per shard. Deleted documents are tombstones of the store's manifest:
kept on disk, never returned.
"""

from __future__ import annotations

import contextlib
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
FORMAT = "aligner_jax.indexing.centroid_index/3"
CHUNK = 1 << 16  # tokens per assignment / compression step


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
        dimension), a cap on the query–centroid product per query token: 2^23 (65,536
        centroids at 128-d, from 16.8M tokens; 16,384 at 384-d). Past the cap the inverted
        lists lengthen with the corpus and the probes fall to 2 (``centroid_search``).
      centroid_bytes_per_token: and with 4·C·D ≤ this × T, a cap on the float32 centroid
        table's share of the index size. 16 bytes per token holds 384-d stores at the count
        their size affords (SciFact zero-shot, 1.24M tokens: 8,192 rather than 16,384, whose
        product alone would cost about half of the 10 ms query budget; CISI zero-shot, 219k
        tokens: 2,048, where 4,096 centroids would add 29 bytes per token and make the index
        larger per token than FastPlaid's) and leaves 128-d stores at 16·√T (SciFact trained
        16,384, CISI trained 4,096).
      cells: coarse cells of the two-level k-means (``kmeans.fit_two_level``); None =
        2^⌊log2(C)/2⌋ (128 cells of 128 centroids at C = 16,384); 1 = one-level k-means
        (every token compared with every centroid: T·C·D, days at 100M tokens).
      kmeans_iterations: k-means iterations on the sample.
      sample_per_centroid: k-means sample size = this × centroids (≤ all indexed tokens).
      residual_bits: 2, 4 (default, as FastPlaid and WARP) or 8 bits per residual dimension.
      beta_d: fraction of each document's tokens (top by salience) in the inverted file (§3.2);
        refinement still scores every stored token.
      seed: k-means initialisation and sampling.
    """

    num_centroids: int | None = None
    centroids_per_sqrt_token: float = 16.0
    max_centroid_product: int = 1 << 23
    centroid_bytes_per_token: float = 16.0
    cells: int | None = None
    kmeans_iterations: int = 8
    sample_per_centroid: int = 32
    residual_bits: int = 4
    beta_d: float = 1.0
    seed: int = 0

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.residual_bits", self.residual_bits, codec_lib.BITS)
        checks.integer(f"{name}.num_centroids", self.num_centroids, minimum=1, allow_none=True)
        checks.integer(f"{name}.cells", self.cells, minimum=1, allow_none=True)
        for field in ("centroids_per_sqrt_token", "centroid_bytes_per_token"):
            checks.number(f"{name}.{field}", getattr(self, field), 0.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        for field in ("kmeans_iterations", "sample_per_centroid", "max_centroid_product"):
            checks.integer(f"{name}.{field}", getattr(self, field), minimum=1)
        checks.integer(f"{name}.seed", self.seed)


def _code_dtype(num_centroids: int):
    return np.uint16 if num_centroids <= 1 << 16 else np.int32


def _kept_local(salience: np.ndarray, local_offsets: np.ndarray, beta_d: float) -> np.ndarray:
    """Rows of one shard kept by β^d pruning (§3.2), in the shard's coordinates."""
    if beta_d >= 1.0:
        return np.arange(int(local_offsets[-1]), dtype=np.int64)
    return pruning.top_fraction_segments(salience, local_offsets, beta_d)


def kept_rows(store: ts.TokenStore, beta_d: float) -> np.ndarray:
    """Global rows kept by β^d pruning, computed shard by shard (O(kept) memory)."""
    parts = [np.zeros(0, np.int64)]
    for i, (_, token_start, _) in enumerate(store.shard_spans()):
        salience, local = store.shard_arrays(i)[1:]
        parts.append(_kept_local(salience, local, beta_d) + token_start)
    return np.concatenate(parts)


class Segmented:
    """Rows of several memory-mapped arrays read as one (``codes``, ``residuals`` and
    ``salience`` of the segments, in store order); ``[rows]`` gathers any rows."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, rows) -> np.ndarray:
        if len(self.arrays) == 1:
            return self.arrays[0][rows]
        rows = np.asarray(rows, np.int64)
        seg = np.searchsorted(self.starts, rows, side="right") - 1
        first = self.arrays[0]
        out = np.empty((len(rows),) + first.shape[1:], first.dtype)
        for k in np.unique(seg):
            sel = seg == k
            out[sel] = self.arrays[k][rows[sel] - self.starts[k]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Every row in memory (small indexes and tests; searches gather rows instead)."""
        whole = np.concatenate([np.asarray(a) for a in self.arrays])
        return whole if dtype is None else whole.astype(dtype)

    def span(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (a view when they lie in one segment)."""
        k = int(np.searchsorted(self.starts, start, side="right") - 1)
        if stop <= self.starts[k + 1]:
            return self.arrays[k][start - self.starts[k] : stop - self.starts[k]]
        return self[np.arange(start, stop)]


class CentroidIndex:
    """A loaded compressed index over a token store (see the module docstring)."""

    def __init__(self, directory: Path, meta: dict, arrays: dict):
        self.directory = Path(directory)
        self.meta = meta
        self.centroids = arrays["centroids"]
        self.cells = arrays["cells"]
        self.codec = arrays["codec"]
        self.codes = arrays["codes"]  # Segmented [T]: every token, store order
        self.residuals = arrays["residuals"]  # Segmented [T, W]
        self.salience = arrays.get("salience")  # Segmented [T] float16, or None
        self.ivf_offsets, self.ivf_docs = arrays["ivf"]
        self.doc_code_offsets, self.doc_codes = arrays["doc_codes"]

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
        """Two-level k-means on a sample of the kept tokens (gathered shard by shard), then every
        token's code, residual (and salience) streamed into one segment, then the inverted
        file; memory bounded as the module docstring says."""
        config = config or CentroidIndexConfig()
        start = time.perf_counter()
        spans = store.shard_spans()
        kept_counts = np.zeros(len(spans) + 1, np.int64)
        for i in range(len(spans)):
            if config.beta_d >= 1.0:
                kept_counts[i + 1] = spans[i][0]["num_tokens"]
            else:
                salience, local = store.shard_arrays(i)[1:]
                kept_counts[i + 1] = len(_kept_local(salience, local, config.beta_d))
        np.cumsum(kept_counts, out=kept_counts)
        total_kept = int(kept_counts[-1])
        if not total_kept:
            raise ConfigError(f"{store.directory}: the store holds no tokens to index")
        table_cap = config.centroid_bytes_per_token * total_kept / 4  # float32 entries
        c = config.num_centroids or kmeans.default_num_centroids(
            total_kept,
            config.centroids_per_sqrt_token,
            store.dim,
            min(config.max_centroid_product, table_cap),
        )
        c = min(c, total_kept)
        rng = np.random.default_rng(config.seed)
        size = min(total_kept, config.sample_per_centroid * c)
        picks = np.sort(rng.choice(total_kept, size, replace=False))  # positions among kept rows
        sample = np.empty((size, store.dim), np.float32)
        bounds = np.searchsorted(picks, kept_counts)
        for i in np.nonzero(np.diff(bounds))[0]:
            vectors, salience, local = store.shard_arrays(int(i))
            local_kept = _kept_local(salience, local, config.beta_d)
            rows = local_kept[picks[bounds[i] : bounds[i + 1]] - kept_counts[i]]
            sample[bounds[i] : bounds[i + 1]] = vectors[rows]
            del vectors, salience  # unmapped: one shard at a time
        cells = config.cells or kmeans.default_cells(c)
        centroids, cell_centroids = kmeans.fit_two_level(
            sample, c, min(cells, c), config.kmeans_iterations, config.seed
        )
        codes_s, _ = kmeans.assign_two_level(sample, centroids, cell_centroids)
        codec = codec_lib.ResidualCodec.fit(sample - centroids[codes_s], config.residual_bits)
        del sample
        kmeans_s = time.perf_counter() - start
        out = Path(store.directory) / SUBDIR
        out.mkdir(exist_ok=True)
        fileio.atomic_save_npy(out / "centroids.npy", centroids)
        fileio.atomic_save_npy(out / "cells.npy", cell_centroids)
        fileio.atomic_save_npy(out / "codec.npy", np.stack([codec.lower, codec.step]))
        salience = store.manifest["model"].get("salience") != "none"
        score = _ScoreMean()
        segment = _write_segment(
            store, range(len(spans)), "segment-00000", centroids, cell_centroids, codec, out,
            salience, score,
        )  # fmt: skip
        meta = {
            "format": FORMAT,
            "config": dataclasses.asdict(config),
            "num_centroids": len(centroids),
            "num_cells": len(cell_centroids),
            "dim": store.dim,
            "salience": salience,
            "store_fingerprint": store.manifest["model"].get("fingerprint"),
            # mean max centroid score of every token at build time: the reference of the drift
            # measure (not the k-means sample's, which the centroids were fitted to)
            "mean_centroid_score": score.mean,
            "segments": [segment],
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
        index = cls._finish(store, out, meta)
        logging.info(
            "search index: %d centroids in %d cells, %d-bit residuals, %d tokens in %.1fs "
            "(k-means %.1fs)",
            len(centroids),
            len(cell_centroids),
            config.residual_bits,
            store.num_tokens,
            time.perf_counter() - start,
            kmeans_s,
        )
        return index

    @classmethod
    def _finish(cls, store, out: Path, meta: dict) -> CentroidIndex:
        """Writes the inverted file, the document → centroid lists and the metadata (last: the
        commit marker); returns the index, loaded (mapped) from what was written."""
        codes = Segmented(
            [np.load(out / f"{g['name']}.codes.npy", mmap_mode="r") for g in meta["segments"]]
        )
        _write_lists(store, codes, meta, out)
        del codes
        names = ["centroids", "cells", "codec", "ivf_offsets", "ivf_docs"]
        names += ["doc_code_offsets", "doc_codes"]
        for g in meta["segments"]:
            names += [f"{g['name']}.{kind}" for kind in _segment_kinds(meta)]
        meta["files"] = {n: _file_entry(out / f"{n}.npy") for n in names}
        meta["store_manifest_sha256"] = fileio.sha256_file(Path(store.directory) / ts.MANIFEST)
        fileio.atomic_write_json(out / META, meta)
        # hashed just now from the bytes written: the first load need not hash them again
        fileio.record_verified(
            {out / f"{n}.npy": e["sha256"] for n, e in meta["files"].items()},
            out / META,
            out / ts.VERIFIED,
        )
        return cls._open(out, meta)

    # -- updates ----------------------------------------------------------------------------------
    def update(self, store: ts.TokenStore, op: str, **record) -> CentroidIndex:
        """Brings the index up to date with ``store`` after ``aligner-index --add/--delete``:
        compresses the store's new shards with the existing centroids into a new segment,
        rebuilds the inverted file, and logs the update with its centroid drift (see
        ``drift``)."""
        known = {name for g in self.meta["segments"] for name in g["shards"]}
        new = [
            i for i, (shard, _, _) in enumerate(store.shard_spans()) if shard["name"] not in known
        ]
        if new:
            score = _ScoreMean()
            name = f"segment-{len(self.meta['segments']):05d}"
            self.meta["segments"].append(
                _write_segment(
                    store,
                    new,
                    name,
                    np.asarray(self.centroids),
                    np.asarray(self.cells),
                    self.codec,
                    self.directory,
                    self.meta["salience"],
                    score,
                )  # fmt: skip
            )
            record.update(
                new_tokens=score.count,
                mean_centroid_score=score.mean,
                drift=self.meta["mean_centroid_score"] - score.mean,
            )
        record.update(op=op, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.meta["updates"].append(record)
        return CentroidIndex._finish(store, self.directory, self.meta)

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
        """Maps the index of ``store``: sizes always checked; every file's sha256 on the first
        open and whenever a file changed (``fileio.verify_once``), always with
        ``verify_checksums``."""
        out = Path(store.directory) / SUBDIR
        path = out / META
        rebuild = f"aligner-index --index_dir={store.directory} --search_index"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise errors.IndexIntegrityError(
                f"{path} does not exist: build the search index with {rebuild}"
            ) from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise errors.IndexIntegrityError(
                f"{path}: not valid JSON ({e}); rebuild it with {rebuild}"
            ) from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise errors.IndexIntegrityError(
                f"{path}: format {found!r}, this version reads {FORMAT!r}; rebuild it with "
                f"{rebuild}"
            )
        try:
            stale = meta["store_manifest_sha256"] != fileio.sha256_file(
                Path(store.directory) / ts.MANIFEST
            )
            other = meta["store_fingerprint"] != store.manifest["model"].get("fingerprint")
            files = {out / f"{n}.npy": (e["bytes"], e["sha256"]) for n, e in meta["files"].items()}
        except (KeyError, TypeError) as e:
            raise errors.IndexIntegrityError(
                f"{path}: damaged (no valid {e} entry); rebuild it with {rebuild}"
            ) from e
        if other or (stale and _check_store):
            raise errors.IndexIntegrityError(
                f"{path}: built for another version of the token store in {store.directory}; "
                f"rebuild it with {rebuild}"
            )
        for f, (size, _) in files.items():
            if not f.exists() or f.stat().st_size != size:
                raise errors.IndexIntegrityError(
                    f"{f} is missing or has another size than {path} records; rebuild it with "
                    f"{rebuild}"
                )
        # sha256 on the first open (and whenever a file changed), then a record: as the store
        fileio.verify_once(
            {f: digest for f, (_, digest) in files.items()},
            path,
            out / ts.VERIFIED,
            force=verify_checksums,
            log=logging.warning,
        )
        index = cls._open(out, meta)
        if _check_store and len(index.codes) != store.num_tokens:
            raise errors.IndexIntegrityError(
                f"{path}: {len(index.codes)} tokens, the store has {store.num_tokens}; rebuild "
                f"it with {rebuild}"
            )
        return index

    @classmethod
    def _open(cls, out: Path, meta: dict) -> CentroidIndex:
        """Maps the files of ``meta`` (small tables read, large arrays mapped)."""
        mapped = lambda n: np.load(out / f"{n}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
        read = lambda n: np.load(out / f"{n}.npy", allow_pickle=False)  # noqa: E731
        lower, step = read("codec")
        arrays = {
            "centroids": read("centroids"),
            "cells": read("cells"),
            "codec": codec_lib.ResidualCodec(meta["config"]["residual_bits"], lower, step),
            "ivf": (read("ivf_offsets"), mapped("ivf_docs")),
            "doc_codes": (mapped("doc_code_offsets"), mapped("doc_codes")),
        }
        for kind in _segment_kinds(meta):
            arrays[kind] = Segmented([mapped(f"{g['name']}.{kind}") for g in meta["segments"]])
        return cls(out, meta, arrays)


def _segment_kinds(meta: dict) -> tuple[str, ...]:
    return ("codes", "residuals", "salience") if meta.get("salience") else ("codes", "residuals")


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": fileio.sha256_tracked(path)}


class _ScoreMean:
    """Running mean of the tokens' max centroid scores (the drift reference)."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, scores: np.ndarray) -> None:
        self.total += float(np.sum(scores, dtype=np.float64))
        self.count += len(scores)

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def _write_segment(
    store, shards, name: str, centroids, cells, codec, out: Path, salience: bool, score
) -> dict:
    """Codes, packed residuals (and saliences) of the tokens of store ``shards`` (consecutive
    indices), streamed shard by shard into ``out/<name>.*.npy``; returns the segment entry."""
    spans = store.shard_spans()
    shards = list(shards)
    tokens = sum(spans[i][0]["num_tokens"] for i in shards)
    streams = {
        "codes": fileio.NpyStream(
            out / f"{name}.codes.npy", (tokens,), _code_dtype(len(centroids))
        ),
        "residuals": fileio.NpyStream(
            out / f"{name}.residuals.npy", (tokens, codec.bytes_per_token), np.uint8
        ),
    }
    if salience:
        streams["salience"] = fileio.NpyStream(
            out / f"{name}.salience.npy", (tokens,), ts.VECTOR_DTYPE
        )
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(stream)
        bar = progress.Progress(tokens, "search index: compress tokens", "token")
        for i in shards:
            vectors, sal, _ = store.shard_arrays(i)
            for lo in range(0, len(vectors), CHUNK):
                v = np.asarray(vectors[lo : lo + CHUNK], np.float32)
                c, best = kmeans.assign_two_level(v, centroids, cells)
                score.add(best)
                streams["codes"].write(c)
                streams["residuals"].write(codec.encode(v - centroids[c]))
                bar.update(len(v))
            if salience:
                streams["salience"].write(np.asarray(sal))
            del vectors, sal  # unmapped: one shard at a time
        bar.close()
    return {"name": name, "shards": [spans[i][0]["name"] for i in shards], "num_tokens": tokens}


def _shard_pairs(codes, spans, i: int, beta_d: float, store, num_centroids: int):
    """Shard ``i``'s (document, centroid) pairs: every token's (for centroid interaction) and
    the β^d-kept tokens' (for the inverted file), each unique and sorted by document."""
    shard, token_start, doc_start = spans[i]
    n = shard["num_tokens"]
    local_codes = np.asarray(codes.span(token_start, token_start + n), np.int64)
    salience, local = store.shard_arrays(i)[1:]
    docs = np.repeat(np.arange(len(local) - 1, dtype=np.int64), np.diff(local))
    every = np.unique(docs * num_centroids + local_codes)
    if beta_d >= 1.0:
        kept = every
    else:
        rows = _kept_local(salience, local, beta_d)
        kept = np.unique(docs[rows] * num_centroids + local_codes[rows])
    return every, kept, doc_start


def _write_lists(store, codes: Segmented, meta: dict, out: Path) -> None:
    """The inverted file (centroid → sorted documents owning a β^d-kept token of it) and the
    document → distinct centroid lists, in two passes over the shards: counts, then fills
    (documents come in increasing order, so every list is sorted as it is filled)."""
    c = meta["num_centroids"]
    beta_d = meta["config"]["beta_d"]
    spans = store.shard_spans()
    ivf_counts = np.zeros(c, np.int64)
    doc_counts = np.zeros(store.num_docs, np.int64)
    for i in range(len(spans)):
        every, kept, doc_start = _shard_pairs(codes, spans, i, beta_d, store, c)
        ivf_counts += np.bincount(kept % c, minlength=c)
        doc_counts[doc_start : doc_start + spans[i][0]["num_docs"]] = np.bincount(
            every // c, minlength=spans[i][0]["num_docs"]
        )
    ivf_offsets = np.zeros(c + 1, np.int64)
    np.cumsum(ivf_counts, out=ivf_offsets[1:])
    doc_offsets = np.zeros(store.num_docs + 1, np.int64)
    np.cumsum(doc_counts, out=doc_offsets[1:])
    ivf_docs = np.empty(int(ivf_offsets[-1]), np.int32)
    cursor = ivf_offsets[:-1].copy()
    with fileio.NpyStream(out / "doc_codes.npy", (int(doc_offsets[-1]),), _code_dtype(c)) as dc:
        for i in range(len(spans)):
            every, kept, doc_start = _shard_pairs(codes, spans, i, beta_d, store, c)
            dc.write(every % c)
            cents, docs = kept % c, kept // c + doc_start
            order = np.argsort(cents, kind="stable")  # by centroid, documents still increasing
            cents, docs = cents[order], docs[order]
            first = np.searchsorted(cents, cents, side="left")
            slot = cursor[cents] + (np.arange(len(cents)) - first)
            ivf_docs[slot] = docs
            cursor += np.bincount(cents, minlength=c)
    fileio.atomic_save_npy(out / "ivf_offsets.npy", ivf_offsets)
    fileio.atomic_save_npy(out / "ivf_docs.npy", ivf_docs)
    fileio.atomic_save_npy(out / "doc_code_offsets.npy", doc_offsets)
