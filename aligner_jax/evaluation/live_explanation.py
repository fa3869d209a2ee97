"""The explanation of one search hit, for ``aligner-serve``'s ``POST /explain`` and search page:
the query's most salient words with the document words each aligns to (paper §4.4, Tables 4–5)
as data, and as the HTML fragment of ``explanation_html.render_fragment``.

The serving stage does not import this stage; the ``aligner-serve`` binary hands
:data:`EXPLAINER` to the app (``serving.http_app.create_app(explainer=...)``).
"""

from __future__ import annotations

from aligner_jax.evaluation import explanation, explanation_html
from aligner_jax.indexing import indexer
from aligner_jax.retrieval import searcher as search_lib

CSS = explanation_html.CSS  # styles the fragments


def explain_hit(searcher: search_lib.Searcher, query: str, doc_id: str, doc_text: str) -> dict:
    """``{"doc_id", "score", "alignment", "uniform_salience", "query_words", "html"}``:
    ``query_words`` lists the most salient query words, each with its salience and the document
    words it aligns to (rank, similarity S_ij, document salience), under the searcher's
    alignment strategy; the document is re-encoded whole by the searcher's model."""
    encoder = searcher.query_encoder()
    stored = indexer.IndexingConfig.recorded(searcher.store.manifest.get("indexing", {}))
    ex = explanation.explain(
        encoder.bundle, query, doc_text, alignment=searcher.alignment, encoder=encoder,
        stored=stored,
    )  # fmt: skip
    words = []
    for k in ex.top_query_words:
        word = ex.query_words[k]
        aligned = [
            {
                "doc_word": ex.doc_words[a.doc_word].text,
                "rank": a.rank,
                "similarity": a.similarity,
                "doc_salience": a.doc_salience,
            }
            for a in ex.word_alignments(k)
        ]
        words.append({"query_word": word.text, "salience": word.salience, "aligned": aligned})
    return {
        "doc_id": doc_id,
        "score": ex.score,
        "alignment": ex.alignment,
        "uniform_salience": ex.uniform_salience,
        "query_words": words,
        "html": explanation_html.render_fragment(ex, id_prefix=f"{doc_id}-"),
    }
