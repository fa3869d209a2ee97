"""Export a token store to a Qdrant collection (``aligner-publish``).

Each live document of the store (tombstones of ``aligner-index --delete`` are skipped) becomes
one point whose id is its position in the store (stable: document order), with

* the multivector ``aligner``: its stored token vectors (already pruned to the store's β^d at
  indexing, ``IndexingConfig.store_beta_d``; ``ExportConfig.beta_d`` < 1 prunes further by
  salience, the rule of ``core.pruning``, §3.2), scored by Qdrant's MaxSim
  Σ_i max_j q_i·d_j. That is n_q × ALIGNER's top-1 score (Eq. 1–2 with Ã = top-1 and u ≡ 1:
  sim = Σ_i max_j S_ij / n_q), so for a model without salience (zero-shot, ``salience: none``)
  Qdrant ranks exactly as the exhaustive searcher; a model with salience weights A by
  u^q ⊗ u^d, which MaxSim cannot express (a warning says so);
* a sparse vector with the IDF modifier (``serving.sparse``: BM25 or miniCOIL), unless
  ``sparse='none'``;
* the payload ``{doc_id, title}``.

Batches of ``batch_size`` documents are upserted with progress (rate, ETA). The embedded target
is written to a temporary folder and renamed into place when complete (an interrupted export
leaves nothing at ``--qdrant_path``); the publication record (``RECORD``: the index, model,
settings and what the query side needs, e.g. BM25's vocabulary) is written last, after a miniCOIL
index's folder (``save_minicoil``: its meaning models, stems and cells, beside the record).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import gin
import numpy as np
from absl import logging

from aligner_jax.common import checks, fileio
from aligner_jax.common.errors import ConfigError, MissingPathError
from aligner_jax.core import pruning
from aligner_jax.data import beir
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import token_store as ts
from aligner_jax.serving import sparse as sparse_lib
from aligner_jax.serving import targets

RECORD = "aligner_publication.json"
MINICOIL = "aligner_minicoil"  # the saved MiniCoilIndex of an embedded shard (its query side)
FORMAT = "aligner_jax.serving/1"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """Attributes:
    sparse: ``bm25``, ``minicoil`` or ``none`` (the lexical sparse vector beside the tokens).
    beta_d: fraction of each document's stored tokens (top by salience) exported (§3.2).
    datatype: ``float32`` (exact) or ``float16`` (half the bytes; queries rounded to float16).
    batch_size: documents per upsert.
    bm25_k1, bm25_b: BM25's parameters (``BM25Index.build``'s defaults).
    """

    sparse: str = "bm25"
    beta_d: float = 1.0
    datatype: str = "float32"
    batch_size: int = 64
    bm25_k1: float = 1.5
    bm25_b: float = 0.75

    def __post_init__(self):
        checks.choice("ExportConfig.sparse", self.sparse, sparse_lib.KINDS)
        checks.number("ExportConfig.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        checks.choice("ExportConfig.datatype", self.datatype, targets.DATATYPES)
        checks.integer("ExportConfig.batch_size", self.batch_size, minimum=1)
        checks.number("ExportConfig.bm25_k1", self.bm25_k1, 0.0)
        checks.number("ExportConfig.bm25_b", self.bm25_b, 0.0, 1.0)


def corpus_files(manifest: dict, corpus: str | os.PathLike | None = None) -> list[Path]:
    """The corpus files of a store: the indexed corpus (``corpus``: where it is now, a file or
    a BEIR folder; default the path the manifest records, when it records one), then every
    ``--add`` file. Documents given in Python (``Index.add``, ``add_encoded``) have no file."""
    recorded = manifest.get("corpus", {}).get("path")
    path = Path(corpus) if corpus is not None else (Path(recorded) if recorded else None)
    files = [] if path is None else [path / "corpus.jsonl" if path.is_dir() else path]
    for update in manifest.get("updates", []):
        source = update.get("source")
        if update.get("op") == "add" and source and Path(source).is_absolute():
            files.append(Path(source))
    return files


def _stored_documents(store: ts.TokenStore, doc_ids: set[str]) -> dict[str, beir.Document]:
    """The documents ``doc_ids`` as the index's ``documents.sqlite`` holds them (none without
    one, or in an index kept without text: ``IndexingConfig.store_text = False``)."""
    if not (store.directory / documents_lib.FILE).exists():
        return {}
    shards = sorted(store.manifest["shards"], key=lambda s: s["index"])
    table = documents_lib.DocumentTable(store.directory, shards)
    positions = [i for i, d in enumerate(store.doc_ids) if d in doc_ids and not store.deleted[i]]
    found = {}
    for row in table.fetch(positions):
        if row is not None and row["text"] is not None:
            found[row["doc_id"]] = beir.Document(row["doc_id"], row["title"] or "", row["text"])
    return found


def store_documents(
    store: ts.TokenStore, doc_ids: set[str], corpus: str | os.PathLike | None = None
) -> dict[str, beir.Document]:
    """The documents ``doc_ids`` of the store: from the index's own ``documents.sqlite``, else
    (an index without text, or ``corpus`` given) from the corpus files its manifest names
    (``corpus``: the indexed corpus's current place, ``corpus_files``), a replaced document
    from the last file that holds it."""
    found = {} if corpus is not None else _stored_documents(store, doc_ids)
    files = corpus_files(store.manifest, corpus)
    # the newest file first: a document deleted and added again is its --add file's version
    for path in reversed(files) if doc_ids - found.keys() else []:
        if path.is_file():
            for doc in beir.iter_corpus(path, check_duplicates=False):
                if doc.doc_id in doc_ids and doc.doc_id not in found:
                    found[doc.doc_id] = doc
    missing = doc_ids - found.keys()
    if missing:
        where = (
            f"the corpus files it names ({', '.join(map(str, files))})"
            if files
            else ("its documents.sqlite, and it names no corpus file")
        )
        raise MissingPathError(
            f"{store.directory / ts.MANIFEST}: {len(missing)} documents (e.g. "
            f"{sorted(missing)[:3]}) are not in {where}; their texts are needed for the sparse "
            "vectors and titles: pass --corpus=PATH (the indexed corpus file or BEIR folder, "
            "where it is now), or publish with --sparse=none"
        )
    return found


def build_sparse(config: ExportConfig, texts: list[str], minicoil_index=None, rows=None):
    """The sparse vectors of the exported documents (None for ``sparse='none'``)."""
    if config.sparse == "bm25":
        return sparse_lib.Bm25Vectors.build(texts, k1=config.bm25_k1, b=config.bm25_b)
    if config.sparse == "minicoil":
        if minicoil_index is None:
            raise ConfigError("--sparse=minicoil needs a fitted miniCOIL index (MiniCoilIndex)")
        vectors = sparse_lib.MiniCoilVectors(minicoil_index, rows)
        vectors.check_idf()
        return vectors
    return None


def _document_points(store, rows, doc_ids, beta_d, doc_matrix, sparse_rows, docs):
    """The points of store documents ``rows`` (store positions, ascending)."""
    lo, hi = int(store.offsets[rows[0]]), int(store.offsets[rows[-1] + 1])
    vectors = store.vectors(lo, hi)
    if beta_d < 1.0:
        keep = np.zeros(hi - lo, bool)
        offsets = np.concatenate([[store.offsets[r], store.offsets[r + 1]] for r in rows])
        for a, b in offsets.reshape(-1, 2) - lo:
            keep[pruning.top_fraction(store.salience(lo + a, lo + b), beta_d) + a] = True
    points = []
    for r, s in zip(rows, sparse_rows, strict=True):
        a, b = int(store.offsets[r]) - lo, int(store.offsets[r + 1]) - lo
        tokens = vectors[a:b] if beta_d >= 1.0 else vectors[a:b][keep[a:b]]
        doc_id = doc_ids[r]
        title = docs[doc_id].title if doc_id in docs else ""
        points.append(
            targets.PointData(
                id=int(r),
                multivector=np.asarray(tokens, np.float32) if len(tokens) else None,
                sparse=None if doc_matrix is None else sparse_lib.row_vector(doc_matrix, s),
                payload={"doc_id": doc_id, "title": title},
            )
        )
    return points


def export_store(
    store: ts.TokenStore,
    target,
    config: ExportConfig | None = None,
    minicoil_index=None,
    minicoil_rows: np.ndarray | None = None,
    corpus: str | os.PathLike | None = None,
) -> dict:
    """Writes every live document of ``store`` to ``target`` (created here; ``targets``);
    returns the publication record (without writing it).

    ``minicoil_index`` (``sparse='minicoil'``): a fitted ``MiniCoilIndex`` whose ``doc_matrix``
    rows are the store's documents (or ``minicoil_rows``: its row of each store document).
    ``corpus``: the indexed corpus's current place when it moved (``corpus_files``).
    """
    config = config or ExportConfig()
    start = time.perf_counter()
    live = np.flatnonzero(~store.deleted)
    if not len(live):
        raise ConfigError(f"{store.directory}: every document is deleted; nothing to publish")
    ids = store.doc_ids
    if store.has_saliences:
        logging.warning(
            "the model has salience (%s): Qdrant's MaxSim ranks by Σ_i max_j q_i·d_j (ALIGNER "
            "top-1 with u = 1), not by Eq. 2's salience-weighted alignment",
            store.manifest["model"].get("salience"),
        )
    if config.beta_d < 1.0 and not store.has_saliences:
        logging.warning(
            "ExportConfig.beta_d=%s on a model without saliences (every u = 1): the export %s",
            config.beta_d,
            pruning.PRUNED_BY[False],
        )
    try:
        docs = store_documents(store, {ids[r] for r in live}, corpus)
    except MissingPathError as e:
        if config.sparse != "none":
            raise
        logging.warning("no titles in the payload: %s", e)  # optional without sparse vectors
        docs = {}
    texts = [beir.document_text(docs[ids[r]]) for r in live] if config.sparse != "none" else []
    rows = live if minicoil_rows is None else np.asarray(minicoil_rows)[live]
    sparse = build_sparse(config, texts, minicoil_index, rows)
    layout = targets.CollectionLayout(
        dim=store.dim, datatype=config.datatype, sparse=None if sparse is None else sparse.name
    )
    doc_matrix, empty = None, 0
    if sparse is not None:
        doc_matrix = sparse.doc_matrix.tocsr()
        doc_matrix.eliminate_zeros()  # no posting for a 0
        empty = int(np.count_nonzero(np.diff(doc_matrix.indptr) == 0))
        if empty:
            logging.warning(
                "%d documents have no indexed word (an empty %s vector, e.g. only stopwords): "
                "the engine's IDF counts the other %d documents, ours all %d, so its %s scores "
                "differ a little from ours (aligner-index --delete them to make them equal)",
                empty, sparse.name, len(live) - empty, len(live), sparse.name,
            )  # fmt: skip
    target.create(layout)
    sparse_s = time.perf_counter() - start
    done, last_log = 0, time.perf_counter()
    for i in range(0, len(live), config.batch_size):
        batch = live[i : i + config.batch_size]
        sparse_rows = range(i, i + len(batch))
        target.upsert(
            _document_points(store, batch, ids, config.beta_d, doc_matrix, sparse_rows, docs)
        )
        done += len(batch)
        now = time.perf_counter()
        if now - last_log > 10 or done == len(live):
            rate = done / (now - start)
            logging.info(
                "aligner-publish: %d/%d documents, %.1f docs/s, ETA %.0fs",
                done,
                len(live),
                rate,
                (len(live) - done) / rate,
            )
            last_log = now
    target.finish()
    count = target.count()
    if count != len(live):
        raise RuntimeError(
            f"{target.describe()}: {count} points after export, expected {len(live)}"
        )
    return {
        "format": FORMAT,
        "index_dir": str(store.directory.resolve()),
        "model": store.manifest["model"],
        "corpus": store.manifest.get("corpus", {}),
        "multivector": targets.MULTIVECTOR,
        "datatype": config.datatype,
        "beta_d": config.beta_d,
        "store_beta_d": store.manifest.get("indexing", {}).get("store_beta_d", 1.0),
        "num_points": count,
        "deleted_skipped": int(store.deleted.sum()),
        "sparse": None if sparse is None else sparse.state(),
        "sparse_empty_docs": empty,
        "seconds": {"sparse": round(sparse_s, 3), "total": round(time.perf_counter() - start, 3)},
    }


def save_minicoil(record: dict, minicoil_index, folder: Path) -> None:
    """Saves a ``MiniCoilIndex`` the query side needs (its meaning models, stems and cells) to
    ``folder`` and names it in ``record['sparse']['index']`` (relative to the record's folder),
    so a later query loads it instead of fitting anything. An index without ``save`` (any object
    of the contract) is not saved: its queries then need it passed (``QdrantSearcher.open``)."""
    if (record.get("sparse") or {}).get("kind") != "minicoil" or not hasattr(
        minicoil_index, "save"
    ):
        return
    minicoil_index.save(folder)
    record["sparse"].update(
        index=folder.name,
        dim=int(minicoil_index.models.dim),
        words_with_model=len(minicoil_index.models.words),
    )


def minicoil_folder(record: dict, record_dir: str | os.PathLike | None = None) -> Path | None:
    """The saved miniCOIL index of a publication (None if it saved none): beside the record in
    ``record_dir`` (default: an embedded shard's own folder, as recorded)."""
    name = (record.get("sparse") or {}).get("index")
    if not name:
        return None
    if record_dir is None:
        where = record.get("target", {})
        if where.get("kind") != "edge":
            raise ConfigError(
                "this collection's miniCOIL models are saved beside its record: give the "
                "record's folder (--record=FILE.json)"
            )
        record_dir = where["path"]
    return Path(record_dir) / name


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a publish that may still be writing its folder)."""
    try:
        os.kill(pid, 0)  # signal 0: only whether it exists (PermissionError: another user's)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def publish_embedded(
    store: ts.TokenStore,
    path: str | os.PathLike,
    config=None,
    overwrite: bool = False,
    **kwargs,
) -> dict:
    """Exports to an embedded ``qdrant_edge`` shard at ``path``, atomically: built in a
    temporary folder beside it, then renamed into place. An earlier publication there is
    replaced only with ``overwrite`` (``--overwrite``); any other non-empty folder is refused.
    Returns the record (also ``path/RECORD``)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--qdrant_path={path}: a file, not a folder; choose a new folder")
    if path.exists() and any(path.iterdir()) and not (path / RECORD).is_file():
        raise ConfigError(
            f"--qdrant_path={path}: a non-empty folder that is not an aligner-publish shard; "
            "choose a new or empty folder"
        )
    if (path / RECORD).is_file() and not overwrite:
        raise ConfigError(
            f"--qdrant_path={path}: already holds a publication; pass --overwrite to replace "
            "it, or choose another folder"
        )
    fileio.check_output_dir(path.parent, "--qdrant_path")
    for stale in path.parent.glob(f".{path.name}.*-*"):  # what a killed publish left
        kind, _, pid = stale.name.rpartition("-")
        if kind.endswith((".partial", ".old")) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    target = targets.EdgeTarget(partial)
    try:
        record = export_store(store, target, config, **kwargs)
    except BaseException:
        target.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    target.close()
    record["target"] = {"kind": "edge", "path": str(path.resolve())}
    try:
        save_minicoil(record, kwargs.get("minicoil_index"), partial / MINICOIL)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fileio.atomic_write_json(partial / RECORD, record)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return record


def publish_client(
    store: ts.TokenStore, target: targets.ClientTarget, record_path, config=None, **kwargs
) -> dict:
    """Exports to a Qdrant server/cluster collection (``ClientTarget``); the record is written
    to ``record_path`` once every point is in (a miniCOIL index beside it, in
    ``RECORD_STEM.minicoil/``)."""
    record_path = Path(record_path)
    record = export_store(store, target, config, **kwargs)
    record["target"] = {
        "kind": "client",
        "url": target.url,
        "collection": target.collection,
        "shard_number": target.shards,  # None: the server's default
        "replication_factor": target.replication,
    }
    folder = record_path.with_name(f"{record_path.stem}.minicoil")
    save_minicoil(record, kwargs.get("minicoil_index"), folder)
    fileio.atomic_write_json(record_path, record)
    return record


def read_record(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(
            f"{path}: no publication record (aligner-publish writes it when an export completes)"
        )
    record = ts.read_json(path, "publish the index again")
    if record.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {record.get('format')!r}, this version reads {FORMAT}")
    return record
