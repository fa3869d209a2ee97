"""Tokenizer, padding, word-piece merging and length bucketing (aligner_jax/tokenization.py)."""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner_jax.encoding import tokenization
from aligner_jax.encoding.tokenization import (
    DEFAULT_DOC_MAXLEN,
    DEFAULT_QUERY_MAXLEN,
    Tokenizer,
    default_bucket_boundaries,
    iter_padded_buckets,
    length_buckets,
    merge_wordpieces,
    pad_batch,
)
from aligner_jax.weights import minilm

SCIFACT = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "beir" / "scifact"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(minilm.minilm_model_dir() / "tokenizer.json")


def test_defaults():
    assert DEFAULT_QUERY_MAXLEN == 64
    assert DEFAULT_DOC_MAXLEN == 256


def test_special_ids_and_vocab(tok):
    assert (tok.pad_id, tok.cls_id, tok.sep_id) == (0, 101, 102)
    assert tok.vocab_size == 30522
    assert tok.id_to_token(101) == "[CLS]"
    assert tok.token_to_id("[SEP]") == 102
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(10**6)


def test_encode_batch_cls_sep_no_padding(tok):
    out = tok.encode_batch(["Hello world", "a", ""], max_length=16)
    assert [o.dtype for o in out] == [np.int32] * 3
    # bert-base-uncased WordPiece ids: hello=7592, world=2088, a=1037.
    np.testing.assert_array_equal(out[0], [101, 7592, 2088, 102])
    np.testing.assert_array_equal(out[1], [101, 1037, 102])
    np.testing.assert_array_equal(out[2], [101, 102])
    # Lower-cased like the checkpoint's BertNormalizer.
    np.testing.assert_array_equal(tok.encode("HELLO World", 16), out[0])


def test_truncation_keeps_sep(tok):
    text = " ".join(["word"] * 100)
    ids = tok.encode_batch([text], max_length=10)[0]
    assert ids.shape == (10,)
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
    # The tokenizer.json's own truncation (128) and padding settings are ignored.
    assert tok.encode(text, max_length=256).shape == (102,)
    with pytest.raises(ValueError, match="max_length=1"):
        tok.encode_batch(["x"], max_length=1)
    with pytest.raises(TypeError, match="single str"):
        tok.encode_batch("not a list")


def test_encode_with_offsets_maps_back_to_text(tok):
    text = "Tokenization of Übermensch, 2 cells."
    ids, offsets = tok.encode_with_offsets(text, max_length=64)
    np.testing.assert_array_equal(ids, tok.encode(text, 64))
    assert offsets.shape == (len(ids), 2) and offsets.dtype == np.int32
    tokens = tok.ids_to_tokens(ids)
    assert tuple(offsets[0]) == (0, 0) and tuple(offsets[-1]) == (0, 0)
    for token, (start, end) in zip(tokens[1:-1], offsets[1:-1], strict=True):
        span = text[start:end].lower()
        if token != "[UNK]":
            # The normaliser strips accents only if configured; compare against the span.
            assert span.replace("ü", "u") == token.removeprefix("##").replace("ü", "u")


def test_merge_wordpieces():
    tokens = ["[CLS]", "token", "##ization", "of", "##x", "cells", "[SEP]"]
    assert merge_wordpieces(tokens) == [
        ("[CLS]", [0]),
        ("tokenization", [1, 2]),
        ("ofx", [3, 4]),
        ("cells", [5]),
        ("[SEP]", [6]),
    ]
    assert merge_wordpieces(["##ab", "##c", "d"]) == [("abc", [0, 1]), ("d", [2])]
    assert merge_wordpieces(["##"]) == [("##", [0])]
    assert merge_wordpieces([]) == []


def test_merge_wordpieces_real_tokens(tok):
    ids = tok.encode("Tokenization improves microstructural imaging", 32)
    words = merge_wordpieces(tok.ids_to_tokens(ids))
    assert [w for w, _ in words] == [
        "[CLS]",
        "tokenization",
        "improves",
        "microstructural",
        "imaging",
        "[SEP]",
    ]
    positions = [p for _, ps in words for p in ps]
    assert positions == list(range(len(ids)))


def test_pad_batch():
    ids, mask = pad_batch([np.array([5, 6, 7]), np.array([8])], length=4)
    np.testing.assert_array_equal(ids, [[5, 6, 7, 0], [8, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 0, 0, 0]])
    assert ids.dtype == np.int32 and mask.dtype == bool
    ids, mask = pad_batch([np.array([1])], length=2, pad_id=9, batch_size=3)
    np.testing.assert_array_equal(ids, [[1, 9], [9, 9], [9, 9]])
    assert mask.sum() == 1
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens > length=2"):
        pad_batch([np.array([1]), np.array([1, 2, 3])], length=2)
    with pytest.raises(ValueError, match="batch_size=1"):
        pad_batch([np.array([1]), np.array([2])], length=2, batch_size=1)


def test_default_bucket_boundaries():
    assert default_bucket_boundaries(256) == (32, 64, 96, 128, 160, 192, 224, 256)
    assert default_bucket_boundaries(70, step=32) == (32, 64, 70)
    assert default_bucket_boundaries(16, step=32) == (16,)


def test_length_buckets_example():
    lengths = [3, 40, 10, 64, 65, 5]
    batches = length_buckets(lengths, boundaries=(16, 64, 128), max_tokens_per_batch=64)
    assert [(b.length, b.rows, b.indices.tolist()) for b in batches] == [
        (16, 4, [0, 5, 2]),  # sorted by length; 3 sequences -> padded to 4 rows
        (64, 1, [1]),
        (64, 1, [3]),
        (128, 1, [4]),
    ]


def test_length_buckets_errors():
    with pytest.raises(ValueError, match="sequence 1 has length 300 > the largest boundary 256"):
        length_buckets([10, 300], boundaries=(128, 256))
    with pytest.raises(ValueError, match="strictly increasing"):
        length_buckets([10], boundaries=(64, 32))
    with pytest.raises(ValueError, match="max_tokens_per_batch=0"):
        length_buckets([10], boundaries=(64,), max_tokens_per_batch=0)
    assert length_buckets([], boundaries=(8,)) == []


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 96), max_size=80),
    step=st.sampled_from([8, 16, 32]),
    max_tokens=st.integers(1, 512),
)
def test_length_buckets_properties(lengths, step, max_tokens):
    boundaries = default_bucket_boundaries(96, step)
    batches = length_buckets(lengths, boundaries, max_tokens)
    seen = np.concatenate([b.indices for b in batches]) if batches else np.array([], int)
    assert sorted(seen.tolist()) == list(range(len(lengths)))  # every index exactly once
    rows_per_length: dict[int, set[int]] = {}
    for b in batches:
        full_rows = max(1, max_tokens // b.length)
        assert b.length in boundaries
        assert 1 <= len(b.indices) <= b.rows <= full_rows
        # Full batches use the token budget; a partial one is padded to a power of two rows.
        assert b.rows == full_rows or (b.rows & (b.rows - 1) == 0 and b.rows < 2 * len(b.indices))
        member_lengths = np.asarray(lengths)[b.indices]
        assert member_lengths.max() <= b.length
        smaller = [x for x in boundaries if x < b.length]
        if smaller:  # the smallest boundary that fits: no sequence could use a shorter bucket
            assert member_lengths.min() > smaller[-1]
        rows_per_length.setdefault(b.length, set()).add(b.rows)
    # At most two compiled shapes per bucket: full batches and the last, partial one.
    assert all(len(rows) <= 2 for rows in rows_per_length.values())


def test_iter_padded_buckets_roundtrip():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 100, size=n).astype(np.int32) for n in [5, 17, 3, 30, 31, 2, 9]]
    seen = []
    for indices, ids, mask in iter_padded_buckets(seqs, (8, 16, 32), max_tokens_per_batch=32):
        assert ids.shape == mask.shape and ids.shape[0] >= len(indices)
        assert not mask[len(indices) :].any()  # filler rows are all padding
        for row, i in enumerate(indices):
            n = len(seqs[i])
            np.testing.assert_array_equal(ids[row, :n], seqs[i])
            assert mask[row, :n].all() and not mask[row, n:].any()
            assert (ids[row, n:] == 0).all()
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(len(seqs)))


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.json")):
        Tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        Tokenizer(bad)


@pytest.mark.skipif(not SCIFACT.is_dir(), reason="SciFact data not present")
def test_scifact_corpus_tokenizes_in_seconds(tok):
    with open(SCIFACT / "corpus.jsonl") as f:
        docs = [json.loads(line) for line in f]
    texts = [(d["title"] + " " + d["text"]).strip() for d in docs]
    start = time.perf_counter()
    seqs = tok.encode_batch(texts, max_length=tokenization.DEFAULT_DOC_MAXLEN)
    elapsed = time.perf_counter() - start
    assert len(seqs) == 5183
    assert max(len(s) for s in seqs) == 256 and min(len(s) for s in seqs) >= 3
    assert elapsed < 20.0, f"tokenizing SciFact took {elapsed:.1f}s"


def test_sentencepiece_tokenizer_matches_the_t5_convention(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    texts = ["the cat sat on the mat", "a dog ran in the park", "cats and dogs"] * 10
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    tok = tokenization.SentencePieceTokenizer(tmp_path / "sp.model")
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    ids = tok.encode_batch(["the cat sat", "cats"], max_length=64)
    assert list(ids[0]) == processor.encode("the cat sat") + [1]  # pieces then EOS, no BOS
    short = tok.encode("the cat sat on the mat", max_length=3)
    assert len(short) == 3 and short[-1] == 1  # truncated with EOS kept last
    assert tok.pad_id == 0 and tok.ids_to_tokens([1]) == ["</s>"]
    with pytest.raises(FileNotFoundError, match="sentencepiece:"):
        tokenization.SentencePieceTokenizer(tmp_path / "missing.model")
    long = " ".join(texts * 400)  # 12k words: tokenized from a prefix, the same pieces
    assert list(tok.encode(long, max_length=64)) == processor.encode(long)[:63] + [1]


def test_a_long_text_is_tokenized_from_a_prefix_with_the_same_ids(tok, monkeypatch):
    """A whole 11 MB document was tokenized (6.5 s, 1 GB) to keep 256 tokens; a prefix cut at
    a whitespace gives the same ids, and one too short for them (whitespace runs) is redone."""
    rng = np.random.default_rng(0)
    words = ["naïve", "café", "Tokenization", "splits", "words,", "(pieces)", "北京", "x" * 150]
    long = " ".join(rng.choice(words, 30_000)) + "\n"
    spaced = " " * 20_000 + long  # its prefix holds no token at all
    want = [e.ids for e in tok._tokenizer(256).encode_batch_fast([long, spaced, "short text"])]
    seen = []
    real = tokenizers.Tokenizer.encode_batch_fast
    monkeypatch.setattr(
        tokenizers.Tokenizer,
        "encode_batch_fast",
        lambda self, batch: seen.extend(len(t) for t in batch) or real(self, batch),
    )
    got = tok.encode_batch([long, spaced, "short text"])
    assert [list(g) for g in got] == want and len(got[0]) == 256
    assert max(seen[:3]) <= 256 * tokenization.CHARS_PER_KEPT_TOKEN  # cut, then...
    assert seen[3:] == [len(spaced)]  # ...the whitespace-led one again whole
