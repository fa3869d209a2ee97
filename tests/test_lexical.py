"""miniCOIL (aligner_jax/lexical): word analysis, meaning models, triplets, the sparse index.

Tiny corpora and the tiny random BERT of models/bert_tiny.gin: a few seconds in all.
"""

from __future__ import annotations

import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from aligner_jax.common import cli
from aligner_jax.common.errors import ConfigError, IndexIntegrityError
from aligner_jax.data.bm25 import BM25Index
from aligner_jax.encoding import loading, tokenization
from aligner_jax.encoding.encoder import Encoder
from aligner_jax.lexical import meaning, minicoil, triplets, words
from aligner_jax.lexical.minicoil import MiniCoilConfig, MiniCoilIndex
from aligner_jax.weights import minilm

TEXTS = [
    "The fruit bat sleeps in a cave. Bats eat fruit at night!",
    "A baseball bat is made of wood; the player swings the bat.",
    "The river bank was flooded. Fish swim near the bank of the river.",
    "The bank approved the loan. Money was deposited in the bank account.",
    "Vampire bats drink blood? Bats fly at night in the cave.",
    "The player hit the ball with a wooden bat and ran.",
    "Loans and deposits: the bank's money and the river's water.",
    "İstanbul's COVID-19 data (2020) were re-analysed — twice.",
]
IDS = [f"d{i}" for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def encoder():
    gin.clear_config()
    try:
        cli.parse_gin(["models/bert_tiny.gin"])
        return Encoder(loading.load_encoder())
    finally:
        gin.clear_config()


def _constant_models(encoder, index_words, dim=4) -> meaning.MeaningModels:
    """Every word's meaning vector is the same unit vector whatever the context."""
    v = len(index_words)
    return meaning.MeaningModels(
        words=list(index_words),
        weight=np.zeros((v, encoder.dim, dim), np.float32),
        bias=np.ones((v, dim), np.float32),
        encoder_fingerprint=encoder.bundle.fingerprint(),
    )


# ---------------------------------------------------------------------- words


def test_analysis_is_bm25s_analysis():
    bm25 = BM25Index.build(IDS, TEXTS)
    analyzer = words.Analyzer()
    assert [analyzer.stems(t) for t in TEXTS] == bm25.tokenize(TEXTS)
    for text in TEXTS:
        for w in analyzer.analyze(text):  # spans point at the word (any case)
            token = text[w.start : w.end].lower()
            assert words.Analyzer().stems(token) == [w.stem], (text, w)


def test_words_of_a_text_are_the_words_of_its_sentences():
    analyzer = words.Analyzer()
    for text in TEXTS:
        spans = words.sentence_spans(text)
        assert len(spans) >= 1
        joined = [s for a, b in spans for s in analyzer.stems(text[a:b])]
        assert joined == analyzer.stems(text)
    assert words.sentence_spans("One. Two! Three? four") == [(0, 4), (5, 9), (10, 16), (17, 21)]


def test_word_pieces_of_a_word_are_averaged_over_its_pieces():
    tok = tokenization.Tokenizer(minilm.minilm_model_dir() / "tokenizer.json")
    text = "tokenization of retrievers"
    ids, offsets = tok.encode_pieces_with_offsets([text])[0]
    pieces = tok.ids_to_tokens(ids)
    found = words.Analyzer().analyze(text)
    assert [w.stem for w in found] == ["token", "retriev"]
    positions = words.pieces_of_words(offsets, [(w.start, w.end) for w in found])
    assert "".join(pieces[i].removeprefix("##") for i in positions[0]) == "tokenization"
    assert "".join(pieces[i].removeprefix("##") for i in positions[1]) == "retrievers"


def test_snippet_holds_the_word_and_four_to_six_tokens():
    text = "one two three four five six seven eight nine ten eleven"
    rng = np.random.default_rng(0)
    for _ in range(50):
        start = text.index("six")
        lo, hi = words.snippet_span(text, (start, start + 3), rng)
        snippet = text[lo:hi]
        assert "six" in snippet.split()
        assert 4 <= len(snippet.split()) <= 6
    assert words.snippet_span("lonely", (0, 6), rng) == (0, 6)


# ---------------------------------------------------------------------- meaning models


def test_meaning_vectors_shapes_and_range():
    params = meaning.init_params(jax.random.PRNGKey(0), 3, 8, 4)
    assert params["weight"].shape == (3, 8, 4) and params["bias"].shape == (3, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 8))
    m = meaning.meaning_vectors(params["weight"][0], params["bias"][0], x)
    assert m.shape == (5, 4) and float(jnp.max(jnp.abs(m))) <= 1.0
    u = np.asarray(meaning.apply(params["weight"], params["bias"], np.array([0, 2, 1, 0, 2]), x))
    np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, rtol=1e-5)


def test_triplet_loss_value_and_accuracy():
    # dim 2, identity-like weights: examples map to known directions (tanh of large values → ±1).
    params_w = {"weight": jnp.eye(2) * 20.0, "bias": jnp.zeros(2)}
    examples = jnp.array([[1.0, 0.0], [1.0, 0.1], [-1.0, 0.0], [0.0, 1.0]])
    t = jnp.array([[0, 1, 2], [0, 2, 1], [0, 3, 2]])
    margins = jnp.array([0.1, 0.1, 0.1])
    loss, correct = meaning.word_triplet_terms(
        params_w, examples, t, margins, jnp.array([True, True, False])
    )
    m = np.tanh(np.asarray(examples) * 20.0)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    d = lambda i, j: 1 - m[i] @ m[j]  # noqa: E731
    expected = max(0, d(0, 1) - d(0, 2) + 0.1) + max(0, d(0, 2) - d(0, 1) + 0.1)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(correct) == 1.0  # the masked third triplet does not count


def test_vmapped_step_decreases_loss_and_words_are_independent():
    rng = np.random.default_rng(0)
    num_words, size, dim_in = 3, 12, 6
    # Two senses per word: examples near +c or −c; triplets: anchor/positive same sense.
    centres = rng.normal(size=(num_words, dim_in))
    sense = rng.integers(0, 2, size=(num_words, size))
    examples = (
        np.where(sense[..., None] == 1, 1, -1) * centres[:, None, :]
        + 0.3 * rng.normal(size=(num_words, size, dim_in))
    ).astype(np.float32)
    t = np.zeros((num_words, 20, 3), np.int32)
    for v in range(num_words):
        for i in range(20):
            a = rng.integers(size)
            same = np.flatnonzero((sense[v] == sense[v, a]) & (np.arange(size) != a))
            other = np.flatnonzero(sense[v] != sense[v, a])
            t[v, i] = a, rng.choice(same), rng.choice(other)
    batch = {
        "examples": jnp.asarray(examples),
        "triplets": jnp.asarray(t),
        "margins": jnp.full((num_words, 20), 0.5),
        "mask": jnp.ones((num_words, 20), bool),
    }
    params = meaning.init_params(jax.random.PRNGKey(0), num_words, dim_in, 4)
    optimizer = optax.adam(0.05)
    state = optimizer.init(params)
    step = meaning.make_train_step(optimizer)
    first, _ = meaning.triplet_loss(params, batch)
    init = params
    for _ in range(60):
        params, state, loss, accuracy = step(params, state, batch)
    assert float(loss) < 0.5 * float(first)
    assert float(accuracy) > 0.9
    # Word 0's gradient does not depend on word 1's data.
    grads = jax.grad(lambda p, b: meaning.triplet_loss(p, b)[0])
    other = dict(batch, examples=batch["examples"].at[1].multiply(-3.0))
    g1, g2 = grads(init, batch), grads(init, other)
    np.testing.assert_allclose(g1["weight"][0], g2["weight"][0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(g1["weight"][1], g2["weight"][1])


def test_fit_reports_validation_accuracy():
    rng = np.random.default_rng(1)
    examples = rng.normal(size=(2, 8, 5)).astype(np.float32)
    t = rng.integers(0, 8, size=(2, 6, 3)).astype(np.int32)
    batch = {
        "examples": examples,
        "triplets": t,
        "margins": np.full((2, 6), 0.2, np.float32),
        "mask": np.ones((2, 6), bool),
    }
    params, report = meaning.fit(
        batch, dim=4, steps=3, learning_rate=0.01, seed=0, validation=batch
    )
    assert params["weight"].shape == (2, 5, 4)
    assert 0.0 <= report["validation_triplet_accuracy"] <= 1.0
    assert report["words"] == 2 and report["steps"] == 3 and report["words_per_s"] > 0


def test_shared_reduction_is_the_top_principal_directions():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)) * np.array([5.0, 3.0, 1.0, 0.1, 0.1, 0.1]) + 2.0
    center, basis = meaning.fit_reduction(x.astype(np.float32), 2)
    np.testing.assert_allclose(basis.T @ basis, np.eye(2), atol=1e-5)
    np.testing.assert_allclose(np.abs(basis[:2]), np.eye(2), atol=0.1)
    np.testing.assert_allclose(center, x.mean(axis=0), rtol=1e-5)
    assert meaning.reduce_inputs(x, center, basis).shape == (200, 2)


# ---------------------------------------------------------------------- triplets


def test_mined_triplets_follow_the_teacher_with_margin():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(10, 16))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    sim = e @ e.T
    t, m = triplets.mine_word_triplets(sim, 40, 0.1, rng)
    assert len(t) > 0 and len(np.unique(t, axis=0)) == len(t)
    assert np.all(m > 0.1)
    a, p, n = t.T
    assert np.all(sim[a, p] > sim[a, n])
    np.testing.assert_allclose(m, sim[a, p] - sim[a, n], rtol=1e-6)
    assert triplets.mine_word_triplets(sim[:2, :2], 10, 0.1, rng)[0].shape == (0, 3)


def test_train_and_validation_sentences_are_disjoint():
    train, val = triplets.split_sentences(20, 0.2, np.random.default_rng(0))
    assert len(val) == 4 and not set(train) & set(val) and len(train) + len(val) == 20
    assert len(triplets.split_sentences(10, 0.2, np.random.default_rng(0))[1]) == 0


# ---------------------------------------------------------------------- the index


def test_config_ranges_name_the_field():
    with pytest.raises(
        ConfigError, match=r"--gin.MiniCoilConfig.dim=5: choose one of \[4, 8, 16\]"
    ):
        MiniCoilConfig(dim=5)
    with pytest.raises(ConfigError, match=r"--gin.MiniCoilConfig.margin=0.05: must be in"):
        MiniCoilConfig(margin=0.05)
    with pytest.raises(ConfigError, match=r"--gin.MiniCoilConfig.b=1.5"):
        MiniCoilConfig(b=1.5)
    with pytest.raises(ConfigError, match=r"--gin.MiniCoilConfig.teacher='mxbai'"):
        MiniCoilConfig(teacher="mxbai")
    with pytest.raises(ConfigError, match=r"--gin.MiniCoilConfig.meaning='max'"):
        MiniCoilConfig(meaning="max")
    assert MiniCoilConfig(dim=16).dim == 16


@pytest.fixture(scope="module")
def constant_index(encoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "constant.safetensors"
    vocab = sorted({s for t in TEXTS for s in words.Analyzer().stems(t) if len(s) >= 3})
    _constant_models(encoder, vocab).save(path)
    return MiniCoilIndex.build(IDS, TEXTS, encoder, MiniCoilConfig(), models_path=str(path))


def test_equal_meanings_reduce_to_bm25(constant_index):
    queries = {
        "q1": "fruit bats in caves",
        "q2": "bank loan bank",
        "q3": "COVID-19 data",
        "q4": "zebra",
    }
    bm25 = BM25Index.build(IDS, TEXTS, k1=1.2, b=0.75).search(queries, 5)
    ours = constant_index.search(queries, 5)
    assert set(ours) == set(bm25)
    for qid in queries:
        assert list(ours[qid]) == list(bm25[qid]), qid
        np.testing.assert_allclose(list(ours[qid].values()), list(bm25[qid].values()), rtol=1e-5)
    assert ours["q4"] == {}
    assert constant_index.report["num_words_with_model"] > 0


@pytest.fixture(scope="module")
def fitted_index(encoder):
    config = MiniCoilConfig(
        min_sentences=4,
        sentences_per_word=8,
        validation_fraction=0.5,
        steps=5,
        teacher="encoder",
        triplets_per_word=16,
        input_rank=8,  # the tiny encoder's vectors are 16-d: the shared reduction is used
    )
    return MiniCoilIndex.build(IDS, TEXTS, encoder, config)


def test_fitting_on_the_corpus_reports_its_cost(fitted_index):
    fit = fitted_index.report["fit"]
    assert fit["words"] == fitted_index.report["num_words_with_model"] > 0
    assert fit["sentences"] > 0 and fit["snippets"] > 0 and fit["steps"] == 5
    assert "validation_triplet_accuracy" in fit
    models = fitted_index.models
    assert models.basis.shape == (16, 8) and models.weight.shape[1:] == (8, 4)
    assert models.input_dim == 16
    # every word with a model owns `dim` + 1 consecutive cells (nonnegative meaning), the others one
    widths = np.diff(fitted_index.cell_offset)
    assert set(widths[fitted_index.model_of_stem >= 0]) == {4 + 1}
    assert set(widths[fitted_index.model_of_stem < 0]) <= {1}
    assert fitted_index.doc_matrix.shape == (len(TEXTS), fitted_index.cell_offset[-1])
    assert fitted_index.idf.shape == (fitted_index.cell_offset[-1],)


def test_search_scores_are_the_sparse_product(fitted_index):
    texts = ["bat cave at night", "the bank of the river", "money"]
    q = fitted_index.query_matrix(texts)
    product = (q.multiply(fitted_index.idf[None, :]) @ fitted_index.doc_matrix.T).toarray()
    results = fitted_index.search({f"q{i}": t for i, t in enumerate(texts)}, 3)
    for i in range(len(texts)):
        got = results[f"q{i}"]
        assert 0 < len(got) <= 3
        for doc_id, score in got.items():
            np.testing.assert_allclose(score, product[i, IDS.index(doc_id)], rtol=1e-5)
        scores = list(got.values())
        assert scores == sorted(scores, reverse=True)


def _dense_bm25(texts):
    """Plain BM25 (k1 1.2, b 0.75) of every query against every document, [queries, docs]."""
    index = BM25Index.build(IDS, TEXTS, k1=1.2, b=0.75)
    results = index.search({f"q{i}": t for i, t in enumerate(texts)}, len(TEXTS))
    out = np.zeros((len(texts), len(TEXTS)))
    for i in range(len(texts)):
        for doc_id, score in results[f"q{i}"].items():
            out[i, IDS.index(doc_id)] = score
    return out


def test_nonnegative_meaning_is_never_a_penalty(fitted_index, encoder, tmp_path):
    """Default Meaning = (1 + cos) / 2: every score lies in [0, BM25] and equals the mean of the
    article's cosine score and plain BM25's; with ``meaning="cosine"`` some shared words whose
    meanings disagree subtract (a score below zero, which the old default allowed)."""
    assert MiniCoilConfig().meaning == "nonnegative" == fitted_index.config.meaning
    path = tmp_path / "models.safetensors"
    fitted_index.models.save(path)
    cosine = MiniCoilIndex.build(
        IDS, TEXTS, encoder, MiniCoilConfig(meaning="cosine"), models_path=str(path)
    )
    assert set(np.diff(cosine.cell_offset)[cosine.model_of_stem >= 0]) == {4}
    texts = [t.split(".")[0] for t in TEXTS] + ["bat cave at night", "the bank of the river"]
    ours, matches = fitted_index.scores(texts)
    theirs, _ = cosine.scores(texts)
    bm25 = _dense_bm25(texts)
    np.testing.assert_allclose(ours, 0.5 * (bm25 + theirs), rtol=1e-5, atol=1e-5)
    assert np.all(ours >= -1e-6) and np.all(ours <= bm25 + 1e-5)
    assert (theirs < -1e-4).any()  # the cosine form does penalise some matches here
    assert matches.nnz > 0
    # A word whose query and document meanings are opposite contributes exactly 0.
    m = np.array([[0.6, 0.8, 0.0, 0.0]], np.float32)
    cells = minicoil.meaning_cells(m, "nonnegative")
    assert cells.shape == (1, 5)
    np.testing.assert_allclose(cells @ minicoil.meaning_cells(-m, "nonnegative").T, 0.0, atol=1e-7)
    np.testing.assert_allclose(cells @ cells.T, 1.0, rtol=1e-6)
    np.testing.assert_array_equal(minicoil.meaning_cells(m, "cosine"), m)


def test_index_saved_before_meaning_existed_loads_as_cosine(fitted_index, encoder, tmp_path):
    path = fitted_index.save(tmp_path / "mc")
    manifest = json.loads((path / "minicoil.json").read_text())
    del manifest["config"]["meaning"]
    (path / "minicoil.json").write_text(json.dumps(manifest))
    assert MiniCoilIndex.load(path, encoder=encoder).config.meaning == "cosine"


def test_save_load_round_trip_and_integrity(fitted_index, encoder, tmp_path):
    fitted_index.save(tmp_path / "mc")
    loaded = MiniCoilIndex.load(tmp_path / "mc", encoder=encoder)
    queries = {"a": "fruit bat", "b": "river bank fish"}
    assert loaded.search(queries, 4) == fitted_index.search(queries, 4)
    assert (loaded.doc_matrix != fitted_index.doc_matrix).nnz == 0
    np.testing.assert_array_equal(loaded.idf, fitted_index.idf)
    with open(tmp_path / "mc" / "idf.npy", "ab") as f:
        f.write(b"x")
    with pytest.raises(IndexIntegrityError, match="idf.npy"):
        MiniCoilIndex.load(tmp_path / "mc", encoder=encoder)


def test_saved_models_are_reused_and_checked(fitted_index, encoder, tmp_path):
    path = tmp_path / "models.safetensors"
    fitted_index.models.save(path)
    loaded = meaning.MeaningModels.load(path)
    np.testing.assert_array_equal(loaded.basis, fitted_index.models.basis)
    again = MiniCoilIndex.build(IDS, TEXTS, encoder, MiniCoilConfig(), models_path=str(path))
    np.testing.assert_allclose(
        again.doc_matrix.toarray(), fitted_index.doc_matrix.toarray(), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ConfigError, match="MiniCoilConfig.dim=8"):
        MiniCoilIndex.build(IDS, TEXTS, encoder, MiniCoilConfig(dim=8), models_path=str(path))


def test_a_pluggable_teacher_is_used(encoder):
    calls = []

    def teacher(texts):
        calls.append(len(texts))
        return np.random.default_rng(0).normal(size=(len(texts), 7))

    config = MiniCoilConfig(min_sentences=4, sentences_per_word=8, steps=2, augment=False)
    index = MiniCoilIndex.build(IDS, TEXTS, encoder, config, teacher=teacher)
    assert calls and index.report["fit"]["teacher"] == "teacher"
    assert index.report["fit"]["snippets"] == 0


def test_default_teacher_is_minilm_mean_pooled():
    from aligner_jax.lexical.teacher import MeanPooledTeacher

    e = MeanPooledTeacher()(
        ["The fruit bat sleeps in a cave.", "Bats sleep in caves.", "Stock markets fell today."]
    )
    assert e.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2
