"""aligner-explain: saliences and alignments of one query–document pair as an HTML page (§4.4)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import gin
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import run_module, write_toy_beir

from aligner_jax.common import cli, errors
from aligner_jax.core import scoring
from aligner_jax.data import beir
from aligner_jax.encoding import loading, tokenization
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.evaluation import explanation, explanation_html

REPO = Path(__file__).resolve().parent.parent

QUERY = "Does tokenization handle <script>alert(1)</script> tags?"
DOC = "Tokenization splits words into pieces; a <script> tag & other markup must be escaped."


@pytest.fixture(scope="module")
def identity():
    """The bundled MiniLM (identity projection, u = 1) and one explanation: two encodes."""
    gin.clear_config()
    cli.parse_gin(["models/minilm_identity.gin"])
    bundle = loading.load_encoder()
    gin.clear_config()
    ex = explanation.explain(bundle, QUERY, DOC, alignment="top_k:1", num_aligned=3)
    return bundle, ex, explanation_html.render_html(ex)


def _section(page: str, element_id: str) -> str:
    match = re.search(rf'<(div|table) [^>]*id="{element_id}">(.*?)</\1>', page, re.S)
    assert match, element_id
    return match.group(2)


def _span_texts(fragment: str) -> list[str]:
    return [
        html.unescape(t) for t in re.findall(r'<span class="w[^"]*"[^>]*>(.*?)</span>', fragment)
    ]


def test_words_merge_word_pieces_and_keep_original_spelling(identity):
    _, ex, page = identity
    words = {w.text: w for w in ex.query_words}
    assert words["tokenization"].pieces == ("token", "##ization")
    assert len(words["tokenization"].positions) == 2
    assert [w.text for w in ex.doc_words][:2] == ["[CLS]", "Tokenization"]  # case kept
    assert ex.query_words[0].special and ex.query_words[-1].special
    assert ex.query_words[-1].text == "[SEP]"
    query_spans = _span_texts(_section(page, "query"))
    doc_spans = _span_texts(_section(page, "document"))
    assert "tokenization" in query_spans and "Tokenization" in doc_spans
    assert not any(t.startswith("##") for t in query_spans + doc_spans)
    assert query_spans[0] == "[CLS]" and query_spans[-1] == "[SEP]"
    assert re.search(r'class="w special[^"]*"[^>]*>\[CLS\]<', page)
    # Every encoded token belongs to exactly one word.
    positions = sorted(p for w in ex.doc_words for p in w.positions)
    assert positions == list(range(len(ex.doc_encoded.token_ids)))


def test_top1_alignments_are_the_argmax_similarity_words(identity):
    bundle, ex, page = identity
    q, d = ex.query_encoded, ex.doc_encoded
    s = q.vectors @ d.vectors.T  # direct computation from the encoder outputs
    doc_tokens = bundle.tokenizer.ids_to_tokens(d.token_ids)
    word_at = {}
    for index, (_, positions) in enumerate(tokenization.merge_wordpieces(doc_tokens)):
        for p in positions:
            word_at[p] = index
    assert len(ex.alignments) == len(q.token_ids)  # top-1: one alignment per query token
    for a in ex.alignments:
        j = int(np.argmax(s[a.query_position]))
        assert a.doc_position == j and a.rank == 1
        assert a.doc_word == word_at[j]
        np.testing.assert_allclose(a.similarity, s[a.query_position, j], rtol=1e-5, atol=1e-6)
    # The listed rows of the most salient words name those argmax words.
    assert len(ex.top_query_words) == 3
    table = _section(page, "top-alignments")
    for k in ex.top_query_words:
        (a,) = ex.word_alignments(k)
        assert a.query_position == ex.query_words[k].representative
        assert html.escape(ex.doc_words[word_at[a.doc_position]].text) in table
        assert f"{a.similarity:.4f}" in table
    assert "minilm/identity/none" in page
    assert ex.uniform_salience and 'class="note"' in page


def test_score_is_eq1_on_the_same_vectors(identity):
    _, ex, page = identity
    q, d = ex.query_encoded, ex.doc_encoded
    s = q.vectors @ d.vectors.T
    expected = scoring.alignment_scores(
        s, np.ones(len(q.salience), bool), np.ones(len(d.salience), bool), "top_k:1",
        q.salience, d.salience,
    )  # fmt: skip
    assert ex.score == pytest.approx(float(expected), abs=1e-6)
    # The listed alignments reproduce the score: Σ S·A / Σ A.
    num = sum(a.similarity * a.weight for a in ex.alignments)
    assert ex.score == pytest.approx(num / sum(a.weight for a in ex.alignments), abs=1e-5)
    assert f"{ex.score:.6f}" in page


def test_text_is_html_escaped(identity):
    _, _, page = identity
    assert "<script" not in page.lower()  # neither the user's markup nor any script of ours
    assert "&lt;" in _section(page, "query") and "&gt;" in _section(page, "query")
    assert "&amp;" in _section(page, "document")
    assert "http://" not in page and "https://" not in page and "src=" not in page


def test_a_document_id_in_the_element_ids_is_escaped(identity):
    """The server's fragments prefix element ids with the document id, which may hold quotes
    and brackets (ids only forbid whitespace): it was written raw, so an id added over HTTP ran
    script on the search page, which sets the fragment as innerHTML."""
    _, ex, _ = identity
    doc_id = 'x"><img/src=x/onerror=alert(1)>'
    fragment = explanation_html.render_fragment(ex, id_prefix=f"{doc_id}-")
    assert "<img" not in fragment and "onerror=alert(1)>-query" not in fragment
    assert 'id="x&quot;&gt;&lt;img/src=x/onerror=alert(1)&gt;-query"' in fragment


def test_salience_color_maps_unit_interval():
    assert explanation_html.salience_color(0.0) == "rgba(255, 193, 7, 0.000)"
    assert explanation_html.salience_color(1.0) == "rgba(255, 193, 7, 0.850)"
    assert explanation_html.salience_color(0.5) == "rgba(255, 193, 7, 0.425)"
    assert explanation_html.salience_color(-3.0) == explanation_html.salience_color(0.0)
    assert explanation_html.salience_color(7.0) == explanation_html.salience_color(1.0)
    with pytest.raises(ValueError, match="NaN"):
        explanation_html.salience_color(float("nan"))


def _fake_pair(alignment: str, num_aligned: int = 2):
    """Crafted vectors and saliences on the real tokenizer (no model)."""
    tok = loading.load_tokenizer("minilm")
    query = explanation.tokenize_text(tok, "alpha beta gamma delta", 64)  # [CLS] α β γ δ [SEP]
    doc = explanation.tokenize_text(
        tok, "tokenization rocks", 256
    )  # [CLS] token ##ization rocks [SEP]
    d_vectors = np.eye(5, dtype=np.float32)  # doc token j = e_j, so S_ij = q_i[j]
    q_vectors = np.full((6, 5), 0.01, np.float32)
    q_vectors[2] = [0.0, 0.2, 0.9, 0.5, 0.0]  # beta: ##ization (0.9), then rocks (0.5)
    q_vectors[3] = [0.0, 0.8, 0.1, 0.0, 0.3]  # gamma: token (0.8), then [SEP] (0.3)
    q_enc = EncodedText(
        query.token_ids, q_vectors, np.array([0.0, 0.2, 1.0, 0.5, 0.0, 0.0], np.float32)
    )
    d_enc = EncodedText(doc.token_ids, d_vectors, np.array([0, 0.1, 0.7, 0.3, 0], np.float32))
    return explanation.explain_encoded(
        query, doc, q_enc, d_enc, alignment=alignment, num_aligned=num_aligned, model_name="fake"
    )


def test_saliences_highlights_and_ranks_on_crafted_pair():
    ex = _fake_pair("top_k:2")
    page = explanation_html.render_html(ex)
    q = {w.text: w for w in ex.query_words}
    d = {w.text: w for w in ex.doc_words}
    assert [q[t].salience for t in ("alpha", "beta", "gamma", "delta")] == pytest.approx(
        [0.2, 1.0, 0.5, 0.0]
    )
    # β^q = 50% of 6 tokens = 3 (beta 1.0, gamma 0.5, alpha 0.2); β^d = 20% of 5 = 1.
    assert [w.text for w in ex.query_words if w.highlighted] == ["alpha", "beta", "gamma"]
    assert [w.text for w in ex.doc_words if w.highlighted] == ["tokenization"]
    assert d["tokenization"].salience == pytest.approx(0.7)  # max of its pieces (0.1, 0.7)
    assert d["tokenization"].representative == 2
    assert [ex.query_words[k].text for k in ex.top_query_words] == ["beta", "gamma"]
    # Colours: intensity relative to the most salient word of the text.
    for word, intensity in (("beta", 1.0), ("gamma", 0.5), ("alpha", 0.2), ("delta", 0.0)):
        span = re.search(rf'<span class="w[^"]*" style="([^"]*)"[^>]*>{word}</span>', page)
        assert explanation_html.salience_color(intensity) in span.group(1), word
    span = re.search(r'<span class="w[^"]*" style="([^"]*)"[^>]*>rocks</span>', page)
    assert explanation_html.salience_color(0.3 / 0.7) in span.group(1)
    # top-2 ranks by S: beta → tokenization (1), rocks (2); gamma → tokenization (1), [SEP] (2).
    beta = ex.word_alignments(ex.top_query_words[0])
    assert [(ex.doc_words[a.doc_word].text, a.rank) for a in beta] == [
        ("tokenization", 1),
        ("rocks", 2),
    ]
    assert [a.similarity for a in beta] == pytest.approx([0.9, 0.5])
    gamma = ex.word_alignments(ex.top_query_words[1])
    assert [(ex.doc_words[a.doc_word].text, a.rank) for a in gamma] == [
        ("tokenization", 1),
        ("[SEP]", 2),
    ]
    assert gamma[0].doc_position == 1  # the "token" piece, not "##ization"
    rocks = re.search(r">rocks</span>(<sup[^>]*>\(\d\)</sup>)+", page)
    assert rocks and "(2)" in rocks.group(0)
    assert not ex.uniform_salience and 'class="note"' not in page
    expected = scoring.alignment_scores(
        ex.similarity, np.ones(6, bool), np.ones(5, bool), "top_k:2",
        ex.query_encoded.salience, ex.doc_encoded.salience,
    )  # fmt: skip
    assert ex.score == pytest.approx(float(expected), abs=1e-6)
    summary = explanation_html.format_summary(ex)
    assert "'beta' (u=1.000) -> 'tokenization'(1) S=0.900, 'rocks'(2) S=0.500" in summary


@pytest.mark.parametrize(
    "alignment", ["top_p:0.5", "top_k:9", "coil", "differentiable:k=2,epsilon=0.1"]
)
def test_other_strategies_score_and_list_their_alignments(alignment):
    ex = _fake_pair(alignment)
    expected = scoring.alignment_scores(
        ex.similarity, np.ones(6, bool), np.ones(5, bool), alignment,
        ex.query_encoded.salience, ex.doc_encoded.salience,
        ex.query.token_ids, ex.doc.token_ids,
    )  # fmt: skip
    assert ex.score == pytest.approx(float(expected), abs=1e-6)
    weights = sum(a.weight for a in ex.alignments)
    listed = sum(a.similarity * a.weight for a in ex.alignments) / weights if weights else 0.0
    assert ex.score == pytest.approx(listed, abs=1e-5)
    per_row = {"top_p:0.5": 2, "top_k:9": 5}.get(alignment)  # max(⌊0.5·5⌋, 1); min(9, m)
    if per_row:
        assert len(ex.alignments) == 6 * per_row
    if alignment == "coil":  # exact token-id matches only: none between these texts
        assert ex.alignments == () or all(
            ex.query.token_ids[a.query_position] == ex.doc.token_ids[a.doc_position]
            for a in ex.alignments
        )
    assert f"{ex.score:.6f}" in explanation_html.render_html(ex)


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match=r"--gin\.SearchConfig\.beta_q"):
        explanation.explain_encoded(*_fake_inputs(), beta_q=1.5)
    with pytest.raises(ValueError, match="--num_aligned"):
        explanation.explain_encoded(*_fake_inputs(), num_aligned=-1)
    with pytest.raises(ValueError, match="Invalid alignment strategy 'top_q:3'"):
        explanation.explain_encoded(*_fake_inputs(), alignment="top_q:3")


def _fake_inputs():
    ex = _fake_pair("top_k:1")
    return ex.query, ex.doc, ex.query_encoded, ex.doc_encoded


def test_unknown_ids_name_the_id_and_file(tmp_path):
    data = write_toy_beir(tmp_path)
    query_text, doc_text = beir.load_pair(data, "q1", "d1")
    assert query_text == "honey bees in the hive"
    assert doc_text.startswith("Honey bees Honey bees collect nectar")  # title + text
    with pytest.raises(errors.BeirFormatError, match=r"--query_id='nope'.*queries\.jsonl"):
        beir.load_pair(data, "nope", "d1")
    with pytest.raises(errors.BeirFormatError, match=r"--doc_id='d99'.*corpus\.jsonl.*12 doc"):
        beir.load_pair(data, "q1", "d99")


def _run_binary(*args):
    return run_module("aligner_jax.explain", *args, timeout=300)


def test_binary_writes_page_end_to_end(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    out = tmp_path / "pages" / "explanation.html"
    proc = _run_binary(
        "--gin_file=models/bert_tiny.gin",
        f"--dataset_dir={data}",
        "--query_id=q1",
        "--doc_id=d1",
        # aligner-eval's bindings for the alignment and the highlighted fractions
        "--gin.evaluate.alignment='top_k:2'",
        "--gin.SearchConfig.beta_q=1.0",
        "--num_aligned=2",
        f"--output_dir={tmp_path / 'pages'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "random/dense/lp" in page and "top_k:2" in page
    assert {"honey", "bees", "hive"} <= set(_span_texts(_section(page, "query")))
    assert {"Honey", "nectar", "combs"} <= set(_span_texts(_section(page, "document")))
    score = re.search(r"sim\(Q, D\) = (-?[0-9.]+)", proc.stdout)
    assert score and f'class="score">{score.group(1)}<' in page
    assert proc.stdout.count(" -> ") == 2 and f"wrote {out}" in proc.stdout
    assert "<script" not in page and "<link" not in page


def test_explain_reads_aligner_eval_bindings():
    """The alignment and β of the page are aligner-eval's gin bindings; Table 4's otherwise."""
    assert explanation.settings_from_gin() == {"alignment": "top_k:1", "beta_q": 0.5, "beta_d": 0.2}
    cli.parse_gin(
        ["eval/zero_shot.gin"],
        ["evaluate.alignment = 'top_p:0.5'", "SearchConfig.beta_d = 0.3"],
    )
    assert explanation.settings_from_gin() == {
        "alignment": "top_p:0.5",
        "beta_q": 1.0,  # eval/zero_shot.gin's
        "beta_d": 0.3,
    }


def test_binary_unknown_query_id_is_a_clear_error(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    proc = _run_binary(
        "--gin_file=models/minilm_identity.gin",
        f"--dataset_dir={data}",
        "--query_id=nope",
        "--doc_id=d1",
        f"--output_dir={tmp_path / 'x'}",
    )
    assert proc.returncode != 0
    assert "--query_id='nope'" in proc.stderr and str(data / "queries.jsonl") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()
    proc = _run_binary(
        "--gin_file=models/minilm_identity.gin",
        "--query=a",
        "--query_id=q1",
        "--document=b",
        f"--output_dir={tmp_path / 'y'}",
    )
    assert proc.returncode != 0 and "exactly one of --query" in proc.stderr


def test_tokens_the_index_does_not_store_align_to_nothing():
    """The index leaves out document tokens of salience 0 (``drop_zero_salience``); the page
    explained every token, so its score was not the one aligner-eval ranked with (0.6134
    against 0.6200 on a SciFact pair) and a query token could show an alignment to a token the
    index does not hold."""
    from aligner_jax.core import scoring
    from aligner_jax.indexing import indexer

    base = _fake_pair("top_k:2")
    rows = indexer.stored_rows(base.doc_encoded.salience, indexer.IndexingConfig())
    assert rows.tolist() == [1, 2, 3]  # [CLS] and [SEP] have u^d = 0
    ex = explanation.explain_encoded(
        *_fake_inputs(), alignment="top_k:2", model_name="fake", doc_stored=rows
    )
    assert ex.unstored_doc_tokens == 2 and base.unstored_doc_tokens == 0
    assert {a.doc_position for a in ex.alignments} <= {1, 2, 3}
    assert 4 in {a.doc_position for a in base.alignments}  # gamma's second was [SEP]
    s = np.asarray(ex.query_encoded.vectors) @ np.asarray(ex.doc_encoded.vectors)[rows].T
    stored = float(
        scoring.alignment_scores(
            jnp.asarray(s), np.ones(s.shape[0], bool), np.ones(len(rows), bool),
            scoring.AlignmentStrategy.parse("top_k:2"),
            jnp.asarray(ex.query_encoded.salience), jnp.asarray(ex.doc_encoded.salience[rows]),
            jnp.asarray(ex.query.token_ids), jnp.asarray(np.asarray(ex.doc.token_ids)[rows]),
        )
    )  # fmt: skip
    assert ex.score == pytest.approx(stored, abs=1e-6) and ex.score != pytest.approx(base.score)
    assert "2 of salience 0 not stored by the index" in explanation_html.format_summary(ex)
    # the page strikes through the words the index does not store, and only those
    assert ex.unstored_doc_positions == (0, 4)
    page = explanation_html.render_html(ex)
    struck = re.findall(r'<span class="w[^"]*\bunstored\b[^>]*>([^<]*)</span>', page)
    assert struck == ["[CLS]", "[SEP]"]
    assert "Struck through: not stored by the index" in page
    assert "unstored" not in explanation_html.render_html(base).split("</style>")[1]
