"""Vocabularies of the retrieval tasks: the backbone's WordPiece tokenizer as a seqio.Vocabulary.

``WordPieceVocabulary`` wraps the same Hugging Face ``tokenizer.json`` that
``aligner_jax.encoding.tokenization.Tokenizer`` reads, so the trainer's tf.data pipeline and the indexing
job tokenise identically. Following seqio, ``encode``/``encode_tf`` return the WordPiece ids of a
text *without* special tokens; the task preprocessor ``tasks.features.tokenize_query_and_documents``
truncates them to the feature length minus two and adds ``[CLS] … [SEP]``, which reproduces
``Tokenizer.encode_batch(texts, max_length)`` exactly (truncated sequences still end with [SEP]).

Which vocabulary the registered tasks use is a gin choice (``task_vocabulary``): the bundled
MiniLM WordPiece by default, or a T5 SentencePiece model::

    --gin.task_vocabulary.kind="'sentencepiece'"
    --gin.task_vocabulary.sentencepiece_model_file="'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'"

The registered tasks hold a ``ConfiguredVocabulary`` that resolves ``task_vocabulary()`` each
time it is used, so bindings parsed after ``import tasks`` (the usual t5x order) take effect.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import gin
import numpy as np
import seqio
import tensorflow as tf
import tokenizers

from aligner_jax.common.errors import ConfigError
from aligner_jax.encoding import tokenization
from aligner_jax.weights import minilm

VOCABULARY_KINDS = ("wordpiece", "sentencepiece")


def default_tokenizer_file() -> str:
    """The tokenizer.json of the bundled all-MiniLM-L6-v2 backbone."""
    return os.fspath(minilm.minilm_model_dir() / "tokenizer.json")


class WordPieceVocabulary(seqio.Vocabulary):
    """A BERT WordPiece ``tokenizer.json`` (Hugging Face ``tokenizers``) as a seqio vocabulary.

    Ids: ``pad_id`` = [PAD] (must be 0, seqio's padding id), ``eos_id`` = [SEP], ``unk_id`` =
    [UNK], ``bos_id`` = ``cls_id`` = [CLS]. ``encode``/``encode_tf`` never add special tokens and
    never truncate; ``decode``/``decode_tf`` drop special tokens (and, as seqio does, everything
    after the first [SEP]).

    ``encode_tf`` accepts a string tensor of any static rank: a scalar gives a 1-D int32 tensor,
    a ``[n]`` vector gives a ``tf.RaggedTensor`` ``[n, None]`` (and so on for higher ranks). The
    tf path runs the same Rust tokenizer through ``tf.numpy_function``.
    """

    def __init__(self, tokenizer_file: str | os.PathLike | None = None):
        super().__init__(extra_ids=0)
        path = os.fspath(tokenizer_file) if tokenizer_file is not None else None
        self._tokenizer_file = os.path.abspath(path or default_tokenizer_file())
        # Validates the file and the BERT special tokens, with messages naming the file.
        reference = tokenization.Tokenizer(self._tokenizer_file)
        if reference.pad_id != seqio.vocabularies.PAD_ID:
            raise ConfigError(
                f"{self._tokenizer_file}: [PAD] has id {reference.pad_id}, but seqio pads with id "
                f"{seqio.vocabularies.PAD_ID} and the model masks tokens equal to it; use a "
                "tokenizer whose [PAD] id is 0."
            )
        self._cls_id = reference.cls_id
        self._sep_id = reference.sep_id
        self._unk_id = reference.token_to_id("[UNK]")
        self._size = reference.vocab_size
        hf = tokenizers.Tokenizer.from_file(self._tokenizer_file)
        hf.no_padding()
        hf.no_truncation()
        self._hf = hf

    @property
    def tokenizer_file(self) -> str:
        return self._tokenizer_file

    @property
    def cls_id(self) -> int:
        return self._cls_id

    @property
    def sep_id(self) -> int:
        return self._sep_id

    @property
    def bos_id(self) -> int:
        return self._cls_id

    @property
    def eos_id(self) -> int:
        return self._sep_id

    @property
    def unk_id(self) -> int:
        return self._unk_id

    @property
    def _base_vocab_size(self) -> int:
        return self._size

    # ----------------------------------------------------------------------------------------
    # Python.

    def _encode(self, s: str) -> list[int]:
        return list(self._hf.encode(s, add_special_tokens=False).ids)

    def _decode(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """WordPiece ids (int32, no special tokens) of each text, via the parallel batch path."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a sequence of strings, got a single str.")
        encodings = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    # ----------------------------------------------------------------------------------------
    # TensorFlow.

    def _encode_flat(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in flat.tolist()]
        pieces = self.encode_batch(texts)
        lengths = np.asarray([p.shape[0] for p in pieces], dtype=np.int64)
        values = np.concatenate(pieces) if pieces else np.zeros((0,), dtype=np.int32)
        return values.astype(np.int32, copy=False), lengths

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
        s = tf.convert_to_tensor(s, dtype=tf.string)
        rank = s.shape.rank
        if rank is None:
            raise ValueError(
                "WordPieceVocabulary.encode_tf needs a string tensor of known rank; set its shape "
                "(e.g. with tf.ensure_shape) before tokenizing."
            )
        flat = tf.reshape(s, [-1])
        values, lengths = tf.numpy_function(
            self._encode_flat, [flat], [tf.int32, tf.int64], stateful=False, name="wordpiece"
        )
        values.set_shape([None])
        lengths.set_shape(flat.shape)
        if rank == 0:
            return values
        ragged = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
        # Rebuild the outer dimensions (rank ≥ 2 inputs): innermost first.
        outer = tf.shape(s, out_type=tf.int64)
        for axis in range(rank - 1, 0, -1):
            width = s.shape[axis] if s.shape[axis] is not None else outer[axis]
            ragged = tf.RaggedTensor.from_uniform_row_length(ragged, width, validate=False)
        return ragged

    def _decode_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = [self._decode(row).encode("utf-8") for row in ids.tolist()]
        return np.asarray(rows, dtype=object).reshape((len(rows),))

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.to_tensor(default_value=self.pad_id)
        rank = ids.shape.rank
        if rank is None or rank == 0:
            raise ValueError(
                "WordPieceVocabulary.decode_tf needs ids of known rank ≥ 1 ([..., length])."
            )
        shape = tf.shape(ids)
        rows = tf.reshape(tf.cast(ids, tf.int32), [-1, shape[-1]])
        texts = tf.numpy_function(self._decode_rows, [rows], tf.string, stateful=False)
        texts.set_shape([None])
        return tf.reshape(texts, shape[:-1])

    def __eq__(self, other) -> bool:
        if not isinstance(other, WordPieceVocabulary):
            return False
        return self._tokenizer_file == other._tokenizer_file

    def __hash__(self) -> int:
        return hash(("WordPieceVocabulary", self._tokenizer_file))

    def __repr__(self) -> str:
        return f"WordPieceVocabulary(tokenizer_file={self._tokenizer_file!r})"


@functools.lru_cache(maxsize=16)
def _cached_vocabulary(
    kind: str, tokenizer_file: str | None, sentencepiece_model_file: str | None, extra_ids: int
) -> seqio.Vocabulary:
    if kind == "wordpiece":
        return WordPieceVocabulary(tokenizer_file)
    return seqio.SentencePieceVocabulary(sentencepiece_model_file, extra_ids=extra_ids)


@gin.configurable
def task_vocabulary(
    kind: str = "wordpiece",
    tokenizer_file: str | None = None,
    sentencepiece_model_file: str | None = None,
    extra_ids: int = 0,
) -> seqio.Vocabulary:
    """The vocabulary of the registered retrieval tasks (gin-configurable; cached per arguments).

    Args:
      kind: "wordpiece" (a BERT ``tokenizer.json``; sequences are ``[CLS] … [SEP]``) or
        "sentencepiece" (a T5 SentencePiece model; sequences end with EOS, no prefix).
      tokenizer_file: the ``tokenizer.json`` for "wordpiece"; default: the bundled MiniLM one.
      sentencepiece_model_file: the ``.model`` file for "sentencepiece" (required there).
      extra_ids: sentinel ids appended to a SentencePiece vocabulary (T5 uses 100).
    """
    if kind not in VOCABULARY_KINDS:
        raise ConfigError(
            f"task_vocabulary.kind={kind!r}: expected one of {VOCABULARY_KINDS}; set e.g. "
            "--gin.task_vocabulary.kind=\"'wordpiece'\"."
        )
    if kind == "sentencepiece":
        if not sentencepiece_model_file:
            raise ConfigError(
                "task_vocabulary.kind='sentencepiece' needs a model file: set the gin binding "
                "task_vocabulary.sentencepiece_model_file, e.g. "
                "--gin.task_vocabulary.sentencepiece_model_file="
                "\"'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'\"."
            )
        if tokenizer_file:
            raise ConfigError(
                "task_vocabulary.tokenizer_file is for kind='wordpiece'; with "
                "kind='sentencepiece' set task_vocabulary.sentencepiece_model_file instead."
            )
    elif sentencepiece_model_file:
        raise ConfigError(
            "task_vocabulary.sentencepiece_model_file is set but task_vocabulary.kind is "
            "'wordpiece'; also set --gin.task_vocabulary.kind=\"'sentencepiece'\"."
        )
    if isinstance(extra_ids, bool) or not isinstance(extra_ids, int) or extra_ids < 0:
        raise ConfigError(f"task_vocabulary.extra_ids={extra_ids!r}: expected an integer ≥ 0.")
    tokenizer_file = os.path.abspath(os.fspath(tokenizer_file)) if tokenizer_file else None
    return _cached_vocabulary(kind, tokenizer_file, sentencepiece_model_file, extra_ids)


class ConfiguredVocabulary(seqio.Vocabulary):
    """The vocabulary chosen with gin (``task_vocabulary``), resolved at every use.

    Registered tasks are created at ``import tasks``, before gin bindings are parsed; holding this
    proxy instead of a concrete vocabulary lets ``--gin.task_vocabulary.*`` choose the tokenizer.
    Every method and property forwards to ``resolve()``.
    """

    def __init__(self):
        super().__init__(extra_ids=0)

    def resolve(self) -> seqio.Vocabulary:
        return task_vocabulary()

    @property
    def bos_id(self):
        return self.resolve().bos_id

    @property
    def eos_id(self):
        return self.resolve().eos_id

    @property
    def unk_id(self):
        return self.resolve().unk_id

    @property
    def pad_id(self) -> int:
        return self.resolve().pad_id

    @property
    def extra_ids(self) -> int:
        return self.resolve().extra_ids

    @property
    def vocab_size(self) -> int:
        return self.resolve().vocab_size

    @property
    def _base_vocab_size(self) -> int:
        return self.resolve()._base_vocab_size

    def _encode(self, s):
        return self.resolve()._encode(s)

    def _decode(self, ids):
        return self.resolve()._decode(ids)

    def _encode_tf(self, s):
        return self.resolve()._encode_tf(s)

    def _decode_tf(self, ids):
        return self.resolve()._decode_tf(ids)

    def encode(self, s):
        return self.resolve().encode(s)

    def decode(self, ids):
        return self.resolve().decode(ids)

    def encode_tf(self, s):
        return self.resolve().encode_tf(s)

    def decode_tf(self, ids):
        return self.resolve().decode_tf(ids)

    def __eq__(self, other) -> bool:
        if isinstance(other, ConfiguredVocabulary):
            return True
        return self.resolve() == other

    def __hash__(self) -> int:
        return hash("ConfiguredVocabulary")

    def __repr__(self) -> str:
        return "ConfiguredVocabulary(task_vocabulary())"


def resolve_vocabulary(vocabulary: seqio.Vocabulary) -> seqio.Vocabulary:
    """The concrete vocabulary behind a ``ConfiguredVocabulary`` (others are returned as is)."""
    while isinstance(vocabulary, ConfiguredVocabulary):
        vocabulary = vocabulary.resolve()
    return vocabulary


def special_token_ids(vocabulary: seqio.Vocabulary) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prefix, suffix)`` ids that frame every sequence of this vocabulary.

    WordPiece (BERT): ``([CLS],), ([SEP],)``. Any other vocabulary (T5 SentencePiece):
    ``(), (EOS,)`` when it has an EOS id, else ``(), ()``.
    """
    vocabulary = resolve_vocabulary(vocabulary)
    if isinstance(vocabulary, WordPieceVocabulary):
        return (vocabulary.cls_id,), (vocabulary.sep_id,)
    eos_id = vocabulary.eos_id
    return (), ((int(eos_id),) if eos_id is not None else ())
