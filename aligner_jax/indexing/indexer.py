"""The indexing job: a corpus stream → encoded, salience-scored tokens in a sharded token store.

Documents are read as a stream and cut into fixed-size shards by position (shard ``i`` holds
documents ``[i·S, (i+1)·S)``). Shard ``i`` belongs to process ``i mod P`` (``P`` =
``jax.process_count()``), so many hosts index one corpus without talking to each other. Each shard
is encoded and written atomically (see :mod:`aligner_jax.indexing.token_store`); a re-run skips every shard
whose commit marker exists, so a killed job resumes after its last complete shard and produces the
same bytes. Peak memory is bounded by the shard and batch sizes, not by the corpus size. The
manifest is written when all shards are complete.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import gin
import jax
import numpy as np
from absl import logging

from aligner_jax.common import checks, errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import pruning
from aligner_jax.data import beir, corpus_sources
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.indexing import centroid_index, distributed_build
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import token_store as ts

CONFIG_FILE = "index_config.json"
ENCODER_FILE = "encoder.json"  # how to rebuild the query encoder (EncoderBundle.spec)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class IndexingConfig:
    """Attributes:
    shard_size: documents per shard (bounds memory; the unit of resumption).
    store_beta_d: fraction of each document's tokens (top by salience) kept in the refinement
      store. 1.0 stores every token (of salience above 0, below), so refinement uses full
      documents (paper §3.2); lower values drop pruned tokens from disk too.
    drop_zero_salience: store only the tokens whose salience u^d is above 0 (a document with
      none keeps its first token). Eq. 2 gives them no weight; kept, they can only take a query
      token's top-1 alignment and silence it, which lets documents of unrelated tokens win
      (benchmarks/results/README.md, "Tokens of zero salience"). A deviation from the paper,
      whose refinement scores every token ("we still use the full model with all token
      vectors", §3.2): here Ã (Eq. 2) picks among the stored tokens only, and top-p's ⌊p·m⌋
      counts m stored tokens. False gives the paper's refinement. Stores that predate the
      setting kept them (``recorded``). A no-op for models without saliences (u = 1).
    store_text: keep each document's title and text in ``documents.sqlite`` (search hits show
      them); False keeps only ids and metadata (filters still work).
    """

    shard_size: int = ts.SHARD_SIZE
    store_beta_d: float = 1.0
    drop_zero_salience: bool = True
    store_text: bool = True

    def __post_init__(self):
        checks.integer("IndexingConfig.shard_size", self.shard_size, minimum=1)
        checks.number("IndexingConfig.store_beta_d", self.store_beta_d, 0.0, 1.0, low_open=True)
        for name in ("drop_zero_salience", "store_text"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{checks.flag(f'IndexingConfig.{name}', getattr(self, name))}: expected "
                    "True or False"
                )

    @classmethod
    def recorded(cls, settings: dict) -> IndexingConfig:
        """The config a store's recorded ``indexing`` settings describe; a store written before
        ``drop_zero_salience`` existed (or by ``TokenStoreWriter``, which stores what it is
        given) kept its tokens of zero salience."""
        return cls(**{"drop_zero_salience": False, **settings})

    def settings(self) -> dict:
        """The settings recorded in ``index_config.json`` and the manifest. ``store_text`` only
        when False: indexes built before it existed keep their recorded settings."""
        out = dataclasses.asdict(self)
        if self.store_text:
            del out["store_text"]
        return out


@dataclasses.dataclass
class IndexingSummary:
    directory: Path
    num_docs: int
    num_tokens: int
    num_shards: int
    shards_written: int
    shards_skipped: int
    encode_seconds: float
    tokens_encoded: int  # by this run (num_tokens counts the skipped shards' too)
    truncated_docs: int
    empty_docs: int
    complete: bool
    # ``k of n`` in a multi-process job: shards_written / shards_skipped / encoding are that
    # process's; documents, tokens (once complete) and the truncation counts the index's
    process: str | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["directory"] = str(self.directory)
        return d


def _shards(documents: Iterable[beir.Document], size: int) -> Iterator[list[beir.Document]]:
    shard: list[beir.Document] = []
    for doc in documents:
        shard.append(doc)
        if len(shard) == size:
            yield shard
            shard = []
    if shard:
        yield shard


def stored_rows(salience: np.ndarray, config: IndexingConfig) -> np.ndarray:
    """The positions of a document's tokens (of saliences ``salience``) that the store keeps:
    the top ``store_beta_d`` by salience (§3.2), then those whose salience, as stored
    (float16), is above 0 (``drop_zero_salience``)."""
    salience = np.asarray(salience)
    rows = np.arange(len(salience))
    if config.store_beta_d < 1.0:
        rows = pruning.top_fraction(salience, config.store_beta_d)
    if config.drop_zero_salience:
        rows = rows[pruning.salient(salience[rows].astype(ts.VECTOR_DTYPE))]  # as stored
    return rows


def _stored_tokens(encoded, config: IndexingConfig):
    """One encoded document cut to the tokens the store keeps (``stored_rows``)."""
    rows = stored_rows(encoded.salience, config)
    if len(rows) == len(encoded.salience):
        return encoded
    return dataclasses.replace(
        encoded,
        token_ids=encoded.token_ids[rows],
        vectors=encoded.vectors[rows],
        salience=encoded.salience[rows],
    )


def _same_corpus_anywhere(settings: dict) -> dict:
    """``settings`` with the corpus's path left out when its bytes are fingerprinted (sha256):
    the same file moved or mounted elsewhere is the same corpus."""
    corpus = settings.get("corpus") or {}
    if "sha256" not in corpus:
        return settings
    return {**settings, "corpus": {k: v for k, v in corpus.items() if k != "path"}}


def check_or_write_config(directory: Path, settings: dict) -> dict:
    """Records ``settings`` (model, indexing settings, corpus) in ``index_config.json``, or
    refuses a directory started with other ones; returns the recorded settings (a corpus at
    another path than recorded, with the same bytes, keeps the recorded path)."""
    path = directory / CONFIG_FILE
    if path.exists() and not _holds_work(directory):
        # only the settings of a job that stopped before its first shard (a corpus refused at
        # a later line, a Ctrl-C while loading the model): nothing to resume, start again
        fileio.remove(directory / ENCODER_FILE)
        fileio.remove(path)
    if path.exists():
        existing = ts.read_json(path, "delete the index directory and index again")
        if _same_corpus_anywhere(existing) != _same_corpus_anywhere(settings):
            diff = {
                k: (existing.get(k), settings.get(k))
                for k in set(existing) | set(settings)
                if existing.get(k) != settings.get(k)
            }
            if (
                ts.read_shard_marker(directory, 0) is not None
                and not (directory / ts.MANIFEST).exists()
            ):
                raise errors.IndexIntegrityError(
                    f"{directory}: its indexing job did not finish ({ts.MANIFEST} is missing) and "
                    f"was started with other settings {diff} (existing, requested): a job resumes "
                    "only with its own settings and corpus, unchanged; re-run it so, or delete "
                    "the directory and index again."
                )
            raise errors.IndexIntegrityError(
                f"{path}: this index directory was started with other settings {diff} "
                "(existing, requested). Use another --index_dir or delete this one."
            )
        return existing
    directory.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(path, settings)
    return settings


def _holds_work(directory: Path) -> bool:
    """Whether an index directory holds a manifest or any shard (complete or partly written)."""
    return (directory / ts.MANIFEST).exists() or any(directory.glob("shard-*"))


def warn_unapplied_settings(index_dir: Path, manifest: dict) -> None:
    """Warns when this run's ``IndexingConfig`` bindings differ from the store's recorded ones:
    a reused or updated store is written with its own (``aligner-eval`` reusing it,
    ``aligner-index --add``)."""
    wanted = IndexingConfig().settings()
    recorded = IndexingConfig.recorded(manifest.get("indexing", {})).settings()
    changed = {k: v for k, v in wanted.items() if recorded.get(k, v) != v}
    if changed:
        logging.warning(
            "%s: written with its own IndexingConfig %s; not applied: %s (index into another "
            "--index_dir to use them)",
            index_dir, {k: recorded.get(k) for k in changed}, changed,
        )  # fmt: skip


def write_encoder_spec(directory: Path, bundle) -> None:
    """Saves ``encoder.json`` (the model that encodes this store's queries) unless it exists."""
    path = Path(directory) / ENCODER_FILE
    if not path.exists():
        fileio.atomic_write_json(path, bundle.spec())


def encode_shard(
    directory: Path,
    shard_index: int,
    docs: list[beir.Document],
    encoder: Encoder,
    config,
    bar: progress.Progress | None = None,
) -> dict:
    """Encodes ``docs`` and writes them as shard ``shard_index``; returns its manifest entry.

    The documents' rows (``documents.sqlite``) are written first, the shard's files after, its
    marker last: a committed shard always has its rows."""
    documents_lib.write_shard(directory, shard_index, docs, config.store_text)
    texts = [beir.document_text(d) for d in docs]
    token_ids = encoder.tokenize(texts, "doc")
    encoded = [None] * len(docs)
    for i, e in encoder.encode_token_ids(token_ids, "doc", bar=bar):
        encoded[i] = _stored_tokens(e, config)
    shard_docs = [
        ts.EncodedDocument(d.doc_id, e.vectors, e.salience, e.token_ids)
        for d, e in zip(docs, encoded, strict=True)
    ]
    stats = {
        "truncated_docs": encoder.count_truncated(texts, token_ids, "doc"),
        "empty_docs": int(sum(not t.strip() for t in texts)),
    }
    return ts.write_shard(directory, shard_index, shard_docs, encoder.dim, stats)


def writer_lock(directory: str | Path, process_index: int = 0):
    """The advisory lock of one writer per index directory and process index
    (``.lock-<process_index>``), held while a job writes there: indexing, updates and building
    the search index (process 0's lock: there is one search index per directory). A second
    writer is refused with a ``LockedError`` naming the holder's pid."""
    directory = Path(directory)
    return fileio.exclusive_lock(
        directory / f".lock-{process_index}",
        f"index directory {directory} (process {process_index})",
    )


def build_token_store(
    documents: Iterable[beir.Document],
    encoder: Encoder,
    directory: str | Path,
    config: IndexingConfig | None = None,
    process_index: int = 0,
    process_count: int = 1,
    corpus_info: dict | None = None,
    split: distributed_build.ProcessSplit | None = None,
) -> IndexingSummary:
    """Encodes ``documents`` into a token store at ``directory`` (resuming if interrupted).

    One writer per directory and process index: an advisory lock ``.lock-<process_index>`` is
    held while indexing; a second job on the same directory (and process index) is refused.
    ``split``: the processes of one JAX job; once all have encoded their shards (a barrier),
    process 0 writes the manifest, and every process returns after it.
    """
    config = config or IndexingConfig()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with writer_lock(directory, process_index):
        return _build_token_store(
            documents, encoder, directory, config, process_index, process_count, corpus_info,
            split,
        )  # fmt: skip


def _build_token_store(
    documents, encoder, directory, config, process_index, process_count, corpus_info, split
) -> IndexingSummary:
    model_info = encoder.bundle.info()
    settings = {
        "model": model_info,
        "indexing": config.settings(),
        "corpus": corpus_info or {},
    }
    settings = check_or_write_config(directory, settings)
    write_encoder_spec(directory, encoder.bundle)
    if (directory / ts.MANIFEST).exists():
        manifest = ts.read_manifest(directory)
        if manifest.get("first_shard", 0):  # vacuumed: the corpus's shards were replaced
            logging.info("indexing: %s was vacuumed (--vacuum); its store is kept", directory)
            counts, stats = manifest["counts"], manifest.get("stats", {})
            return IndexingSummary(
                directory, counts["num_docs"], counts["num_tokens"], counts["num_shards"], 0,
                counts["num_shards"], 0.0, 0, stats.get("truncated_docs", 0),
                stats.get("empty_docs", 0), True,
            )  # fmt: skip
    entries, written, skipped = [], 0, 0
    encode_seconds, total_docs, total_tokens, tokens_encoded = 0.0, 0, 0, 0
    total = len(documents) if hasattr(documents, "__len__") else None
    if total is not None and process_count > 1:
        total = -(-total // process_count)
    bar = progress.Progress(total, "index: encode documents", "doc")
    for shard_index, docs in enumerate(_shards(documents, config.shard_size)):
        total_docs += len(docs)
        if shard_index % process_count != process_index:
            continue
        marker = ts.read_shard_marker(directory, shard_index)
        if marker is not None and _holds(directory, marker, docs):
            documents_lib.ensure_shard(directory, shard_index, docs, config.store_text)
            entries.append(marker)
            skipped += 1
            total_tokens += marker["num_tokens"]
            bar.skip(len(docs))  # written by an earlier run: not part of this run's rate
            continue
        for stale in directory.glob(f".{ts.shard_name(shard_index)}.*.tmp"):
            stale.unlink()  # left by a write that was killed before its rename
        t0 = time.perf_counter()
        entry = encode_shard(directory, shard_index, docs, encoder, config, bar)
        entries.append(entry)
        written += 1
        total_tokens += entry["num_tokens"]
        tokens_encoded += entry["num_tokens"]
        encode_seconds += time.perf_counter() - t0
    bar.close()
    if total_docs == 0:
        raise ConfigError("indexing: the corpus holds no documents")
    num_shards = -(-total_docs // config.shard_size)
    if split is not None:
        split.barrier("every shard encoded")
    complete = finalize(directory, num_shards, settings, write=split is None or split.leader)
    if split is not None and not complete:
        unseen = [i for i in range(num_shards) if ts.read_shard_marker(directory, i) is None]
        raise ConfigError(
            f"--index_dir={directory}: {len(unseen)} of {num_shards} shards (e.g. "
            f"{ts.shard_name(unseen[0])}), which other processes of this job wrote, are not "
            f"visible to process {split.rank} after every process finished encoding: the "
            "index directory must be storage every process shares (NFS, a GCS FUSE mount); "
            "the shards written stay, and a run on shared storage resumes them"
        )
    if split is not None:
        split.barrier("manifest written")
    stats = _sum_stats(directory, num_shards)
    if complete:  # the corpus's shards, not this process's (nor an --add's after them)
        total_tokens = sum(
            ts.read_shard_marker(directory, i)["num_tokens"] for i in range(num_shards)
        )
    return IndexingSummary(
        directory=directory,
        num_docs=total_docs,
        num_tokens=total_tokens,
        num_shards=num_shards,
        shards_written=written,
        shards_skipped=skipped,
        encode_seconds=encode_seconds,
        tokens_encoded=tokens_encoded,
        truncated_docs=stats["truncated_docs"],
        empty_docs=stats["empty_docs"],
        complete=complete,
        process=f"{process_index + 1} of {process_count}" if process_count > 1 else None,
    )


def format_summary(summary: IndexingSummary) -> str:
    """The one-screen end-of-job summary."""
    rate = summary.tokens_encoded / summary.encode_seconds if summary.encode_seconds else 0.0
    state = "complete" if summary.complete else "INCOMPLETE (other processes' shards missing)"
    return "\n".join(
        [
            "=" * 72,
            f"aligner-index: {summary.directory} — {state}",
            f"documents {summary.num_docs}, tokens {summary.num_tokens}"
            + ("" if summary.complete or summary.process is None else " (this process's)")
            + f", shards {summary.num_shards} ("
            + (f"process {summary.process}: " if summary.process else "")
            + f"{summary.shards_written} written now, {summary.shards_skipped} already complete)",
            f"encoding {summary.encode_seconds:.1f}s ({rate:.0f} tokens/s); truncated documents "
            f"{summary.truncated_docs}, empty documents {summary.empty_docs}",
            "=" * 72,
        ]
    )


def _sum_stats(directory: Path, num_shards: int) -> dict:
    totals = {"truncated_docs": 0, "empty_docs": 0}
    for i in range(num_shards):
        marker = ts.read_shard_marker(directory, i)
        if marker:
            for key in totals:
                totals[key] += marker.get("stats", {}).get(key, 0)
    return totals


def finalize(directory: Path, num_shards: int, settings: dict, write: bool = True) -> bool:
    """Writes the manifest once every shard's marker exists (unless ``write`` is False: another
    process of the job writes it); returns whether it is complete.

    A manifest already updated by ``aligner-index --add/--delete`` is kept as it is (rewriting
    it from the original corpus's shards would drop the additions), and so is one that already
    lists these shards (a re-run of a finished job: its search index stays published)."""
    existing = None
    if (directory / ts.MANIFEST).exists():
        existing = ts.read_manifest(directory)
        if existing.get("updates"):
            logging.info("indexing: %s was updated (--add/--delete); manifest kept", directory)
            return True
    markers = [ts.read_shard_marker(directory, i) for i in range(num_shards)]
    missing = [i for i, m in enumerate(markers) if m is None]
    if missing:
        logging.info(
            "indexing: %d/%d shards complete; the manifest is written when all are done",
            num_shards - len(missing),
            num_shards,
        )
        return False
    if not write:
        return True
    manifest = {
        "model": settings["model"],
        "indexing": settings["indexing"],
        "corpus": settings["corpus"],
        "counts": {
            "num_docs": sum(m["num_docs"] for m in markers),
            "num_tokens": sum(m["num_tokens"] for m in markers),
            "num_shards": num_shards,
        },
        "stats": _sum_stats(directory, num_shards),
        "shards": [{k: v for k, v in m.items() if k != "stats"} for m in markers],
    }
    if existing is not None:
        kept = {k: v for k, v in existing.items() if k not in ("format", "search_index")}
        if kept == json.loads(json.dumps(manifest)):
            logging.info("indexing: %s was complete already; manifest kept", directory)
            return True
    ts.write_manifest(directory, manifest)
    return True


def store_is_complete_for(directory: Path, model_info: dict) -> bool:
    """True when ``directory`` holds a complete store built by this model (reusable); False when
    it has no manifest yet (an interrupted job, completed by the caller). A manifest that exists
    but is invalid is an error naming it, never a reason to rebuild silently."""
    if not (Path(directory) / ts.MANIFEST).exists():
        return False
    manifest = ts.read_manifest(directory)
    ts.check_model_matches(manifest, model_info, directory)
    return True


@gin.configurable
def index_corpus(
    corpus: str,
    index_dir: str,
    process_index: int | None = None,
    process_count: int | None = None,
    corpus_split: str = "train",
    config: IndexingConfig | None = None,
    encoding_config=None,
    search_index: bool = False,
) -> IndexingSummary:
    """The ``aligner-index`` job: stream ``corpus`` into a token store.

    ``corpus`` is a BEIR corpus.jsonl, ``seqio:TASK`` or ``tfds:NAME`` (split ``corpus_split``;
    see :mod:`aligner_jax.data.corpus_sources`).

    Each process (``jax.process_index()`` of ``jax.process_count()`` by default) encodes its own
    shards. Processes of one JAX job (``jax.distributed``, ``launch/local_processes.sh``) then
    wait for each other: process 0 writes the manifest and, with ``search_index``, all of them
    build the search index together (``distributed_build``). Processes started apart
    (``process_index``/``process_count`` given) each finalise the manifest once all shards
    exist, so the last one to finish completes the index and builds the search index alone.
    Re-running resumes after the last complete shard. With ``search_index``, the compressed
    search index (``CentroidIndexConfig``) is built once the store is complete, unless a valid
    one exists.
    """
    config = config or IndexingConfig()
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ConfigError(
            f"--process_index={process_index} must be in [0, --process_count={process_count})"
        )
    fileio.check_output_dir(index_dir, "--index_dir")
    documents, info = corpus_sources.open_corpus(corpus, corpus_split)
    bundle = loading.load_encoder()
    encoder = Encoder(bundle, encoding_config or EncodingConfig())
    one_job = (process_index, process_count) == (jax.process_index(), jax.process_count())
    split = distributed_build.ProcessSplit() if one_job and process_count > 1 else None
    summary = build_token_store(
        documents,
        encoder,
        index_dir,
        config=config,
        process_index=process_index,
        process_count=process_count,
        corpus_info=info,
        split=split,
    )
    if search_index and summary.complete and split is not None:
        distributed_build.build_search_index(index_dir, split, writer_lock(index_dir))
    elif search_index and summary.complete:
        store = ts.TokenStore(index_dir)
        try:
            centroid_index.CentroidIndex.load(store)
            logging.info("the search index of %s is up to date", index_dir)
        except errors.IndexIntegrityError:
            try:
                with writer_lock(index_dir):
                    _build_if_stale(index_dir)
            except errors.LockedError as e:  # another process of this job builds it, or an update
                logging.warning("search index not built here: %s", e)
    return summary


def _holds(directory: Path, marker: dict, docs: list) -> bool:
    """Whether a shard written by an earlier, unfinished run holds ``docs`` (their ids, in
    order): a first ``Index.add`` stopped and re-run with other documents re-encodes it (the
    CLI's corpus hash refuses another corpus before this)."""
    if marker["num_docs"] != len(docs):
        return False
    return ts.read_json(directory / marker["files"]["doc_ids"]["path"]) == [d.doc_id for d in docs]


def _build_if_stale(index_dir: str | Path) -> None:
    """Builds the search index of the store as committed now (the caller holds the writer
    lock): an update may have committed since the caller last looked, and a store opened
    before it would publish a manifest without it."""
    store = ts.TokenStore(index_dir)
    try:
        centroid_index.CentroidIndex.load(store)
    except errors.IndexIntegrityError:
        centroid_index.CentroidIndex.build(store)
