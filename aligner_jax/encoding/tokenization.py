"""WordPiece tokenization, padding and length bucketing for the BERT encoder.

ALIGNER (§4.1) encodes queries with at most 64 tokens and documents with at most 256; every
sequence is ``[CLS] tokens… [SEP]`` and is truncated to the maximum length *including* the two
special tokens (as sentence-transformers does). Sequences are returned unpadded: padding is added
per batch by ``pad_batch`` so that it never takes part in anything (the encoder masks it).

``length_buckets`` groups sequences of similar length into fixed-shape batches so a jitted
encoder compiles once per bucket and wastes little compute on padding; the indexing job and
``benchmarks/encoder_throughput.py`` both use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence

import numpy as np
import tokenizers

from aligner_jax.common.errors import ConfigError

DEFAULT_QUERY_MAXLEN = 64
DEFAULT_DOC_MAXLEN = 256

# Padded sequence lengths of the default buckets (multiples of 32 up to the document length):
# at most 31 pad tokens per sequence, 8 compiled shapes for 256-token documents.
DEFAULT_BUCKET_STEP = 32
# Padded tokens per batch (rows × padded length) of the default buckets: 4 rows of 256 tokens.
# On CPU, batches of 512–1024 tokens keep a layer's activations in cache: MiniLM-L6 encodes about
# 5,200 tokens per CPU-second in 4×256 batches against 3,500 in 16×256 batches on the 2-core Xeon
# of the dev machines. Accelerators want larger batches: pass a larger max_tokens_per_batch.
DEFAULT_MAX_TOKENS_PER_BATCH = 1024

_CONTINUATION_PREFIX = "##"
# A text longer than this many characters per kept token is tokenized from a prefix cut at a
# whitespace (words stay whole, so its tokens are the text's first ones): an 11 MB document
# took 6.5 s and 1 GB to keep 256 tokens. A prefix that gives fewer than the kept tokens (long
# whitespace runs) is redone with the whole text.
CHARS_PER_KEPT_TOKEN = 32


def _whitespace_prefix(text: str, max_length: int) -> str | None:
    """``text`` cut at its last whitespace within ``CHARS_PER_KEPT_TOKEN × max_length``
    characters; None when it is shorter, or has no whitespace there."""
    limit = max_length * CHARS_PER_KEPT_TOKEN
    if len(text) <= limit:
        return None
    cut = max(text.rfind(c, 0, limit) for c in (" ", "\n", "\t", "\r"))
    return text[:cut] if cut > 0 else None


def _encode_prefixes(encode, texts: Sequence[str], max_length: int, enough: int) -> list:
    """``encode(list of texts)`` → token id lists, each text's cut at ``_whitespace_prefix``
    first; a prefix that gives fewer than ``enough`` ids (the text may hold more) is encoded
    again whole."""
    texts = list(texts)
    prefixes = [_whitespace_prefix(t, max_length) for t in texts]
    out = encode([t if p is None else p for t, p in zip(texts, prefixes, strict=True)])
    short = [i for i, p in enumerate(prefixes) if p is not None and len(out[i]) < enough]
    for i, ids in zip(short, encode([texts[i] for i in short]) if short else [], strict=True):
        out[i] = ids
    return out


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` (BERT WordPiece) behind a small numpy API.

    The file's own padding and truncation settings are ignored: ``encode_batch`` truncates to the
    ``max_length`` it is given and never pads.
    """

    def __init__(self, tokenizer_file: str | os.PathLike):
        self.path = os.fspath(tokenizer_file)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"Tokenizer file {self.path} does not exist; pass the tokenizer.json of the "
                "model folder (see aligner_jax.weights.minilm.minilm_model_dir())."
            )
        try:
            base = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust library raises plain Exceptions
            raise ConfigError(f"{self.path}: not a valid tokenizers JSON file ({e}).") from e
        self._json = base.to_str()
        self._by_max_length: dict[int, tokenizers.Tokenizer] = {}
        base.no_padding()
        base.no_truncation()
        self._untruncated = base
        self.pad_id = self._special_id("[PAD]")
        self.cls_id = self._special_id("[CLS]")
        self.sep_id = self._special_id("[SEP]")
        self.vocab_size = base.get_vocab_size(with_added_tokens=True)

    def _special_id(self, token: str) -> int:
        token_id = self._untruncated.token_to_id(token)
        if token_id is None:
            raise ConfigError(
                f"{self.path}: the vocabulary has no {token} token (not a BERT vocab)."
            )
        return int(token_id)

    def _tokenizer(self, max_length: int) -> tokenizers.Tokenizer:
        if not isinstance(max_length, int | np.integer) or max_length < 2:
            raise ConfigError(
                f"max_length={max_length!r} must be an int ≥ 2 (room for [CLS] and [SEP])."
            )
        max_length = int(max_length)
        tok = self._by_max_length.get(max_length)
        if tok is None:
            tok = tokenizers.Tokenizer.from_str(self._json)
            tok.no_padding()
            tok.enable_truncation(max_length)
            self._by_max_length[max_length] = tok
        return tok

    def encode_batch(
        self, texts: Sequence[str], max_length: int = DEFAULT_DOC_MAXLEN
    ) -> list[np.ndarray]:
        """Token ids ``[CLS] … [SEP]`` of each text, truncated to ``max_length``, unpadded.

        Uses the library's parallel batch path without offsets (fast: the SciFact corpus takes
        about a second).
        """
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a sequence of strings, got a single str.")
        tok = self._tokenizer(max_length)

        def encode(batch):
            return [e.ids for e in tok.encode_batch_fast(batch)]

        ids = _encode_prefixes(encode, texts, max_length, enough=max_length)
        return [np.asarray(i, dtype=np.int32) for i in ids]

    def encode(self, text: str, max_length: int = DEFAULT_DOC_MAXLEN) -> np.ndarray:
        """``encode_batch`` for one text."""
        return self.encode_batch([text], max_length)[0]

    def encode_with_offsets(
        self, text: str, max_length: int = DEFAULT_DOC_MAXLEN
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids ``[n]`` int32 and character offsets ``[n, 2]`` int32 (``text[s:e]``).

        Special tokens have the empty span ``(0, 0)``. Used to render salience and alignments
        over the original text (paper Tables 4–5).
        """
        enc = self._tokenizer(max_length).encode(text)
        ids = np.asarray(enc.ids, dtype=np.int32)
        offsets = np.asarray(enc.offsets, dtype=np.int32).reshape(-1, 2)
        return ids, offsets

    def encode_pieces_with_offsets(
        self, texts: Sequence[str]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Word-piece ids ``[n]`` int32 and character offsets ``[n, 2]`` int32 of each whole text,
        without special tokens and without truncation (the caller cuts and wraps windows).

        Used to map word-pieces back to words (miniCOIL's word analysis, ``lexical.words``).
        """
        if isinstance(texts, str):
            raise TypeError("encode_pieces_with_offsets expects a sequence of strings.")
        encodings = self._untruncated.encode_batch(list(texts), add_special_tokens=False)
        return [
            (
                np.asarray(e.ids, dtype=np.int32),
                np.asarray(e.offsets, dtype=np.int32).reshape(-1, 2),
            )
            for e in encodings
        ]

    def id_to_token(self, token_id: int) -> str:
        token = self._untruncated.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"Token id {token_id} is outside the vocabulary of {self.path}.")
        return token

    def ids_to_tokens(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int:
        token_id = self._untruncated.token_to_id(token)
        if token_id is None:
            raise ValueError(f"Token {token!r} is not in the vocabulary of {self.path}.")
        return int(token_id)


class SentencePieceTokenizer:
    """A T5 SentencePiece model behind the same API as :class:`Tokenizer` (for T5 backbones).

    Sequences are ``pieces… </s>`` (T5 appends EOS and adds no prefix token), truncated to
    ``max_length`` with EOS kept last; padding id 0 (T5's ``<pad>``).
    """

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece  # noqa: PLC0415  (optional: T5 tokenizers only)

        self.path = os.fspath(model_file)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(
                f"SentencePiece model {self.path} does not exist (load_encoder.tokenizer="
                "'sentencepiece:/path/spiece.model')."
            )
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else 0
        self.eos_id = int(self._sp.eos_id())
        self.vocab_size = int(self._sp.get_piece_size())

    def encode_batch(
        self, texts: Sequence[str], max_length: int = DEFAULT_DOC_MAXLEN
    ) -> list[np.ndarray]:
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a sequence of strings, got a single str.")
        out = []
        for ids in _encode_prefixes(self._sp.encode, texts, max_length, enough=max_length - 1):
            ids = list(ids)[: max_length - 1] + [self.eos_id]
            out.append(np.asarray(ids, dtype=np.int32))
        return out

    def encode(self, text: str, max_length: int = DEFAULT_DOC_MAXLEN) -> np.ndarray:
        return self.encode_batch([text], max_length)[0]

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def ids_to_tokens(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return [self.id_to_token(i) for i in ids]


def merge_wordpieces(tokens: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Groups WordPiece tokens into words: ``##`` continuation pieces join the preceding word.

    Returns ``(word, [token positions])`` in order; e.g. ``['[CLS]', 'token', '##ization']`` gives
    ``[('[CLS]', [0]), ('tokenization', [1, 2])]``. A continuation piece with nothing before it
    starts a word of its own (without the ``##``).
    """
    words: list[tuple[str, list[int]]] = []
    for position, token in enumerate(tokens):
        if token.startswith(_CONTINUATION_PREFIX) and len(token) > len(_CONTINUATION_PREFIX):
            piece = token[len(_CONTINUATION_PREFIX) :]
            if words:
                word, positions = words[-1]
                words[-1] = (word + piece, positions + [position])
                continue
            words.append((piece, [position]))
        else:
            words.append((token, [position]))
    return words


def pad_batch(
    sequences: Sequence[np.ndarray], length: int, pad_id: int = 0, batch_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token id arrays into ``ids [B, length]`` int32 and ``mask [B, length]`` bool.

    Args:
      sequences: 1-D int arrays, each at most ``length`` long.
      length: padded length.
      pad_id: id written at padding positions (the mask, not the id, marks padding).
      batch_size: if given (≥ len(sequences)), adds all-padding rows up to this many so that every
        batch of a bucket has the same shape.
    """
    rows = len(sequences) if batch_size is None else batch_size
    if rows < len(sequences):
        raise ValueError(
            f"pad_batch: batch_size={batch_size} < number of sequences {len(sequences)}."
        )
    ids = np.full((rows, length), pad_id, dtype=np.int32)
    mask = np.zeros((rows, length), dtype=bool)
    for row, seq in enumerate(sequences):
        seq = np.asarray(seq)
        if seq.ndim != 1:
            raise ValueError(f"pad_batch: sequence {row} has shape {seq.shape}; expected 1-D ids.")
        if seq.shape[0] > length:
            raise ValueError(
                f"pad_batch: sequence {row} has {seq.shape[0]} tokens > length={length}; "
                "tokenize with a max_length no larger than the padded length."
            )
        ids[row, : seq.shape[0]] = seq
        mask[row, : seq.shape[0]] = True
    return ids, mask


def default_bucket_boundaries(max_length: int, step: int = DEFAULT_BUCKET_STEP) -> tuple[int, ...]:
    """Multiples of ``step`` up to ``max_length`` (which is always the last boundary)."""
    if max_length < 1 or step < 1:
        raise ConfigError(f"max_length={max_length} and step={step} must be positive.")
    bounds = list(range(step, max_length, step))
    return tuple(bounds + [max_length])


@dataclasses.dataclass(frozen=True)
class BucketBatch:
    """One fixed-shape batch: ``indices`` of the sequences it holds, padded to ``[rows, length]``.

    ``rows`` is the same for every full batch of a bucket; a bucket's last, partial batch is padded
    with all-padding rows to the next power of two, so a jitted encoder sees few shapes.
    """

    indices: np.ndarray
    length: int
    rows: int


def length_buckets(
    lengths: Sequence[int] | np.ndarray,
    boundaries: Sequence[int],
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
) -> list[BucketBatch]:
    """Groups sequences by length into batches of at most ``max_tokens_per_batch`` padded tokens.

    Each sequence goes to the smallest boundary ≥ its length; a bucket of padded length ``b`` holds
    ``max(1, max_tokens_per_batch // b)`` rows per batch (its last batch: the next power of two
    ≥ the sequences left, capped there). Within a bucket sequences are ordered by
    length (stable), so the index order is deterministic. Every index appears in exactly one batch.

    Args:
      lengths: real (unpadded) length of every sequence.
      boundaries: strictly increasing padded lengths; the last must cover the longest sequence.
      max_tokens_per_batch: budget of rows × padded length per batch.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = np.asarray(boundaries, dtype=np.int64)
    if bounds.ndim != 1 or bounds.size == 0 or np.any(np.diff(bounds) <= 0) or bounds[0] < 1:
        raise ConfigError(
            f"length_buckets: boundaries={list(boundaries)} must be a non-empty, strictly "
            "increasing list of positive lengths."
        )
    if max_tokens_per_batch < 1:
        raise ConfigError(
            f"length_buckets: max_tokens_per_batch={max_tokens_per_batch} must be ≥ 1."
        )
    if lengths.size and lengths.max() > bounds[-1]:
        longest = int(np.argmax(lengths))
        raise ValueError(
            f"length_buckets: sequence {longest} has length {lengths[longest]} > the largest "
            f"boundary {bounds[-1]}; add a boundary or truncate the sequences."
        )
    bucket_of = np.searchsorted(bounds, lengths, side="left")
    batches: list[BucketBatch] = []
    for bucket, length in enumerate(bounds.tolist()):
        members = np.flatnonzero(bucket_of == bucket)
        if members.size == 0:
            continue
        members = members[np.argsort(lengths[members], kind="stable")]
        rows = max(1, max_tokens_per_batch // length)
        for start in range(0, members.size, rows):
            chunk = members[start : start + rows]
            # A short last batch is padded to the next power of two rows, not to ``rows``: at most
            # log2(rows) extra shapes per bucket instead of up to rows - 1 filler sequences.
            padded_rows = min(rows, 1 << (chunk.size - 1).bit_length())
            batches.append(BucketBatch(chunk, int(length), padded_rows))
    return batches


def iter_padded_buckets(
    sequences: Sequence[np.ndarray],
    boundaries: Sequence[int],
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
    pad_id: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yields ``(indices [n], ids [rows, length], mask [rows, length])`` per ``length_buckets`` batch.

    The first ``n = len(indices)`` rows hold ``sequences[indices]``; the remaining rows are
    all-padding filler that keeps the bucket's shape fixed.
    """
    lengths = [len(s) for s in sequences]
    for batch in length_buckets(lengths, boundaries, max_tokens_per_batch):
        ids, mask = pad_batch(
            [sequences[i] for i in batch.indices], batch.length, pad_id, batch_size=batch.rows
        )
        yield batch.indices, ids, mask
