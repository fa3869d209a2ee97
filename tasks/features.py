"""Task features, the token-framing preprocessor and the ALIGNER feature converter.

Task examples come from a source as text: ``query`` (scalar string), ``positive`` (scalar
string) and ``negatives`` (``[N]`` strings, a fixed ``N = num_negatives ≥ 0`` per task). The
preprocessor ``tokenize_query_and_documents`` turns them into the task's two output features

    query   int32 [≤ Lq]              [CLS] query wordpieces … [SEP]
    doc     int32 ragged [1+N, ≤ Ld]  row 0: the positive; rows 1..N: the negatives (in order)

(plus ``*_pretokenized`` copies of the texts). Each sequence is truncated to its feature length
*minus the special tokens* before they are added, so a truncated sequence still ends with [SEP]
and equals ``aligner_jax.encoding.tokenization.Tokenizer.encode_batch(texts, max_length)``. With a T5
SentencePiece vocabulary the frame is ``… EOS`` instead (``tasks.vocab.special_token_ids``).

Task feature lengths are ``{"query": Lq, "doc": Ld}`` (defaults 64 and 256, paper §4.1), the
same dict for ``Task.get_dataset(sequence_length=…)`` and for the feature converter, as in t5x.

``AlignerFeatureConverter`` pads them into the model features

    query_tokens  int32 [Lq]
    doc_tokens    int32 [1+N, Ld]   (positive first)
    doc_keys      int32 [1+N]       content keys of the documents (``tasks.sources``)
    relevant_keys int32 [R]         keys of every document relevant to the query (0-padded)

(the two key features when the task gives them: every registered task does).

Padding uses id 0 (seqio's PAD_ID; [PAD] in BERT, <pad> in T5), which no real token has, so the
model derives its masks as ``query_mask = query_tokens != 0`` and ``doc_mask = doc_tokens != 0``;
no mask feature is emitted. ``batches_as_numpy`` batches such a dataset into fixed-size numpy
batches (``[B, Lq]``, ``[B, 1+N, Ld]``), dropping a last partial batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from aligner_jax.common.errors import ConfigError
from aligner_jax.tasks import vocab as vocab_lib

DEFAULT_QUERY_LENGTH = 64
DEFAULT_DOC_LENGTH = 256
DEFAULT_TASK_FEATURE_LENGTHS = {"query": DEFAULT_QUERY_LENGTH, "doc": DEFAULT_DOC_LENGTH}
PAD_ID = seqio.vocabularies.PAD_ID
# Passed through to the model unchanged: what tells false negatives apart (``tasks.sources``).
KEY_FEATURES = ("doc_keys", "relevant_keys")
_KEYS_VOCABULARY = seqio.PassThroughVocabulary(size=2**31)  # content keys are not token ids
# Examples per tokenizer call in the task preprocessor.
TOKENIZE_BATCH_SIZE = 64


def output_features(
    vocabulary: seqio.Vocabulary | None = None,
) -> dict[str, seqio.Feature]:
    """The task output features: ``query`` (rank 1) and ``doc`` (rank 2, positive first), and
    the content keys ``doc_keys`` / ``relevant_keys`` (rank 1, not required).

    ``add_eos`` is False: the framing tokens (``[CLS]``/``[SEP]`` or EOS) are added by
    ``tokenize_query_and_documents``, which seqio's EOS machinery cannot express (no BOS).
    """
    vocabulary = vocabulary if vocabulary is not None else vocab_lib.ConfiguredVocabulary()
    keys = {  # declared so that a mixture keeps them (it drops undeclared features)
        name: seqio.Feature(_KEYS_VOCABULARY, add_eos=False, rank=1, required=False)
        for name in KEY_FEATURES
    }
    return {
        "query": seqio.Feature(vocabulary, add_eos=False, rank=1),
        "doc": seqio.Feature(vocabulary, add_eos=False, rank=2),
        **keys,
    }


def _token_budget(
    name: str, max_length: int | None, prefix: Sequence[int], suffix: Sequence[int]
) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, int | np.integer):
        raise ValueError(f"sequence_length[{name!r}]={max_length!r}: expected an integer.")
    budget = int(max_length) - len(prefix) - len(suffix)
    if budget < 0:
        raise ConfigError(
            f"sequence_length[{name!r}]={max_length} leaves no room for the "
            f"{len(prefix) + len(suffix)} framing tokens; use a length ≥ "
            f"{len(prefix) + len(suffix)} (with the run gins: --gin.{name.upper()}_LENGTH)."
        )
    return budget


def check_feature_lengths(
    vocabulary: seqio.Vocabulary,
    sequence_length: Mapping[str, int | None],
    num_negatives: int | None,
) -> None:
    """Refuses feature lengths with no room for the framing tokens, or a doc length below the
    documents per example (seqio trims the rank-2 'doc' feature's first axis to it)."""
    frame = vocab_lib.special_token_ids(vocabulary)
    for name in ("query", "doc"):
        _token_budget(name, sequence_length.get(name), *frame)
    doc_length = sequence_length.get("doc")
    if doc_length is not None and num_negatives is not None and 1 + num_negatives > doc_length:
        raise ConfigError(
            f"sequence_length['doc']={doc_length} is smaller than the {1 + num_negatives} "
            "documents per example (1 positive + num_negatives): seqio trims the first axis of "
            "the rank-2 'doc' feature to that length, which would drop negatives. Lower the "
            "source's num_negatives binding or raise the doc length (--gin.DOC_LENGTH)."
        )


def frame_tokens(
    ids: Sequence[int] | np.ndarray,
    max_length: int | None,
    prefix: Sequence[int],
    suffix: Sequence[int],
) -> np.ndarray:
    """numpy reference of the framing: ``prefix + ids[:max_length - |prefix| - |suffix|] + suffix``.

    With ``max_length=None`` nothing is truncated.
    """
    budget = _token_budget("max_length", max_length, prefix, suffix)
    ids = np.asarray(ids, dtype=np.int32)
    if budget is not None:
        ids = ids[:budget]
    return np.concatenate(
        [np.asarray(prefix, dtype=np.int32), ids, np.asarray(suffix, dtype=np.int32)]
    )


def frame_tokens_tf(
    ids: tf.Tensor | tf.RaggedTensor,
    max_length: int | None,
    prefix: Sequence[int],
    suffix: Sequence[int],
) -> tf.Tensor | tf.RaggedTensor:
    """``frame_tokens`` on the last axis of a 1-D tensor or a 2-D ``RaggedTensor`` ``[n, None]``."""
    budget = _token_budget("max_length", max_length, prefix, suffix)
    prefix = tf.constant(list(prefix), dtype=tf.int32, shape=[len(prefix)])
    suffix = tf.constant(list(suffix), dtype=tf.int32, shape=[len(suffix)])
    if isinstance(ids, tf.RaggedTensor):
        if ids.shape.rank != 2:
            raise ValueError(
                f"frame_tokens_tf: expected a [n, None] RaggedTensor, got {ids.shape}."
            )
        ids = tf.cast(ids, tf.int32)
        if budget is not None:
            ids = ids[:, :budget]
        rows = ids.nrows()
        pre = tf.RaggedTensor.from_tensor(tf.tile(prefix[None, :], [rows, 1]))
        suf = tf.RaggedTensor.from_tensor(tf.tile(suffix[None, :], [rows, 1]))
        return tf.concat([pre, ids, suf], axis=1)
    ids = tf.cast(tf.convert_to_tensor(ids), tf.int32)
    if ids.shape.rank != 1:
        raise ValueError(f"frame_tokens_tf: expected 1-D ids, got shape {ids.shape}.")
    if budget is not None:
        ids = ids[:budget]
    return tf.concat([prefix, ids, suffix], axis=0)


def tokenize_query_and_documents(
    dataset: tf.data.Dataset,
    output_features: Mapping[str, seqio.Feature],
    sequence_length: Mapping[str, int | None] | None = None,
    batch_size: int = TOKENIZE_BATCH_SIZE,
) -> tf.data.Dataset:
    """seqio preprocessor: text ``query``/``positive``/``negatives`` → framed ``query``/``doc``.

    ``doc`` stacks the positive and the negatives (positive first) as a ragged ``[1+N, None]``
    int32 tensor. Sequences are truncated to ``sequence_length["query"]`` / ``["doc"]`` (when
    given) with the framing tokens kept. Copies of the texts are kept as ``query_pretokenized``,
    ``positive_pretokenized`` and ``negatives_pretokenized``.

    Examples are tokenized ``batch_size`` at a time (one tokenizer call for the queries and one
    for the documents of the batch, so the Rust tokenizer runs them in parallel) and unbatched
    again; the order of examples is unchanged.
    """
    spec = dataset.element_spec
    for key, rank in (("query", 0), ("positive", 0), ("negatives", 1)):
        if key not in spec:
            raise ValueError(
                f"tokenize_query_and_documents: the source examples have no {key!r} feature "
                f"(features: {sorted(spec)}); a retrieval source must give 'query', 'positive' "
                "and 'negatives' texts."
            )
        if spec[key].dtype != tf.string or spec[key].shape.rank != rank:
            raise ValueError(
                f"tokenize_query_and_documents: feature {key!r} must be a rank-{rank} string "
                f"tensor, got {spec[key]}."
            )
    num_negatives = spec["negatives"].shape[0]
    sequence_length = dict(sequence_length or {})
    query_length = sequence_length.get("query")
    doc_length = sequence_length.get("doc")
    query_vocab = output_features["query"].vocabulary
    doc_vocab = output_features["doc"].vocabulary
    check_feature_lengths(doc_vocab, sequence_length, num_negatives)
    query_frame = vocab_lib.special_token_ids(query_vocab)
    doc_frame = vocab_lib.special_token_ids(doc_vocab)

    def as_rows(ids) -> tf.RaggedTensor:
        """Tokenizer output for a [b] (or [b, D]) string tensor as rows [b (or b·D), None]."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(ids)
        if ids.shape.rank == 3:
            ids = ids.merge_dims(0, 1)
        return ids

    def tokenize(batch):
        texts = ("query", "positive", "negatives")
        out = {k: v for k, v in batch.items() if k not in texts}
        for key in texts:
            out[f"{key}_pretokenized"] = batch[key]
        out["query"] = frame_tokens_tf(
            as_rows(query_vocab.encode_tf(batch["query"])), query_length, *query_frame
        )
        documents = tf.concat([batch["positive"][:, None], batch["negatives"]], axis=1)
        rows = frame_tokens_tf(as_rows(doc_vocab.encode_tf(documents)), doc_length, *doc_frame)
        docs_per_example = 1 + num_negatives if num_negatives is not None else None
        width = docs_per_example or tf.shape(documents, out_type=tf.int64)[1]
        out["doc"] = tf.RaggedTensor.from_uniform_row_length(rows, width, validate=False)
        return out

    return (
        dataset.batch(batch_size)
        .map(tokenize, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .unbatch()
    )


class AlignerFeatureConverter(seqio.FeatureConverter):
    """Task features ``query``/``doc`` → model features ``query_tokens``/``doc_tokens`` (and the
    ``KEY_FEATURES`` unchanged, when the task gives them). The key features join this
    converter's ``MODEL_FEATURES`` and ``get_model_feature_lengths`` when it converts a dataset
    (their lengths come from it): ask for the model feature lengths after converting.

    ``query_tokens`` int32 ``[Lq]`` and ``doc_tokens`` int32 ``[1+N, Ld]`` (positive first),
    zero-padded to the task feature lengths ``{"query": Lq, "doc": Ld}``. Masks are
    ``tokens != 0`` (see the module docstring). seqio's checks apply: the task features must be
    no longer than the lengths, the outputs exactly that long. Packing is not supported (a
    retrieval example is one query and its documents, not a token stream).
    """

    TASK_FEATURES = {
        "query": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=1),
        "doc": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=2, sequence_dim=1),
    }
    MODEL_FEATURES = {
        "query_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=1),
        "doc_tokens": seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=2, sequence_dim=1),
    }
    PACKING_FEATURE_DTYPES = {}

    def __init__(self, pack: bool = False, **kwargs):
        if pack:
            raise ValueError(
                "AlignerFeatureConverter does not pack: each example is one query with its "
                "1+N documents. Construct it with pack=False (the default)."
            )
        super().__init__(pack=False, **kwargs)

    def _convert_features(
        self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]
    ) -> tf.data.Dataset:
        query_length = int(task_feature_lengths["query"])
        doc_length = int(task_feature_lengths["doc"])
        num_docs = ds.element_spec["doc"].shape[0]
        # seqio validates the output against MODEL_FEATURES and get_model_feature_lengths after
        # this conversion: the key features join them here when the dataset has them.
        keys = [k for k in KEY_FEATURES if k in ds.element_spec]
        self.MODEL_FEATURES = dict(type(self).MODEL_FEATURES)
        self._key_lengths = {}
        for k in keys:
            self.MODEL_FEATURES[k] = seqio.FeatureConverter.FeatureSpec(dtype=tf.int32, rank=1)
            self._key_lengths[k] = ds.element_spec[k].shape[0]

        def convert(example):
            query = tf.cast(example["query"], tf.int32)
            if isinstance(query, tf.RaggedTensor):
                query = query.to_tensor(default_value=PAD_ID)
            query = tf.pad(query, [[0, query_length - tf.shape(query)[0]]], constant_values=PAD_ID)
            query = tf.ensure_shape(query, [query_length])
            doc = tf.cast(example["doc"], tf.int32)
            if isinstance(doc, tf.RaggedTensor):
                doc = doc.to_tensor(default_value=PAD_ID)
            doc = tf.pad(doc, [[0, 0], [0, doc_length - tf.shape(doc)[1]]], constant_values=PAD_ID)
            doc = tf.ensure_shape(doc, [num_docs, doc_length])
            out = {"query_tokens": query, "doc_tokens": doc}
            out.update({k: example[k] for k in keys})
            return out

        return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
        return {
            "query_tokens": task_feature_lengths["query"],
            "doc_tokens": task_feature_lengths["doc"],
            **getattr(self, "_key_lengths", {}),
        }


def batches_as_numpy(ds: tf.data.Dataset, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Yields ``{name: numpy array}`` batches of exactly ``batch_size`` examples (remainder dropped).

    ``ds`` holds unbatched fixed-shape examples, e.g. the output of ``AlignerFeatureConverter``:
    batches are then ``query_tokens [B, Lq]`` and ``doc_tokens [B, 1+N, Ld]`` int32. The
    arguments are checked when called (not at the first ``next``).
    """
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int | np.integer)
        or batch_size < 1
    ):
        raise ValueError(f"batches_as_numpy: batch_size={batch_size!r}; expected an integer ≥ 1.")
    for name, spec in ds.element_spec.items():
        if isinstance(spec, tf.RaggedTensorSpec) or not spec.shape.is_fully_defined():
            raise ValueError(
                f"batches_as_numpy: feature {name!r} has shape {spec.shape}; batches need fixed "
                "shapes. Convert the task dataset with AlignerFeatureConverter first."
            )
    return ds.batch(int(batch_size), drop_remainder=True).as_numpy_iterator()
