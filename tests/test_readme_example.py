"""The README's Python indexing example runs as written (issue 25: create an index from a list of
dicts with metadata, search with a filter, print titles)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

EXAMPLE = """\
import aligner_jax

index = aligner_jax.Index.create("outputs/my_index")  # the bundled all-MiniLM-L6-v2, zero-shot
rows = [
    ("d1", "Honey bees", "Bees store honey in wax combs.", 2019),
    ("d2", "Wild bees", "Solitary bees nest in the ground.", 2012),
    ("d3", "Chess", "The Sicilian defence is a chess opening.", 2021),
]
index.add({"id": i, "title": t, "text": x, "metadata": {"year": y}} for i, t, x, y in rows)
searcher = index.searcher()
for hit in searcher.search("where do bees keep honey?", k=2, filter={"year": {"gte": 2015}}):
    print(hit.rank, hit.title, round(hit.score, 2), hit.metadata)
"""


def test_the_example_is_the_readme_s():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "```python\n" + EXAMPLE + "```" in readme


def test_readme_example_runs_and_filters(tmp_path):
    cwd = os.getcwd()
    out = io.StringIO()
    try:
        os.chdir(tmp_path)
        with contextlib.redirect_stdout(out):
            exec(compile(EXAMPLE, "README.md example", "exec"), {})
    finally:
        os.chdir(cwd)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # d2 (2012) is filtered out
    assert lines[0].startswith("1 Honey bees ") and lines[1].startswith("2 Chess ")
    assert lines[0].endswith("{'year': 2019}") and lines[1].endswith("{'year': 2021}")
    assert (tmp_path / "outputs" / "my_index" / "manifest.json").exists()


def test_readme_shows_this_example():
    """Once README.md shows an ``aligner_jax.Index`` example, it is this one, verbatim."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    if "aligner_jax.Index.create" in readme:
        assert EXAMPLE in readme
