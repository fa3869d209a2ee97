"""Tests of the seqio task registry (``tasks/``): vocabulary, feature converter, the three tasks,
gin bindings and deterministic input order. Tiny fixtures only; the real SciFact run is reported
separately (see the task module docstrings)."""

from __future__ import annotations

import gzip
import itertools
import json

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from aligner_jax import tasks
from aligner_jax.common import errors
from aligner_jax.data import beir, bm25
from aligner_jax.encoding import tokenization
from aligner_jax.tasks import features, msmarco, negatives, selfsup, sources
from tests import fixtures

LENGTHS = {"query": 12, "doc": 20}

LONG_TEXT = (
    "Glaciers are slow rivers of ice that carve valleys as they move down mountains. " * 20
).strip()
TEXTS = [
    "Hello World!",
    "",
    "Tokenization of unbelievably hyphenated-words, numbers like 3.14159 and naïve café text.",
    LONG_TEXT,
]

_NOUNS = (
    "volcano glacier honey chess bread galaxy insulin jazz tide forest river desert comet "
    "pyramid violin penguin coral orchid falcon lantern harbor meadow canyon dragon engine "
    "castle island marble rocket garden"
).split()


@pytest.fixture(autouse=True)
def _fresh_examples_cache():
    sources.clear_examples_cache()  # gin is cleared by conftest
    yield
    sources.clear_examples_cache()


@pytest.fixture(scope="module")
def tokenizer() -> tokenization.Tokenizer:
    return tokenization.Tokenizer(tasks.vocab.default_tokenizer_file())


@pytest.fixture(scope="module")
def vocab() -> tasks.WordPieceVocabulary:
    return tasks.WordPieceVocabulary()


def _topic_corpus(tmp_path, num_docs: int = 24, split: str = "train"):
    """A BEIR folder with num_docs documents on word-pair topics; query i is about document i
    (and also judges document i+1 relevant for every fourth query)."""
    docs, queries, qrels = {}, {}, {}
    for i in range(num_docs):
        a, b, c = _NOUNS[i % len(_NOUNS)], _NOUNS[(3 * i + 1) % len(_NOUNS)], _NOUNS[(i + 7) % 29]
        docs[f"d{i}"] = {
            "title": f"The {a} and the {b}",
            "text": f"A {a} stands beside a {b}. The {c} watches the {a} at night. " * 2,
        }
    for i in range(0, num_docs - 1, 2):
        a, b = _NOUNS[i % len(_NOUNS)], _NOUNS[(3 * i + 1) % len(_NOUNS)]
        queries[f"q{i}"] = f"where does a {a} stand beside a {b}"
        qrels[f"q{i}"] = {f"d{i}": 1}
        if i % 4 == 0:
            qrels[f"q{i}"][f"d{i + 1}"] = 2
    qrels["q2"]["d5"] = 0  # judged, not relevant: never an example, may be a negative
    folder = fixtures.write_beir_fixture(tmp_path, docs, queries, qrels, split=split)
    return folder, docs, queries, qrels


def _bind(*bindings: str) -> None:
    gin.parse_config(list(bindings))


def _first_batches(task: str, seed: int, batch_size: int, count: int, skip: int = 0):
    ds = seqio.get_dataset(
        task,
        LENGTHS,
        tasks.AlignerFeatureConverter(),
        dataset_split="train",
        shuffle=True,
        seed=seed,
        num_epochs=None,
    )
    if skip:
        ds = ds.skip(skip)
    return list(itertools.islice(tasks.batches_as_numpy(ds, batch_size), count))


# ---------------------------------------------------------------------------------------------
# Vocabulary.


def test_vocabulary_special_ids(vocab, tokenizer):
    assert vocab.pad_id == 0 == tokenizer.pad_id
    assert vocab.eos_id == vocab.sep_id == tokenizer.sep_id == 102
    assert vocab.bos_id == vocab.cls_id == tokenizer.cls_id == 101
    assert vocab.unk_id == tokenizer.token_to_id("[UNK]") == 100
    assert vocab.vocab_size == tokenizer.vocab_size == 30522
    assert vocab == tasks.WordPieceVocabulary(tasks.vocab.default_tokenizer_file())
    assert hash(vocab) == hash(tasks.WordPieceVocabulary())
    assert tasks.special_token_ids(vocab) == ((101,), (102,))
    assert tasks.task_vocabulary() == vocab  # the gin default is the bundled WordPiece


@pytest.mark.parametrize("max_length", [2, 3, 8, 64, 256])
def test_framed_encoding_equals_tokenizer_encode_batch(vocab, tokenizer, max_length):
    expected = tokenizer.encode_batch(TEXTS, max_length)
    prefix, suffix = tasks.special_token_ids(vocab)
    for text, ids, want in zip(TEXTS, vocab.encode_batch(TEXTS), expected, strict=True):
        assert vocab.encode(text) == ids.tolist()
        got = tasks.frame_tokens(ids, max_length, prefix, suffix)
        np.testing.assert_array_equal(got, want, err_msg=f"{text[:30]!r} at {max_length}")
        assert got[-1] == tokenizer.sep_id and got[0] == tokenizer.cls_id
    # The long text really is truncated at the shorter lengths.
    assert len(expected[-1]) == max_length


def test_encode_tf_scalar_vector_and_matrix(vocab):
    scalar = vocab.encode_tf(tf.constant(TEXTS[2]))
    assert isinstance(scalar, tf.Tensor) and scalar.dtype == tf.int32
    assert scalar.numpy().tolist() == vocab.encode(TEXTS[2])
    vector = vocab.encode_tf(tf.constant(TEXTS))
    assert isinstance(vector, tf.RaggedTensor) and vector.shape.as_list() == [4, None]
    assert vector.to_list() == [vocab.encode(t) for t in TEXTS]
    matrix = vocab.encode_tf(tf.constant([TEXTS[:2], TEXTS[2:]]))
    assert matrix.shape.as_list()[:2] == [2, 2]
    assert matrix.to_list() == [
        [vocab.encode(t) for t in TEXTS[:2]],
        [vocab.encode(t) for t in TEXTS[2:]],
    ]


def test_frame_tokens_tf_matches_numpy(vocab):
    prefix, suffix = tasks.special_token_ids(vocab)
    rows = vocab.encode_tf(tf.constant(TEXTS))
    framed = tasks.frame_tokens_tf(rows, 6, prefix, suffix).to_list()
    assert framed == [
        tasks.frame_tokens(vocab.encode(t), 6, prefix, suffix).tolist() for t in TEXTS
    ]
    one = tasks.frame_tokens_tf(tf.constant(vocab.encode(LONG_TEXT)), 5, prefix, suffix)
    assert one.numpy().tolist() == [101] + vocab.encode(LONG_TEXT)[:3] + [102]
    with pytest.raises(ValueError, match=r"leaves no room for the 2 framing tokens"):
        tasks.frame_tokens([1, 2], 1, prefix, suffix)


def test_decode_round_trip(vocab):
    text = "Insulin lowers blood glucose in type 1 diabetes."
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text.lower()
    framed = [101] + ids + [102, 0, 0]
    assert vocab.decode(framed) == text.lower()
    batch = tf.constant([framed, [101] + vocab.encode("Hello World") + [102] + [0] * len(ids)])
    decoded = vocab.decode_tf(batch).numpy().tolist()
    assert decoded == [text.lower().encode(), b"hello world"]
    # seqio semantics: everything after the first EOS ([SEP]) is dropped.
    assert vocab.decode([101] + ids[:2] + [102] + ids[2:]) == vocab.decode(ids[:2])


def test_sentencepiece_vocabulary_is_a_gin_choice(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = [d["text"] for d in fixtures.TOY_DOCS.values()] + list(fixtures.TOY_QUERIES.values())
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 5),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=120,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    folder = fixtures.write_toy_beir(tmp_path, split="train")
    _bind(
        "task_vocabulary.kind = 'sentencepiece'",
        f"task_vocabulary.sentencepiece_model_file = '{tmp_path / 'sp.model'}'",
        f"beir_train_source.dataset_dir = '{folder}'",
    )
    task = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25)
    vocabulary = task.output_features["query"].vocabulary
    assert isinstance(vocabulary, tasks.ConfiguredVocabulary)
    assert isinstance(vocabulary.resolve(), seqio.SentencePieceVocabulary)
    assert vocabulary.vocab_size == 120 and vocabulary.eos_id == 1
    assert tasks.special_token_ids(vocabulary) == ((), (1,))  # T5: no prefix, EOS last
    example = next(task.get_dataset({"query": 6, "doc": 9}, shuffle=False).as_numpy_iterator())
    query = vocabulary.resolve().encode(example["query_pretokenized"].decode())
    np.testing.assert_array_equal(example["query"], (query[:5] + [1]))
    assert all(row[-1] == 1 and len(row) <= 9 for row in example["doc"].tolist())


def test_task_vocabulary_binding_errors():
    with pytest.raises(ValueError, match=r"task_vocabulary.sentencepiece_model_file"):
        tasks.task_vocabulary(kind="sentencepiece")
    with pytest.raises(ValueError, match=r"task_vocabulary.kind='bpe'"):
        tasks.task_vocabulary(kind="bpe")
    with pytest.raises(ValueError, match=r"also set --gin.task_vocabulary.kind"):
        tasks.task_vocabulary(sentencepiece_model_file="/x/sp.model")


# ---------------------------------------------------------------------------------------------
# Task tokens, the feature converter and numpy batches.


def test_task_tokens_equal_tokenizer_encode_batch(tmp_path, tokenizer):
    folder, *_ = _topic_corpus(tmp_path)
    _bind(f"beir_train_source.dataset_dir = '{folder}'", "beir_train_source.num_negatives = 2")
    task = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25)
    ds = task.get_dataset(LENGTHS, shuffle=False)
    assert ds.element_spec["doc"].shape.as_list() == [3, None]
    truncated = 0
    for example in ds.as_numpy_iterator():
        query = example["query_pretokenized"].decode()
        np.testing.assert_array_equal(example["query"], tokenizer.encode(query, LENGTHS["query"]))
        texts = [example["positive_pretokenized"].decode()]
        texts += [t.decode() for t in example["negatives_pretokenized"]]
        want = tokenizer.encode_batch(texts, LENGTHS["doc"])
        for row, expected in zip(example["doc"], want, strict=True):
            np.testing.assert_array_equal(row, expected)
            truncated += len(row) == LENGTHS["doc"]
            assert row[-1] == tokenizer.sep_id
    assert truncated > 0  # the fixture's documents are longer than 20 tokens


def test_feature_converter_shapes_padding_and_positive_first(tmp_path, tokenizer):
    folder, *_ = _topic_corpus(tmp_path)
    _bind(f"beir_train_source.dataset_dir = '{folder}'", "beir_train_source.num_negatives = 3")
    task = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25)
    raw = list(task.get_dataset(LENGTHS, shuffle=False).as_numpy_iterator())
    ds = seqio.get_dataset(tasks.BEIR_TRAIN_BM25, LENGTHS, tasks.AlignerFeatureConverter())
    assert set(ds.element_spec) == {"query_tokens", "doc_tokens", "doc_keys", "relevant_keys"}
    batches = list(tasks.batches_as_numpy(ds, 4))
    assert len(batches) == len(raw) // 4  # the remainder is dropped
    for b, batch in enumerate(batches):
        assert batch["query_tokens"].shape == (4, 12) and batch["query_tokens"].dtype == np.int32
        assert batch["doc_tokens"].shape == (4, 4, 20) and batch["doc_tokens"].dtype == np.int32
        for i in range(4):
            example = raw[4 * b + i]
            q = batch["query_tokens"][i]
            n = len(example["query"])
            np.testing.assert_array_equal(q[:n], example["query"])
            assert (q[n:] == 0).all() and (q[:n] != 0).all()  # mask = tokens != 0
            positive = tokenizer.encode(example["positive_pretokenized"].decode(), 20)
            row = batch["doc_tokens"][i, 0]
            np.testing.assert_array_equal(row[: len(positive)], positive)  # positive first
            assert (row[len(positive) :] == 0).all()
            assert int((batch["doc_tokens"][i] != 0).sum()) == sum(map(len, example["doc"]))


def test_feature_converter_errors(tmp_path):
    with pytest.raises(ValueError, match="does not pack"):
        tasks.AlignerFeatureConverter(pack=True)
    folder = fixtures.write_toy_beir(tmp_path, split="train")
    _bind(f"beir_train_source.dataset_dir = '{folder}'")
    with pytest.raises(ValueError, match="missing features"):
        seqio.get_dataset(tasks.BEIR_TRAIN_BM25, {"query": 8}, tasks.AlignerFeatureConverter())
    task = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25)
    with pytest.raises(ValueError, match="fixed shapes"):
        tasks.batches_as_numpy(task.get_dataset(LENGTHS, shuffle=False), 2)
    ds = seqio.get_dataset(tasks.BEIR_TRAIN_BM25, LENGTHS, tasks.AlignerFeatureConverter())
    with pytest.raises(ValueError, match="batch_size=0"):
        tasks.batches_as_numpy(ds, 0)
    with pytest.raises(ValueError, match="leaves no room"):
        task.get_dataset({"query": 1, "doc": 8}, shuffle=False)
    _bind("beir_train_source.num_negatives = 4")
    with pytest.raises(ValueError, match="smaller than the 5 documents per example"):
        task.get_dataset({"query": 8, "doc": 4}, shuffle=False)


# ---------------------------------------------------------------------------------------------
# beir_train_bm25.


def test_beir_train_examples_and_bm25_negatives(tmp_path):
    folder, docs, queries, qrels = _topic_corpus(tmp_path)
    config = tasks.beir_train_source(dataset_dir=str(folder), num_negatives=3, depth=6, seed=5)
    examples = tasks.build_beir_train_examples(config, "train")
    pairs = [(q, d) for q, judged in qrels.items() for d, s in judged.items() if s > 0]
    assert len(examples) == len(pairs) == examples.stats["relevant_pairs"]
    assert examples.num_negatives == 3
    corpus = beir.load_corpus(folder / "corpus.jsonl")
    text_to_id = {beir.document_text(d): doc_id for doc_id, d in corpus.items()}
    index = bm25.BM25Index.build(list(corpus), [beir.document_text(d) for d in corpus.values()])
    top = index.search(queries, k=50)
    for i, (qid, doc_id) in enumerate(pairs):
        example = examples.example(i)
        assert example["query"] == queries[qid]
        assert text_to_id[example["positive"]] == doc_id
        neg_ids = [text_to_id[t] for t in example["negatives"]]
        relevant = {d for d, s in qrels[qid].items() if s > 0}
        assert len(set(neg_ids)) == 3 and not relevant & set(neg_ids)
        pool = [d for d in top[qid] if d not in relevant and d != qid][:6]
        assert set(neg_ids) <= set(pool)  # drawn from the top-depth non-relevant documents
    # The two pairs of a query with two relevant documents share its negatives.
    np.testing.assert_array_equal(examples.negatives[0], examples.negatives[1])
    again = tasks.build_beir_train_examples(config, "train")
    assert again.texts == examples.texts
    np.testing.assert_array_equal(again.negatives, examples.negatives)
    other = tasks.build_beir_train_examples(
        tasks.beir_train_source(dataset_dir=str(folder), num_negatives=3, depth=6, seed=6), "train"
    )
    assert [other.example(i)["negatives"] for i in range(len(other))] != [
        examples.example(i)["negatives"] for i in range(len(examples))
    ]


def test_beir_short_bm25_pools_are_topped_up(tmp_path):
    folder = fixtures.write_toy_beir(tmp_path, split="train")
    config = tasks.beir_train_source(dataset_dir=str(folder), num_negatives=6, depth=6)
    examples = tasks.build_beir_train_examples(config, "train")
    assert examples.stats["topped_up_queries"] > 0
    for i, qid in enumerate(["q0", "q1", "q1", "q2", "q3"]):
        negs = examples.example(i)["negatives"]
        relevant = {
            beir.document_text(beir.Document(d, **fixtures.TOY_DOCS[d]))
            for d, s in fixtures.TOY_QRELS[qid].items()
            if s > 0
        }
        assert len(set(negs)) == 6 and not relevant & set(negs)
    with pytest.raises(ValueError, match=r"only \d+ of the 12 documents are neither relevant"):
        tasks.build_beir_train_examples(
            tasks.beir_train_source(dataset_dir=str(folder), num_negatives=11, depth=11), "train"
        )


def test_beir_negatives_cache_file(tmp_path):
    folder, *_ = _topic_corpus(tmp_path)
    cache = tmp_path / "cache" / "negatives.json"
    config = tasks.beir_train_source(
        dataset_dir=str(folder), num_negatives=2, cache_file=str(cache)
    )
    first = tasks.build_beir_train_examples(config, "train")
    assert cache.is_file() and first.stats["negatives_from_cache_file"] == 0
    payload = json.loads(cache.read_text())
    assert payload["key"]["num_negatives"] == 2 and len(payload["negatives"]) == 12
    second = tasks.build_beir_train_examples(config, "train")
    assert second.stats["negatives_from_cache_file"] == 1
    np.testing.assert_array_equal(second.negatives, first.negatives)
    assert second.texts == first.texts
    reseeded = tasks.beir_train_source(
        dataset_dir=str(folder), num_negatives=2, seed=1, cache_file=str(cache)
    )
    assert (
        tasks.build_beir_train_examples(reseeded, "train").stats["negatives_from_cache_file"] == 0
    )


def test_beir_zero_negatives_and_other_split(tmp_path):
    folder, *_ = _topic_corpus(tmp_path, split="dev")
    _bind(f"beir_train_source.dataset_dir = '{folder}'", "beir_train_source.num_negatives = 0")
    task = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25)
    example = next(task.get_dataset(LENGTHS, split="dev", shuffle=False).as_numpy_iterator())
    assert example["doc"].shape[0] == 1 and example["negatives_pretokenized"].shape == (0,)
    with pytest.raises(errors.BeirFormatError, match=r"qrels[/\\]train.tsv"):
        task.get_dataset(LENGTHS, split="train", shuffle=False)
    _bind("beir_train_source.qrels_split = 'dev'")
    assert task.source.examples("train").stats["relevant_pairs"] == 18


# ---------------------------------------------------------------------------------------------
# msmarco_triples.


def _write_triples(path, rows):
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


TRIPLES = [("what is a volcano", "volcano passage", f"negative {i}") for i in range(5)] + [
    ("what is honey", "honey passage", "bee negative"),
    ("what is a volcano", "second volcano passage", "negative 0"),
    ("what is a volcano", "second volcano passage", "negative 9"),
    ("what is a volcano", "volcano passage", "negative 2"),  # repeated triple: counted once
]


def test_msmarco_text_triples_group_negatives(tmp_path):
    path = _write_triples(tmp_path / "triples.train.small.tsv", TRIPLES)
    config = tasks.msmarco_train_source(data_dir=str(tmp_path), num_negatives=2, seed=3)
    assert config.triples_format == "text" and config.triples_file == str(path.resolve())
    ex = tasks.build_msmarco_examples(config, "train")
    assert ex.stats == {"triples": 9, "groups": 3, "dropped_groups": 1}  # 'honey' has 1 negative
    rows = [ex.example(i) for i in range(len(ex))]
    assert [r["positive"] for r in rows] == ["volcano passage"] * 3 + ["second volcano passage"]
    first = [r["negatives"] for r in rows[:3]]
    assert all(len(set(n)) == 2 for n in first)
    assert set().union(*map(set, first)) == {f"negative {i}" for i in range(5)}
    assert sorted(rows[3]["negatives"]) == ["negative 0", "negative 9"]
    one = tasks.build_msmarco_examples(
        tasks.msmarco_train_source(triples_file=str(path), num_negatives=1), "train"
    )
    assert len(one) == 8  # one example per distinct triple
    zero = tasks.build_msmarco_examples(
        tasks.msmarco_train_source(triples_file=str(path), num_negatives=0), "train"
    )
    assert [zero.example(i)["positive"] for i in range(len(zero))] == [
        "volcano passage",
        "honey passage",
        "second volcano passage",
    ]
    capped = tasks.build_msmarco_examples(
        tasks.msmarco_train_source(triples_file=str(path), max_triples=2), "train"
    )
    assert capped.stats["triples"] == 2 and len(capped) == 2


def test_msmarco_id_triples_gz_and_task(tmp_path):
    (tmp_path / "collection.tsv").write_text(
        "".join(f"{pid}\tpassage number {pid} about topic {pid % 3}\n" for pid in range(10))
    )
    (tmp_path / "queries.train.tsv").write_text(
        "100\tfirst query\n200\tsecond query\n300\tunused\n"
    )
    with gzip.open(tmp_path / "qidpidtriples.train.full.2.tsv.gz", "wt") as f:
        for qid, pos, neg in [(100, 1, 2), (100, 1, 3), (200, 4, 5), (200, 4, 6), (200, 4, 7)]:
            f.write(f"{qid}\t{pos}\t{neg}\n")
    _bind(f"msmarco_train_source.data_dir = '{tmp_path}'", "msmarco_train_source.num_negatives = 2")
    config = tasks.msmarco_train_source()
    assert config.triples_format == "ids" and config.collection_file.endswith("collection.tsv")
    ex = tasks.build_msmarco_examples(config, "train")
    rows = [ex.example(i) for i in range(len(ex))]
    assert [(r["query"], r["positive"]) for r in rows] == [
        ("first query", "passage number 1 about topic 1"),
        ("second query", "passage number 4 about topic 1"),
        ("second query", "passage number 4 about topic 1"),
    ]
    assert set(rows[0]["negatives"]) == {
        "passage number 2 about topic 2",
        "passage number 3 about topic 0",
    }
    task = seqio.get_mixture_or_task(tasks.MSMARCO_TRIPLES)
    example = next(task.get_dataset(LENGTHS, shuffle=False).as_numpy_iterator())
    assert example["doc"].shape[0] == 3 and example["query_pretokenized"] == b"first query"
    (tmp_path / "collection.tsv").write_text("1\tonly one passage\n")
    sources.clear_examples_cache()
    with pytest.raises(ValueError, match=r"collection.tsv: 6 passage ids used by the triples"):
        tasks.build_msmarco_examples(tasks.msmarco_train_source(), "train")


def test_msmarco_file_errors(tmp_path):
    bad = _write_triples(tmp_path / "triples.train.small.tsv", [("q", "p", "n"), ("q", "p")])
    with pytest.raises(ValueError, match=r"triples.train.small.tsv:2: expected 3 tab-separated"):
        tasks.build_msmarco_examples(tasks.msmarco_train_source(triples_file=str(bad)), "train")
    (tmp_path / "ids").mkdir()
    ids = _write_triples(tmp_path / "ids" / "t.tsv", [("1", "2", "3")])
    with pytest.raises(ValueError, match=r"msmarco_train_source.collection_file"):
        tasks.msmarco_train_source(triples_file=str(ids))
    with pytest.raises(ValueError, match=r"holds neither triples.train.small.tsv nor"):
        tasks.msmarco_train_source(data_dir=str(tmp_path / "ids"))


# ---------------------------------------------------------------------------------------------
# selfsup_pseudo_queries.

SELFSUP_DOCS = {
    "t0": {"title": "Honey bees", "text": "Bees make honey in the hive. They collect nectar."},
    "t1": {"title": "Glaciers", "text": "Glaciers carve valleys. Ice moves slowly downhill."},
    "s0": "Volcanoes erupt lava. Magma rises through the crust! Ash clouds block the sun.",
    "s1": "The chess opening matters. Black answers with the c5 pawn? It is sharp.",
    "s2": "A single sentence without a title is skipped",
    "s3": "Jazz musicians improvise. The saxophone leads the swing rhythm.",
    "s4": "Tides rise twice a day. The moon pulls the ocean.",
}


def test_selfsup_pseudo_queries(tmp_path):
    folder = fixtures.write_beir_fixture(tmp_path, SELFSUP_DOCS, {"q": "x"}, {"q": {"t0": 1}})
    config = tasks.selfsup_train_source(dataset_dir=str(folder), num_negatives=2, seed=1)
    ex = tasks.build_selfsup_examples(config, "train")
    assert ex.stats["title_pairs"] == 2 and ex.stats["inverse_cloze_pairs"] == 4
    assert ex.stats["skipped_documents"] == 1
    rows = {doc_id: ex.example(i) for i, doc_id in enumerate(["t0", "t1", "s0", "s1", "s3", "s4"])}
    assert (
        rows["t0"]["query"] == "Honey bees" and rows["t0"]["positive"] == SELFSUP_DOCS["t0"]["text"]
    )
    for doc_id in ("s0", "s1", "s3", "s4"):
        sentences = selfsup.split_sentences(SELFSUP_DOCS[doc_id])
        query, positive = rows[doc_id]["query"], rows[doc_id]["positive"]
        assert query in sentences and query not in positive
        assert positive == " ".join(s for s in sentences if s != query)
    texts = {d: (v["text"] if isinstance(v, dict) else v) for d, v in SELFSUP_DOCS.items()}
    for doc_id, row in rows.items():
        assert len(set(row["negatives"])) == 2
        assert texts[doc_id] not in row["negatives"]  # never the source document
        assert set(row["negatives"]) <= set(texts.values())
    again = tasks.build_selfsup_examples(config, "train")
    assert again.texts == ex.texts and np.array_equal(again.negatives, ex.negatives)
    random_config = tasks.selfsup_train_source(
        corpus_file=str(folder / "corpus.jsonl"), negatives="random", num_negatives=3, seed=1
    )
    rnd = tasks.build_selfsup_examples(random_config, "train")
    assert rnd.num_negatives == 3 and len(rnd) == 6
    for i, doc_id in enumerate(["t0", "t1", "s0", "s1", "s3", "s4"]):
        assert texts[doc_id] not in rnd.example(i)["negatives"]
    ict_only = tasks.build_selfsup_examples(
        tasks.selfsup_train_source(dataset_dir=str(folder), use_titles=False), "train"
    )
    assert ict_only.stats["title_pairs"] == 0 and len(ict_only) == 6


def test_split_sentences():
    assert selfsup.split_sentences('He said "stop." Then left!  Why? ok') == [
        'He said "stop."',
        "Then left!",
        "Why?",
        "ok",
    ]
    assert selfsup.split_sentences("3.14 is pi. e is 2.71") == ["3.14 is pi.", "e is 2.71"]


# ---------------------------------------------------------------------------------------------
# Gin bindings.


@pytest.mark.parametrize(
    "task, binding",
    [
        (tasks.BEIR_TRAIN_BM25, "beir_train_source.dataset_dir"),
        (tasks.MSMARCO_TRIPLES, "msmarco_train_source.data_dir"),
        (tasks.SELFSUP_PSEUDO_QUERIES, "selfsup_train_source.dataset_dir"),
    ],
)
def test_unset_data_location_names_the_binding(task, binding):
    with pytest.raises(ValueError, match=rf"gin binding {binding}.*--gin\.{binding}="):
        seqio.get_mixture_or_task(task).get_dataset(LENGTHS, shuffle=True, seed=0)


def test_bad_bindings(tmp_path):
    missing = tmp_path / "nope"
    _bind(f"beir_train_source.dataset_dir = '{missing}'")
    with pytest.raises(ValueError, match=r"beir_train_source.dataset_dir=.*does not exist"):
        seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25).get_dataset(LENGTHS)
    with pytest.raises(ValueError, match=r"beir_train_source.num_negatives=-1"):
        tasks.beir_train_source(dataset_dir=str(tmp_path), num_negatives=-1)
    with pytest.raises(ValueError, match=r"beir_train_source.depth=2: expected an integer ≥ 3"):
        tasks.beir_train_source(dataset_dir=str(tmp_path), num_negatives=3, depth=2)
    with pytest.raises(ValueError, match=r"selfsup_train_source.negatives='dense'"):
        tasks.selfsup_train_source(dataset_dir=str(tmp_path), negatives="dense")
    with pytest.raises(ValueError, match=r"selfsup_train_source.dataset_dir=.*corpus.jsonl"):
        tasks.selfsup_train_source(dataset_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"msmarco_train_source.triples_file=.*does not exist"):
        tasks.msmarco_train_source(triples_file=str(missing))
    with pytest.raises(ValueError, match=r"has no split 'test'"):
        seqio.get_mixture_or_task(tasks.SELFSUP_PSEUDO_QUERIES).source.examples("test")


# ---------------------------------------------------------------------------------------------
# Determinism of the input order.


def test_same_seed_same_batches_and_skip_equals_dropping(tmp_path):
    folder, *_ = _topic_corpus(tmp_path)
    _bind(f"beir_train_source.dataset_dir = '{folder}'", "beir_train_source.num_negatives = 1")
    first = _first_batches(tasks.BEIR_TRAIN_BM25, seed=7, batch_size=4, count=8)
    again = _first_batches(tasks.BEIR_TRAIN_BM25, seed=7, batch_size=4, count=8)
    other = _first_batches(tasks.BEIR_TRAIN_BM25, seed=8, batch_size=4, count=8)
    for a, b in zip(first, again, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert any(
        not np.array_equal(a["doc_tokens"], b["doc_tokens"])
        for a, b in zip(first, other, strict=True)
    )
    # 8 batches of 4 = 32 examples > the 18 in the table: the stream repeats (num_epochs=None).
    resumed = _first_batches(tasks.BEIR_TRAIN_BM25, seed=7, batch_size=4, count=5, skip=12)
    for a, b in zip(first[3:], resumed, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_source_epochs_are_seeded_permutations_and_shards_are_disjoint(tmp_path):
    folder, *_ = _topic_corpus(tmp_path)
    _bind(f"beir_train_source.dataset_dir = '{folder}'")
    source = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25).source
    examples = source.examples("train")
    n = len(examples)

    def keys(ds):
        return [(e["query"], e["positive"]) for e in ds.as_numpy_iterator()]

    table = [
        (examples.texts[q].encode(), examples.texts[p].encode())
        for q, p in zip(examples.query, examples.positive, strict=True)
    ]
    assert keys(source.get_dataset("train", shuffle=False)) == table
    stream = keys(source.get_dataset("train", shuffle=True, seed=3).repeat(3))
    epochs = [stream[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == sorted(table) for e in epochs)
    assert epochs[0] != table and epochs[0] != epochs[1]
    assert keys(source.get_dataset("train", shuffle=True, seed=3).repeat(3)) == stream
    shards = [
        keys(source.get_dataset("train", shuffle=False, shard_info=seqio.ShardInfo(i, 2)))
        for i in range(2)
    ]
    assert shards[0] == table[0::2] and shards[1] == table[1::2]


def test_random_negative_draws_do_not_depend_on_query_order():
    doc_ids = [f"d{i}" for i in range(50)]
    positives = {"a": ["d1"], "b": ["d2", "d3"], "c": []}
    forward = negatives.random_negatives(doc_ids, positives, 4, seed=2)
    backward = negatives.random_negatives(doc_ids, dict(reversed(positives.items())), 4, seed=2)
    assert forward == backward
    assert all(len(set(v)) == 4 and not set(v) & set(positives[k]) for k, v in forward.items())
    assert negatives.random_negatives(doc_ids, positives, 4, seed=3) != forward
    with pytest.raises(ValueError, match=r"only 48 of the 50 documents"):
        negatives.random_negatives(doc_ids, {"b": ["d2", "d3"]}, 49, seed=0)


def test_registry_holds_the_three_tasks():
    for name in tasks.TASK_NAMES:
        task = seqio.get_mixture_or_task(name)
        assert set(task.output_features) == {"query", "doc", "doc_keys", "relevant_keys"}
        assert task.output_features["doc"].rank == 2 and not task.output_features["doc"].add_eos
    assert features.DEFAULT_TASK_FEATURE_LENGTHS == {"query": 64, "doc": 256}
    names = tasks.register_retrieval_tasks(tasks.WordPieceVocabulary(), suffix="_minilm")
    assert names == [n + "_minilm" for n in tasks.TASK_NAMES]
    for name in names:
        assert isinstance(
            seqio.get_mixture_or_task(name).output_features["query"].vocabulary,
            tasks.WordPieceVocabulary,
        )
        seqio.TaskRegistry.remove(name)
    assert msmarco.TEXT_TRIPLES == "triples.train.small.tsv"


def test_documents_carry_content_keys_and_each_query_its_relevant_documents_keys(tmp_path):
    """What lets the loss leave false negatives out: a query judging two documents relevant has
    two examples, and each names both documents' keys as relevant (its own positive included)."""
    folder, docs, queries, qrels = _topic_corpus(tmp_path)
    _bind(f"beir_train_source.dataset_dir = '{folder}'", "beir_train_source.num_negatives = 2")
    ds = seqio.get_dataset(tasks.BEIR_TRAIN_BM25, LENGTHS, tasks.AlignerFeatureConverter())
    batch = next(tasks.batches_as_numpy(ds, 6))
    examples = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25).source.examples("train")
    assert batch["doc_keys"].shape == (6, 3) and batch["doc_keys"].dtype == np.int32
    assert batch["relevant_keys"].shape == (6, sources.MAX_RELEVANT)
    text_of = {f"{d['title']} {d['text']}": i for i, d in docs.items()}
    key_of = {i: k for i, k in zip(docs, sources.text_keys(list(text_of)), strict=True)}
    for i in range(6):
        ex = examples.example(i)
        ids = [text_of[t] for t in [ex["positive"], *ex["negatives"]]]
        np.testing.assert_array_equal(batch["doc_keys"][i], [key_of[d] for d in ids])
        query_id = next(q for q, text in queries.items() if text == ex["query"])
        relevant = sorted(key_of[d] for d, r in qrels[query_id].items() if r > 0)
        row = batch["relevant_keys"][i]
        assert sorted(row[row > 0]) == relevant and (row[len(relevant) :] == 0).all()
    assert len(set(batch["relevant_keys"][0]) - {0}) == 2  # q0 judges d0 and d1 relevant


def test_relevant_documents_past_the_limit_are_counted(tmp_path, monkeypatch, caplog):
    folder, *_ = _topic_corpus(tmp_path)
    monkeypatch.setattr(sources, "MAX_RELEVANT", 1)
    _bind(f"beir_train_source.dataset_dir = '{folder}'")
    examples = seqio.get_mixture_or_task(tasks.BEIR_TRAIN_BM25).source.examples("train")
    assert examples.stats["relevant_keys_cut"] == 6  # q0, q4, …, q20 each judge two documents
    assert "6 relevant documents" in caplog.text
    # What is kept is each row's own positive, whichever of the query's documents it is.
    ds = seqio.get_dataset(tasks.BEIR_TRAIN_BM25, LENGTHS, tasks.AlignerFeatureConverter())
    batch = next(tasks.batches_as_numpy(ds, len(examples)))
    assert batch["relevant_keys"].shape == (len(examples), 1)
    np.testing.assert_array_equal(batch["relevant_keys"][:, 0], batch["doc_keys"][:, 0])


def test_supervised_and_selfsup_mixture(tmp_path):
    folder = fixtures.write_toy_beir(tmp_path, split="train")
    _bind(
        f"beir_train_source.dataset_dir = '{folder}'",
        f"selfsup_train_source.dataset_dir = '{folder}'",
        "supervised_rate.supervised_fraction = 0.5",
    )
    assert tasks.retrieval_tasks.BEIR_TRAIN_AND_SELFSUP in seqio.MixtureRegistry.names()
    batches = _first_batches(tasks.retrieval_tasks.BEIR_TRAIN_AND_SELFSUP, 0, 4, 6)
    again = _first_batches(tasks.retrieval_tasks.BEIR_TRAIN_AND_SELFSUP, 0, 4, 6)
    for a, b in zip(batches, again, strict=True):  # deterministic given the seed
        np.testing.assert_array_equal(a["query_tokens"], b["query_tokens"])
    # The content keys survive the mixture (seqio keeps only declared features there).
    assert batches[0]["doc_keys"].shape == (4, 2) and (batches[0]["relevant_keys"] > 0).any()
    # Both sources contribute: toy train queries and pseudo-queries (document titles).
    vocab = tasks.WordPieceVocabulary()
    queries = {
        vocab.decode([t for t in row if t not in (0, 101, 102)])
        for batch in batches
        for row in batch["query_tokens"]
    }
    titles = {d["title"].lower() for d in fixtures.TOY_DOCS.values()}
    assert queries & titles and queries - titles
    _bind("supervised_rate.supervised_fraction = 1.0")
    with pytest.raises(ValueError, match="supervised_fraction=1.0"):
        tasks.retrieval_tasks.supervised_rate()
