"""The speed and quality figures of README.md and WORKSPACE.md come from committed artefacts (issue 27,
item 6).

`benchmarks/results/figures.json` is the registry:

- ``commands``: per JSON under ``benchmarks/results/``, the command that wrote it;
- ``figures``: per figure, the ``doc``, a ``text`` snippet of it holding the figure (whitespace and
  line breaks need not match), the ``value`` as printed, the ``json`` and where in it the value is:
  a ``key`` path (``metrics.ndcg@10``, ``rows[2].p50_ms``, ``rows[model=trained,bits=2].p50_ms``,
  ``[2].peak_rss_gib`` for a list) times an optional ``scale`` (100 for metrics in [0, 1] printed
  as points), or an ``expr`` over key paths in braces (``{runs.1 process.wall_s} / 60``); the
  printed value must be the JSON's rounded to the printed digits (or to ``round_to``);
- ``not_measurements``: snippets whose numbers look like figures but are settings, limits or
  labelled estimates, each with the reason.

The scan below finds numbers with a unit of time, rate, memory or size (ms, s, min, h, q/s, GiB, B
per token, %, x faster, ...) or next to a retrieval metric (nDCG@10, R@100, MRR@10, p50, ...); each
must lie in a registered snippet (with that value) or an allowed one, so a new figure without an
artefact fails here. Token and document counts are not scanned (registered where a sentence states
them as measured). benchmarks/results/README.md is mostly a dated log of measurements: the figures
of its headline table that have a JSON are registered and checked, the file is not scanned.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = "benchmarks/results/figures.json"
DOCS = ("README.md", "WORKSPACE.md")  # registered and scanned
# registered only: the results README is mostly a history log; its headline table is registered
RESULTS_README = "benchmarks/results/README.md"

NUM = r"[−-]?\d+(?:,\d{3})*(?:\.\d+)?"
_START = r"(?<![\w.@=/′-])"  # not inside an identifier, flag value, version or other number
_SEP = r"(?:\s*[–/]\s*|\s+to\s+)"  # 1.7–1.9 GiB, 207 / 111 B per token, 0.27 to 0.51 GiB
_UNIT = (
    r"(?:ms|s|min|h|q/s|queries/s|docs/s|tokens/s|steps/s|GB/s|MB/s|GiB|MiB|KiB|GB|MB|KB"
    r"|B\s+per\s+token|B/token|bytes\s+per\s+token|%)(?![\w/])"
)
_METRIC = r"(?:nDCG@\d+|Recall@\d+|R@\d+|MRR@\d+|p50|p90|p99|overlap)"
FIGURE = re.compile(
    rf"{_START}(?P<chain>{NUM}(?:{_SEP}{NUM})*)(?:\s?{_UNIT}|×)"  # number(s) then a unit
    rf"|{_METRIC}\s+(?P<after>{NUM})(?![\d.])"  # nDCG@10 70.3, p50 68.0
    rf"|{_START}(?P<before>{NUM})\s+(?:points?\s+(?:of\s+)?)?(?:nDCG|R@|Recall@|MRR@)"  # 0.8 nDCG@10
)


def _registry() -> dict:
    return json.loads((ROOT / REGISTRY).read_text())


@functools.cache
def _json(path: str):
    return json.loads((ROOT / path).read_text())


def _docs() -> dict[str, str]:
    return {doc: (ROOT / doc).read_text() for doc in (*DOCS, RESULTS_README)}


def snippet_pattern(text: str) -> re.Pattern:
    """The snippet with any run of whitespace matching any other (docs get re-wrapped)."""
    return re.compile(r"\s+".join(re.escape(word) for word in text.split()))


def parse_printed(value: str) -> tuple[float, float]:
    """The printed number and half a unit of its last digit: '70.3' -> (70.3, 0.05)."""
    text = value.replace(",", "").replace("−", "-")
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return float(text), 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def lookup(data, path: str):
    """``a.b[2].c`` / ``rows[model=trained,bits=2].p50_ms`` / ``[2].x`` in a loaded JSON; ``\\.``
    is a dot inside a key (``results.0\\.01.p50``)."""
    for part in re.findall(r"(?:\\\.|[^.\[\]\\]+|\[[^\]]*\])+", path):
        name, *selectors = re.split(r"(?=\[)", part)
        name = name.replace("\\.", ".")
        if name:
            if not isinstance(data, dict) or name not in data:
                raise KeyError(f"no key {name!r} (of {path!r})")
            data = data[name]
        for selector in selectors:
            inner = selector[1:-1]
            if re.fullmatch(r"-?\d+", inner):
                data = data[int(inner)]
                continue
            wanted = dict(item.split("=", 1) for item in inner.split(","))
            matches = [row for row in data if all(_equal(row.get(k), v) for k, v in wanted.items())]
            if len(matches) != 1:
                raise KeyError(f"{selector} matches {len(matches)} rows, not 1 (of {path!r})")
            data = matches[0]
    return data


def _equal(actual, wanted: str) -> bool:
    try:
        return actual == json.loads(wanted)
    except json.JSONDecodeError:
        return actual == wanted


def artefact_value(entry: dict) -> float:
    data = _json(entry["json"])
    if "expr" in entry:
        expr = re.sub(
            r"\{([^}]*)\}", lambda m: repr(float(lookup(data, m.group(1)))), entry["expr"]
        )
        return float(eval(expr, {"__builtins__": {}}))  # numbers and + - * / only
    return float(lookup(data, entry["key"])) * entry.get("scale", 1)


def _where(entry: dict) -> str:
    key = entry.get("key") or entry.get("expr")
    return f"{entry['doc']}: {entry['text']!r} -> {entry['json']} {key}"


def figure_problems(registry: dict, docs: dict[str, str]) -> list[str]:
    """Every registered figure is in its doc and equals its JSON's value at the printed precision."""
    problems = []
    for entry in registry["figures"]:
        where = _where(entry)
        if entry["doc"] not in docs:
            problems.append(f"{where}: unknown doc (one of {', '.join(docs)})")
            continue
        if not snippet_pattern(entry["text"]).search(docs[entry["doc"]]):
            problems.append(f"{where}: the snippet is not in {entry['doc']}")
            continue
        if entry["value"] not in entry["text"]:
            problems.append(f"{where}: the value {entry['value']!r} is not in the snippet")
            continue
        if entry["json"] not in registry["commands"]:
            problems.append(f"{where}: no command for {entry['json']} in {REGISTRY}")
        try:
            actual = artefact_value(entry)
        except (KeyError, IndexError, TypeError, ValueError, FileNotFoundError) as err:
            problems.append(f"{where}: cannot read the value: {err}")
            continue
        printed, half_unit = parse_printed(entry["value"])
        if "round_to" in entry:
            half_unit = entry["round_to"] / 2
        if not abs(actual - printed) <= half_unit * (1 + 1e-9) + 1e-12:
            problems.append(f"{where}: the doc says {entry['value']}, the JSON gives {actual:.6g}")
    return problems


def scan_figures(text: str) -> list[tuple[int, int]]:
    """Spans of the numbers in ``text`` that read as speed / quality figures."""
    spans = []
    for match in FIGURE.finditer(text):
        group = next(g for g in ("chain", "after", "before") if match.group(g) is not None)
        for number in re.finditer(NUM, match.group(group)):
            spans.append((match.start(group) + number.start(), match.start(group) + number.end()))
    return spans


def _normal(number: str) -> str:
    return number.replace(",", "").replace("−", "-")


def unregistered_figures(registry: dict, docs: dict[str, str]) -> list[str]:
    """Figures the scan finds that no registered or allowed snippet covers, as 'doc:line: ...'."""
    problems = []
    for doc, text in docs.items():
        covered = []  # (start, end, value or None for any)
        for entry in registry["figures"]:
            if entry["doc"] == doc:
                for m in snippet_pattern(entry["text"]).finditer(text):
                    covered.append((m.start(), m.end(), _normal(entry["value"])))
        for entry in registry["not_measurements"]:
            if entry["doc"] == doc:
                for m in snippet_pattern(entry["text"]).finditer(text):
                    covered.append((m.start(), m.end(), None))
        for start, end in scan_figures(text):
            number = _normal(text[start:end])
            if not any(s <= start and end <= e and v in (None, number) for s, e, v in covered):
                line = text.count("\n", 0, start) + 1
                context = " ".join(text[max(0, start - 50) : end + 30].split())
                problems.append(f"{doc}:{line}: {text[start:end]!r} in ...{context}...")
    return problems


def test_registry_is_well_formed():
    registry = _registry()
    assert set(registry) >= {"commands", "figures", "not_measurements"}
    for path, command in registry["commands"].items():
        assert path.startswith("benchmarks/results/") and path.endswith(".json"), path
        assert (ROOT / path).is_file(), f"{REGISTRY}: {path} does not exist"
        assert command.strip(), f"{REGISTRY}: no command for {path}"
    for entry in registry["figures"]:
        assert set(entry) >= {"doc", "text", "value", "json"}, entry
        assert ("key" in entry) != ("expr" in entry), f"{_where(entry)}: give key or expr"
        assert entry["json"] in registry["commands"], f"{_where(entry)}: no command for its JSON"
        parse_printed(entry["value"])  # a number as printed: 1,242,251 / −7 / 4e-7
    for entry in registry["not_measurements"]:
        assert set(entry) == {"doc", "text", "why"}, entry


def test_each_registered_figure_matches_its_json():
    problems = figure_problems(_registry(), _docs())
    assert not problems, "figures that do not match their artefact:\n" + "\n".join(problems)


def test_every_figure_in_the_docs_is_registered():
    docs = {doc: text for doc, text in _docs().items() if doc in DOCS}
    problems = unregistered_figures(_registry(), docs)
    assert not problems, (
        f"figures without an artefact: register each in {REGISTRY} (figures: doc, text, value,"
        " json, key; the JSON's command in commands), or list it under not_measurements with the"
        " reason if it is a setting, limit or labelled estimate, or remove it from the doc:\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("took 5 min 16 s and at most 3.7 GiB", ["5", "16", "3.7"]),
        ("nDCG@10    70.3   Recall@100 92.8   MRR@10 67.0", ["70.3", "92.8", "67.0"]),
        ("search latency p50 68.0 / p90 114.9 ms, 13 queries/s", ["68.0", "114.9", "13"]),
        ("1.7–1.9 GiB at 1.24M tokens; 207 / 111 B per\ntoken", ["1.7", "1.9", "207", "111"]),
        ("R@100 −7 points; 1.25–1.33× faster; loses 0.8 nDCG@10", ["−7", "1.25", "1.33", "0.8"]),
        ("t5x:, nDCG@10 on 16,384 centroids, 128-d, log2 5 steps, KILL_AFTER=5 s, --k=10", []),
    ],
)
def test_the_scan_finds_figures(text, found):
    assert [text[s:e] for s, e in scan_figures(text)] == found


def test_a_changed_or_new_figure_fails():
    """The checks can fail: a registered figure edited in the doc, and an unregistered one added."""
    registry, docs = _registry(), _docs()
    entry = next(
        e for e in registry["figures"] if e["doc"] == "README.md" and e["key"] == "metrics.ndcg@10"
    )
    changed = entry["text"].replace(entry["value"], "99.9")
    edited = dict(docs, **{"README.md": docs["README.md"].replace(entry["text"], changed)})
    assert any("not in README.md" in p for p in figure_problems(registry, edited))
    entry = dict(entry, value="99.9", text=changed)
    registry_edited = dict(registry, figures=[entry])
    assert any("the doc says 99.9" in p for p in figure_problems(registry_edited, edited))
    added = dict(docs, **{"WORKSPACE.md": docs["WORKSPACE.md"] + "\nIt answers in 4.2 ms.\n"})
    assert [p for p in unregistered_figures(registry, added) if "'4.2'" in p]
