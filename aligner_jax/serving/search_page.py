"""The search page of ``aligner-serve`` (``GET /``): a query box, the ranked hits with title and
snippet, and for each hit the ALIGNER alignment behind its score — which query words aligned to
which document words, with their saliences (paper §4.4, Tables 4–5), fetched live from
``POST /explain`` and drawn by ``explanation_html.render_fragment`` (its styles are passed in: :func:`render`).

One self-contained page (inline CSS and script, no external assets); texts from the index are
inserted as text, never as markup. ``/?q=QUERY&k=K`` searches on load.
"""

from __future__ import annotations

_PAGE_CSS = """
body { max-width: 64em; }
form { display: flex; gap: 0.5em; margin: 1em 0; }
#q { flex: 1; font-size: 1.1em; padding: 0.4em 0.6em; }
#k { width: 4em; font-size: 1em; padding: 0.3em; }
button { font-size: 1em; padding: 0.4em 1em; }
#status { color: #666; font-size: 0.9em; min-height: 1.2em; }
ol#hits { padding-left: 0; list-style: none; }
li.hit { border-bottom: 1px solid #e3e3e3; padding: 0.8em 0; }
.hit .head { display: flex; gap: 0.8em; align-items: baseline; }
.hit .rank { color: #888; min-width: 2em; }
.hit .title { font-weight: bold; font-size: 1.05em; }
.hit .meta { color: #777; font-size: 0.85em; font-family: ui-monospace, Menlo, monospace; }
.hit .snippet { margin: 0.3em 0 0.3em 2.8em; color: #333; }
.hit .aligned { margin-left: 2.8em; font-size: 0.9em; }
.chip { display: inline-block; border: 1px solid #ddd; border-radius: 10px; padding: 0 0.5em;
        margin: 0.1em 0.2em 0.1em 0; background: #fafafa; }
.chip b { font-weight: 600; }
.hit details { margin: 0.3em 0 0 2.8em; }
.hit details > summary { cursor: pointer; color: #1f5fbf; }
.explanation { border-left: 3px solid #ffc107; padding-left: 0.8em; margin-top: 0.4em; }
"""

_SCRIPT = r"""
const $ = (sel) => document.querySelector(sel);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};
const SNIPPET = 300;

async function post(path, body) {
  const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                               body: JSON.stringify(body)});
  const data = await r.json();
  if (!r.ok) throw new Error(data.detail || r.statusText);
  return data;
}

function chips(target, ex) {
  target.textContent = "";
  // the explanation re-encodes the document: its sim(Q, D) is the uncompressed score
  target.appendChild(el("span", "", "alignment (" + ex.alignment + ", uncompressed sim(Q, D) " +
                        ex.score.toFixed(4) + "): "));
  for (const w of ex.query_words) {
    const chip = el("span", "chip");
    chip.appendChild(el("b", "", w.query_word));
    const to = w.aligned.map((a) => a.doc_word + "(" + a.rank + ") " + a.similarity.toFixed(2));
    chip.appendChild(document.createTextNode(" u=" + w.salience.toFixed(2) + " → " +
                                             (to.join(", ") || "not aligned")));
    target.appendChild(chip);
  }
}

async function explainHits(query, hits, nodes, token) {
  for (let i = 0; i < hits.length; i++) {
    if (token !== window.searchToken) return;  // a newer search started
    const node = nodes[i];
    try {
      const ex = await post("/explain", {query: query, doc_id: hits[i].doc_id});
      chips(node.querySelector(".aligned"), ex);
      node.querySelector(".explanation").innerHTML = ex.html;  // rendered and escaped server-side
    } catch (err) {
      node.querySelector(".aligned").textContent = "alignment unavailable: " + err.message;
    }
  }
  if (token === window.searchToken) $("#status").dataset.explained = "yes";
}

async function runSearch(query, k) {
  const token = (window.searchToken = (window.searchToken || 0) + 1);
  $("#status").textContent = "searching…";
  $("#status").dataset.explained = "no";
  const list = $("#hits");
  list.textContent = "";
  let data;
  try {
    data = await post("/search", {query: query, k: k});
  } catch (err) {
    $("#status").textContent = "error: " + err.message;
    $("#status").dataset.explained = "error";
    return;
  }
  $("#status").textContent = data.hits.length + " hits in " + data.took_ms.toFixed(1) +
      " ms (snapshot " + data.generation + ")";
  const nodes = [];
  for (const hit of data.hits) {
    const li = el("li", "hit");
    li.dataset.docId = hit.doc_id;
    const head = el("div", "head");
    head.appendChild(el("span", "rank", "#" + hit.rank));
    head.appendChild(el("span", "title", hit.title || hit.doc_id));
    head.appendChild(el("span", "meta", hit.doc_id + " · " + hit.score.toFixed(4)));
    li.appendChild(head);
    const text = hit.text || "";
    li.appendChild(el("div", "snippet",
                      text.length > SNIPPET ? text.slice(0, SNIPPET) + "…" : text));
    li.appendChild(el("div", "aligned", "alignment: computing…"));
    const details = el("details");
    details.appendChild(el("summary", "", "query ↔ document alignment and saliences"));
    details.appendChild(el("div", "explanation"));
    if (nodes.length === 0) details.open = true;
    li.appendChild(details);
    list.appendChild(li);
    nodes.push(li);
  }
  explainHits(query, data.hits, nodes, token);
}

$("#form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = $("#q").value;
  const k = parseInt($("#k").value, 10);
  history.replaceState(null, "", "?q=" + encodeURIComponent(q) + "&k=" + k);
  runSearch(q, k);
});

fetch("/stats").then((r) => r.json()).then((s) => {
  $("#index").textContent = s.num_docs + " documents · " + (s.model.name || "model") + " · " +
      s.backend + " · " + s.alignment;
});
const params = new URLSearchParams(location.search);
if (params.get("q")) {
  $("#q").value = params.get("q");
  if (params.get("k")) $("#k").value = params.get("k");
  runSearch(params.get("q"), parseInt($("#k").value, 10));
}
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>aligner-serve: search</title>
<style>{css}</style></head>
<body>
<h1>ALIGNER search</h1>
<div class="legend" id="index"></div>
<form id="form">
  <input id="q" name="q" type="search" placeholder="Search the index…" autofocus required>
  <label>k <input id="k" name="k" type="number" min="1" max="{max_k}" value="{k}"></label>
  <button type="submit">Search</button>
</form>
<div id="status"></div>
<ol id="hits"></ol>
<p class="legend">Each hit shows the query words ALIGNER aligned to the document's words
(rank and similarity S<sub>ij</sub>; u = salience), and, unfolded, the texts coloured by
salience with the alignments of the most salient query words (paper Tables 4–5).
API: <a href="/docs">/docs</a>.</p>
<script>{script}</script>
</body></html>
"""


def render(explanation_css: str = "", max_k: int = 100) -> str:
    """The page, with the explanation fragments' styles (``live_explanation.CSS``) and its
    ``k`` field bounded by the server's ``--max_k``."""
    return _PAGE.format(
        css=explanation_css + _PAGE_CSS, script=_SCRIPT, max_k=max_k, k=min(10, max_k)
    )
