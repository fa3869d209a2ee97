"""A Python-first index (``aligner_jax.Index``): create, add documents, delete them, search — no JSONL file needed.

::

    import aligner_jax

    index = aligner_jax.Index.create("outputs/my_index")  # bundled all-MiniLM-L6-v2, zero-shot
    index.add([{"id": "d1", "title": "Bees", "text": "Bees make honey.", "metadata": {"year": 2019}}])
    hits = index.searcher().search("honey", k=10, filter={"year": {"gte": 2015}})

The index directory is the one ``aligner-index`` writes (token store, manifest, checksums,
``encoder.json``, ``documents.sqlite``, ``search_index/``), through the same functions: the
first ``add`` runs the indexing job's ``indexer.build_token_store`` and builds the search index
(``updates.rebuild_search_index``, as ``aligner-index --index_dir=DIR --search_index``);
later ones are ``aligner-index --add`` (``updates.add_documents``), ``delete`` is
``aligner-index --delete`` (``updates.delete_documents``), ``vacuum`` is ``aligner-index
--vacuum`` (``updates.vacuum``), each under the directory's writer
lock. ``aligner-index --index_dir=DIR --add=more.jsonl`` and ``Searcher.load(DIR)`` work on an
index made here, and ``Index.open`` on one made by ``aligner-index``.

Documents: an iterable of dicts (or ``beir.Document``-like objects), a pandas ``DataFrame`` or a
Hugging Face ``datasets.Dataset``, each record with ``id`` (or BEIR's ``_id``), ``text``,
optional ``title`` and ``metadata`` (a dict); other keys join the metadata, as in a BEIR
corpus (``documents.metadata_of``).
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from aligner_jax.common import doc_ids, fileio
from aligner_jax.common.errors import ConfigError, IndexIntegrityError
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncoderBundle, EncodingConfig
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import indexer, updates
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import searcher as search_lib

#: Recorded as the corpus of an index made from Python (``index_config.json``).
PYTHON_SOURCE = {"source": "aligner_jax.Index"}
ZERO_SHOT = "minilm"


def zero_shot_bundle(backbone_weights: str = ZERO_SHOT) -> EncoderBundle:
    """The zero-shot encoder of ``models/minilm_identity.gin`` (the backbone's own token vectors,
    L2-normalised, no salience) without gin: the bundled all-MiniLM-L6-v2, or an ``hf:DIR``
    BERT/T5 folder."""
    config = aligner_lib.AlignerConfig(
        backbone=loading.minilm_backbone(), projection="identity", salience="none"
    )
    return loading.load_encoder(config=config, backbone_weights=backbone_weights)


def _bundle(model) -> EncoderBundle:
    if model is None or model == ZERO_SHOT:
        return zero_shot_bundle()
    if isinstance(model, Encoder):
        return model.bundle
    if isinstance(model, EncoderBundle):
        return model
    if isinstance(model, str) and model.startswith("hf:"):
        return zero_shot_bundle(model)
    raise ConfigError(
        f"Index.create: model={model!r:.80}: give None or 'minilm' (the bundled all-MiniLM-L6-v2, "
        "zero-shot), 'hf:/path/to/model_folder', or an aligner_jax.Encoder (e.g. of a trained "
        "checkpoint: gin.parse_config_file('gin/models/minilm.gin'), then "
        "aligner_jax.Encoder(aligner_jax.load_encoder(checkpoint=DIR)))"
    )


def _records(docs) -> Iterable:
    """Rows of a pandas frame, a ``datasets.Dataset`` (iterates as dicts) or an iterable."""
    if isinstance(docs, (str, bytes, Mapping)):
        raise ConfigError(
            "Index.add: expected several documents (a list of dicts, a pandas DataFrame or a "
            f"datasets.Dataset), got {type(docs).__name__}; wrap one document in a list"
        )
    if hasattr(docs, "to_dict") and hasattr(docs, "columns"):  # pandas.DataFrame
        return docs.to_dict("records")
    if not isinstance(docs, Iterable):
        raise ConfigError(
            f"Index.add: expected an iterable of documents, got {type(docs).__name__}"
        )
    return docs


def _missing(value) -> bool:
    """None, or pandas' NaN for an absent cell."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _clean(value, where: str, key: str = "metadata"):
    """JSON-ready metadata: numpy scalars as Python numbers and arrays as lists, dates and times
    as ISO 8601 strings, NaN cells as null; anything else (an object, an infinity, a non-string
    key) is a ``ConfigError`` naming the field, never stored as its ``str``."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy (and pandas) scalars and arrays
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{where}: {key} has the key {k!r}; metadata keys are strings")
        return {k: _clean(v, where, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if _missing(value):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} is {value}, which JSON cannot hold; give a number")
    if not isinstance(value, (str, int, float, bool)):
        raise ConfigError(
            f"{where}: {key} is a {type(value).__name__} ({value!r:.40}); metadata values are "
            "strings, numbers, booleans, null, lists or dicts (convert it, e.g. str(value))"
        )
    return value


def to_documents(docs) -> list[documents_lib.IndexDocument]:
    """Validated documents (see the module docstring); a bad record is a one-line
    ``ConfigError`` naming its position and field."""
    out, seen = [], {}
    for i, record in enumerate(_records(docs)):
        where = f"Index.add: document {i}"
        if not isinstance(record, Mapping):
            if all(hasattr(record, a) for a in ("doc_id", "title", "text")):  # beir.Document
                record = {
                    "id": record.doc_id,
                    "title": record.title,
                    "text": record.text,
                    "metadata": getattr(record, "metadata", None) or {},
                }
            else:
                raise ConfigError(
                    f"{where}: expected a dict with 'id' and 'text', got {type(record).__name__}"
                )
        record = dict(record)
        if "id" in record and "_id" in record:  # one would be dropped: which is the id?
            raise ConfigError(f"{where}: has both 'id' and '_id'; give one of them")
        key = "id" if "id" in record else "_id"
        doc_id = record.pop(key, None)
        try:
            doc_id = doc_ids.clean(doc_id)
        except ValueError as reason:
            raise ConfigError(f"{where}: 'id' {reason}") from None
        where = f"Index.add: document {i} (id {doc_id!r})"
        if doc_id in seen:
            raise ConfigError(
                f"{where}: the id repeats document {seen[doc_id]}; ids must be unique"
            )
        seen[doc_id] = i
        text = record.pop("text", None)
        if not isinstance(text, str):
            raise ConfigError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        title = record.pop("title", None)
        title = "" if _missing(title) else title
        if not isinstance(title, str):
            raise ConfigError(f"{where}: 'title' must be a string, got {type(title).__name__}")
        if not (title + text).strip():
            raise ConfigError(f"{where}: title and text are both empty: nothing to index")
        meta = record.get("metadata")
        if not _missing(meta) and not isinstance(meta, Mapping):
            raise ConfigError(f"{where}: 'metadata' must be a dict, got {type(meta).__name__}")
        if _missing(meta):
            record.pop("metadata", None)
        metadata = _clean(documents_lib.metadata_of(record), where)
        out.append(documents_lib.IndexDocument(doc_id, title, text, metadata))
    if not out:
        raise ConfigError("Index.add: no documents given")
    return out


class Index:
    """An index directory opened for writing from Python (see the module docstring)."""

    def __init__(
        self, directory: str | os.PathLike, encoder: Encoder, config: indexer.IndexingConfig
    ):
        self.directory = Path(directory)
        self.encoder = encoder
        self.config = config

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike,
        model=None,
        config: indexer.IndexingConfig | None = None,
    ) -> Index:
        """A new, empty index at ``directory`` (created; it must not hold an index already) with
        ``model``: None / ``'minilm'`` (the bundled all-MiniLM-L6-v2, zero-shot, as
        ``aligner-index`` without ``--gin_file``), ``'hf:DIR'``, or an :class:`Encoder`.
        ``config``: :class:`IndexingConfig` (shard size, ``store_text``, ...)."""
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(
                f"Index.create: directory must be a path, got {type(directory).__name__}"
            )
        directory = Path(directory)
        if config is not None and not isinstance(config, indexer.IndexingConfig):
            raise ConfigError(
                f"Index.create: config must be an IndexingConfig, got {type(config).__name__}"
            )
        fileio.check_output_dir(directory, "Index.create: directory")
        if (directory / indexer.CONFIG_FILE).exists() or (directory / ts.MANIFEST).exists():
            raise ConfigError(
                f"Index.create: {directory} already holds an index; open it with "
                "aligner_jax.Index.open, or choose a new directory"
            )
        bundle = _bundle(model)
        config = config or indexer.IndexingConfig()
        directory.mkdir(parents=True, exist_ok=True)
        with indexer.writer_lock(directory):
            indexer.write_encoder_spec(directory, bundle)
            indexer.check_or_write_config(directory, cls._settings(bundle, config))
        return cls(directory, Encoder(bundle, EncodingConfig()), config)

    @classmethod
    def open(cls, directory: str | os.PathLike, encoder: Encoder | None = None) -> Index:
        """An index made by :meth:`create` or ``aligner-index`` (its model from
        ``encoder.json`` unless ``encoder`` is given)."""
        directory = Path(directory)
        config_path = directory / indexer.CONFIG_FILE
        if not config_path.exists():
            raise IndexIntegrityError(
                f"{config_path} does not exist: {directory} is not an index (make one with "
                "aligner_jax.Index.create or aligner-index)"
            )
        settings = ts.read_json(config_path, "delete the index directory and index again")
        if encoder is None:
            spec = ts.read_json(directory / indexer.ENCODER_FILE, "rebuild this index")
            encoder = Encoder(loading.encoder_from_spec(spec), EncodingConfig())
        ts.check_model_matches(settings, encoder.bundle.info(), directory)
        return cls(directory, encoder, indexer.IndexingConfig.recorded(settings["indexing"]))

    @staticmethod
    def _settings(bundle: EncoderBundle, config: indexer.IndexingConfig) -> dict:
        return {"model": bundle.info(), "indexing": config.settings(), "corpus": PYTHON_SOURCE}

    @property
    def num_docs(self) -> int:
        """Documents stored, deleted ones included (0 before the first ``add``)."""
        if not (self.directory / ts.MANIFEST).exists():
            return 0
        return int(ts.read_manifest(self.directory)["counts"]["num_docs"])

    def add(self, docs) -> dict:
        """Encodes and stores ``docs`` (see the module docstring); returns a summary. Ids must
        be new to the index."""
        docs = to_documents(docs)
        start = time.perf_counter()
        if not (self.directory / ts.MANIFEST).exists():
            settings = ts.read_json(self.directory / indexer.CONFIG_FILE)
            indexer.build_token_store(
                docs, self.encoder, self.directory, self.config, corpus_info=settings["corpus"]
            )
            with updates.writing(self.directory):  # aligner-index --search_index
                updates.rebuild_search_index(str(self.directory))
            return self._first_add_summary(start)
        with updates.writing(self.directory):
            if self._unfinished():
                updates.rebuild_search_index(str(self.directory))
                store = ts.TokenStore(self.directory)
                if [d.doc_id for d in docs] == store.doc_ids and not store.deleted.any():
                    return self._first_add_summary(start)  # that first add again: complete
            return updates.add_documents(str(self.directory), docs, self.encoder)

    def _first_add_summary(self, start: float) -> dict:
        """The first add's summary, with the counts a later add reports (documents cut at the
        encoder's budget, which the first add left unsaid)."""
        manifest = ts.read_manifest(self.directory)
        stats = manifest.get("stats", {})
        return {
            "added_docs": int(manifest["counts"]["num_docs"]),
            "num_tokens": int(manifest["counts"]["num_tokens"]),
            "truncated_docs": int(stats.get("truncated_docs", 0)),
            "empty_docs": int(stats.get("empty_docs", 0)),
            "doc_maxlen": self.encoder.maxlen("doc"),
            "seconds": round(time.perf_counter() - start, 3),
        }

    def _unfinished(self) -> bool:
        """Whether the first ``add`` of this index (made from Python, where the first add builds
        the search index) stopped after committing the store, before its search index."""
        settings = ts.read_json(self.directory / indexer.CONFIG_FILE)
        return settings["corpus"] == PYTHON_SOURCE and not ci.CentroidIndex.exists(self.directory)

    def delete(self, ids: Iterable[str]) -> dict:
        """Deletes documents by id (``aligner-index --delete``: never returned again)."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ConfigError(f"Index.delete: expected a list of document ids, got {ids!r:.60}")
        ids = list(ids)
        if not ids:
            raise ConfigError("Index.delete: expected a non-empty list of document ids, got []")
        try:
            ids = [doc_ids.clean(d) for d in ids]
        except ValueError as reason:
            raise ConfigError(f"Index.delete: an id {reason}") from None
        with updates.writing(self.directory):
            return updates.delete_documents(str(self.directory), ids, where="Index.delete")

    def vacuum(self) -> dict:
        """Writes the store again without its deleted documents (``aligner-index --vacuum``:
        their bytes come back, the search index is built again); returns the summary."""
        if not (self.directory / ts.MANIFEST).exists():
            raise ConfigError(f"Index.vacuum: {self.directory} holds no documents yet")
        with updates.writing(self.directory):
            return updates.vacuum(str(self.directory))

    def searcher(self, mode: str = "fast", **options):
        """A :class:`Searcher` over the index as it is now (``Searcher.load`` options)."""
        if not (self.directory / ts.MANIFEST).exists():
            raise ConfigError(f"Index.searcher: {self.directory} holds no documents yet; add some")
        encoder = search_lib.whole_query_encoder(self.encoder.bundle)
        return search_lib.Searcher.load(str(self.directory), mode=mode, encoder=encoder, **options)
