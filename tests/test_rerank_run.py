"""``aligner-eval --rerank_run=FILE``: a TREC run's candidates refined by ALIGNER (issue 13.4)."""

from __future__ import annotations

import pytest
from fixtures import run_module, write_toy_beir

from aligner_jax.common.errors import RunFileError
from aligner_jax.data import runs

QUERIES = {"q0", "q1"}
DOCS = {"d0", "d1", "d2"}


def _write(tmp_path, text: str | bytes, name: str = "first.trec"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_read_run_keeps_known_queries_and_counts_the_others(tmp_path):
    path = _write(
        tmp_path,
        "q0 Q0 d1 1 2.5 bm25\n\nq9 Q0 d7 1 9.0 bm25\nq0\tQ0\td0\t2\t1.5\tbm25\nq1 Q0 d2 1 -3 x\n"
        "q9 Q0 d0 2 1.0 bm25\n",
    )
    read = runs.read_run(path, QUERIES, DOCS)
    assert read.results == {"q0": {"d1": 2.5, "d0": 1.5}, "q1": {"d2": -3.0}}
    assert read.num_lines == 5 and read.skipped == {"q9": 2}
    # What format_run writes reads back as the same results.
    again = runs.read_run(_write(tmp_path, runs.format_run(read.results, "t"), "b"), QUERIES, DOCS)
    assert again.results == read.results


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "q0 Q0 d0 1 2.0 t\nq0 Q0 d5 2 1.0 t\n",
            r"first.trec:2: document 'd5' is not in the corpus",
        ),
        ("q0 Q0 d0 1 2.0 t\nq0 Q0 d0 2 1.0 t\n", r"first.trec:2: document 'd0' is listed twice"),
        ("q0 Q0 d0 1\n", r"first.trec:1: 4 fields, expected 'qid Q0 doc_id rank score tag'"),
        ("q0 Q0 d0 one 2.0 t\n", r"first.trec:1: rank 'one' / score '2.0'"),
        ("q0 Q0 d0 1 nan t\n", r"first.trec:1: score 'nan' is not a finite number"),
        ("\n\n", r"--rerank_run=.*first.trec: the file is empty"),
        (
            b"q0 Q0 d0 1 2.0 t\n\xff\xfe1 Q0 d0 1 2.7 x\n",
            r"first.trec:2: invalid UTF-8 \(byte 0xff",
        ),
        ("q9 Q0 d0 1 2.0 t\n", r"first.trec: none of its 1 queries \(e.g. \['q9'\]\) is a query"),
    ],
)
def test_read_run_errors_name_file_and_line(tmp_path, text, message):
    with pytest.raises(RunFileError, match=message):
        runs.read_run(_write(tmp_path, text), QUERIES, DOCS)


def test_missing_run_file_is_named(tmp_path):
    with pytest.raises(RunFileError, match=r"--rerank_run=.*nope.trec: no such file"):
        runs.read_run(tmp_path / "nope.trec", QUERIES, DOCS)


def test_binary_refuses_a_run_of_another_corpus_before_encoding(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    first = _write(tmp_path, "q0 Q0 d0 1 2.0 bm25\nq0 Q0 MED-12 2 1.0 bm25\n")
    proc = run_module(
        "aligner_jax.evaluate",
        "--gin_file=eval/zero_shot.gin",
        f"--dataset_dir={data}",
        f"--output_dir={tmp_path / 'o'}",
        f"--rerank_run={first}",
    )
    assert proc.returncode == 1
    assert f"aligner-eval: error: {first}:2: document 'MED-12' is not in the corpus" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing encoded, nothing written
