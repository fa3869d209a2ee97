"""Tests for aligner_jax.data.beir: loading, validation messages, stats, download error path, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import (
    TOY_DOCS,
    TOY_QRELS,
    TOY_QUERIES,
    run_module,
    write_beir_fixture,
    write_toy_beir,
)

from aligner_jax.common import errors
from aligner_jax.data import beir

REPO = Path(__file__).resolve().parents[1]
HEADER = "query-id\tcorpus-id\tscore\n"


def _write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return path


def _doc(doc_id, text="some text", title="a title") -> str:
    return json.dumps({"_id": doc_id, "title": title, "text": text})


# ---------------------------------------------------------------- happy path


def test_load_toy_dataset(tmp_path):
    ds = beir.load_beir(write_toy_beir(tmp_path))
    assert ds.name == "toy"
    assert ds.split == "test"
    assert list(ds.corpus) == list(TOY_DOCS)  # file order
    assert ds.corpus["d3"] == beir.Document("d3", TOY_DOCS["d3"]["title"], TOY_DOCS["d3"]["text"])
    assert ds.queries == TOY_QUERIES
    assert ds.qrels == TOY_QRELS
    s = ds.stats
    assert (s.num_documents, s.num_queries, s.num_qrels, s.num_relevant_qrels) == (12, 4, 5, 5)
    assert s.queries_without_qrels == 0 and s.skipped_qrels == 0 and s.empty_documents == 0
    assert s.max_query_words == 8  # "why does a volcano erupt lava and magma"


def test_queries_restricted_to_split_and_dropped_count(tmp_path):
    queries = {"q0": "first", "q1": "second", "q2": "third"}
    folder = write_beir_fixture(tmp_path, {"d0": "x", "d1": "y"}, queries, {"q1": {"d0": 1}})
    ds = beir.load_beir(folder)
    assert ds.queries == {"q1": "second"}
    assert ds.stats.num_queries_in_file == 3
    assert ds.stats.queries_without_qrels == 2


def test_numeric_ids_missing_title_and_empty_documents(tmp_path):
    corpus = _write_lines(
        tmp_path / "c" / "corpus.jsonl",
        [
            json.dumps({"_id": 7, "text": "no title here", "metadata": {"a": 1}}),
            json.dumps({"_id": "8", "title": "", "text": ""}),
            json.dumps({"_id": "9", "title": None, "text": "null title"}),
        ],
    )
    _write_lines(tmp_path / "c" / "queries.jsonl", [json.dumps({"_id": 1, "text": "q"})])
    _write_lines(tmp_path / "c" / "qrels" / "test.tsv", [HEADER.strip(), "1\t7\t1"])
    docs = beir.load_corpus(corpus)
    assert docs["7"] == beir.Document("7", "", "no title here")
    assert docs["9"].title == ""
    ds = beir.load_beir(tmp_path / "c")
    assert ds.stats.empty_documents == 1
    assert "8" in ds.corpus  # kept, only counted
    assert ds.qrels == {"1": {"7": 1}}


def test_document_text_convention():
    assert beir.document_text(beir.Document("a", "Title", "body")) == "Title body"
    assert beir.document_text(beir.Document("a", "", "body")) == "body"
    assert beir.document_text(beir.Document("a", "  ", "body")) == "body"


def test_iter_jsonl_and_iter_corpus_stream_with_line_numbers(tmp_path):
    path = _write_lines(tmp_path / "corpus.jsonl", [_doc("a"), "", "   ", _doc("b")])
    assert [n for n, _ in beir.iter_jsonl_records(path)] == [1, 4]
    docs = beir.iter_corpus(path)
    assert next(docs).doc_id == "a"  # a generator: nothing read beyond what is consumed
    assert [d.doc_id for d in docs] == ["b"]


def test_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _doc("a").encode() + b"\r\n" + _doc("b").encode() + b"\r\n")
    assert list(beir.load_corpus(path)) == ["a", "b"]


def test_qrels_duplicates_and_graded_scores(tmp_path):
    path = _write_lines(
        tmp_path / "test.tsv",
        [HEADER.strip(), "q1\td1\t2", "q1\td2\t0", "q1\td1\t2", "q2\td1\t1", ""],
    )
    assert beir.load_qrels(path) == {"q1": {"d1": 2, "d2": 0}, "q2": {"d1": 1}}


# ---------------------------------------------------------------- bad input: file and line named


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('{"_id": "x", "text": "unterminated', "malformed JSON"),
        ('["_id", "x"]', "expected a JSON object"),
        ('{"title": "t", "text": "no id"}', 'no "_id"'),
        ('{"_id": "", "text": "empty id"}', '"_id" is empty'),
        ('{"_id": "  ", "text": "blank id"}', '"_id" is empty'),
        ('{"_id": 1.5, "text": "float id"}', '"_id" must be a string or an integer'),
        ('{"_id": "x", "text": 12}', '"text" must be a string'),
        ('{"_id": "x", "text": null}', '"text" must be a string'),
        ('{"_id": "x", "title": ["a"], "text": "t"}', '"title" must be a string'),
        ('{"_id": "x", "title": "only a title"}', 'no "text" field'),
        ('{"_id": "x", "text": "t", "score": NaN}', "NaN is not JSON"),  # once a traceback
        ('{"_id": "x", "text": "t", "w": [-Infinity]}', "-Infinity is not JSON"),
    ],
)
def test_corpus_bad_records_name_file_and_line(tmp_path, line, fragment):
    path = _write_lines(tmp_path / "corpus.jsonl", [_doc("ok1"), _doc("ok2"), line])
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_corpus(path)
    assert f"{path}:3:" in str(e.value)
    assert fragment in str(e.value)


def test_beir_format_error_is_value_error():
    assert issubclass(errors.BeirFormatError, ValueError)


def test_duplicate_document_ids_name_both_lines(tmp_path):
    path = _write_lines(tmp_path / "corpus.jsonl", [_doc("a"), _doc("b"), _doc("c"), _doc("b")])
    with pytest.raises(errors.BeirFormatError, match=r"corpus\.jsonl:4: duplicate document id 'b'"):
        beir.load_corpus(path)
    with pytest.raises(errors.BeirFormatError, match=r"first defined on line 2"):
        beir.load_corpus(path)
    assert len(list(beir.iter_corpus(path, check_duplicates=False))) == 4


def test_duplicate_query_ids(tmp_path):
    path = _write_lines(
        tmp_path / "queries.jsonl", [json.dumps({"_id": "q", "text": "a"})] + ['{"_id": "q"}']
    )
    # The duplicate is found before the missing text on the same line.
    with pytest.raises(errors.BeirFormatError, match=r"queries\.jsonl:2: duplicate query id 'q'"):
        beir.load_queries(path)


def test_invalid_utf8_names_line(tmp_path):
    path = _write_lines(
        tmp_path / "corpus.jsonl", [_doc("a"), b'{"_id": "b", "text": "caf\xe9"}', _doc("c")]
    )
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_corpus(path)
    message = str(e.value)
    assert f"{path}:2:" in message and "invalid UTF-8" in message and "0xe9" in message


@pytest.mark.parametrize(
    "lines, line_number, fragment",
    [
        (["query\tdoc\trel", "q\td\t1"], 1, "expected the header line"),
        (["q\td\t1"], 1, "expected the header line"),
        ([HEADER.strip(), "q\td\t1", "q\td2"], 3, "expected 3 tab-separated columns"),
        ([HEADER.strip(), "q 0 d 1"], 2, "TREC qrels line"),
        ([HEADER.strip(), "q\td\t1\textra"], 2, "found 4"),
        ([HEADER.strip(), "q\td\trelevant"], 2, "is not an integer"),
        ([HEADER.strip(), "q\td\t1.5"], 2, "is not an integer"),
        ([HEADER.strip(), "\td\t1"], 2, "empty query-id or corpus-id"),
        ([HEADER.strip(), "q\td\t1", "q\td\t2"], 3, "judged 2 here but 1 on line 2"),
    ],
)
def test_qrels_bad_lines_name_file_and_line(tmp_path, lines, line_number, fragment):
    path = _write_lines(tmp_path / "qrels" / "test.tsv", lines)
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_qrels(path)
    assert f"{path}:{line_number}:" in str(e.value)
    assert fragment in str(e.value)


def test_qrels_invalid_utf8(tmp_path):
    path = _write_lines(tmp_path / "test.tsv", [HEADER.strip(), b"q\t\xff\t1"])
    with pytest.raises(errors.BeirFormatError, match=r"test\.tsv:2: invalid UTF-8"):
        beir.load_qrels(path)


def test_empty_files_are_clear_errors(tmp_path):
    corpus = _write_lines(tmp_path / "corpus.jsonl", ["", ""])
    with pytest.raises(errors.BeirFormatError, match=r"corpus\.jsonl: the corpus is empty"):
        beir.load_corpus(corpus)
    queries = _write_lines(tmp_path / "queries.jsonl", [])
    with pytest.raises(errors.BeirFormatError, match=r"queries\.jsonl: the query set is empty"):
        beir.load_queries(queries)
    qrels = _write_lines(tmp_path / "a.tsv", [HEADER.strip()])
    with pytest.raises(errors.BeirFormatError, match=r"a\.tsv: the qrels file has a header but no"):
        beir.load_qrels(qrels)
    (tmp_path / "b.tsv").write_bytes(b"")
    with pytest.raises(errors.BeirFormatError, match=r"b\.tsv: the qrels file is empty"):
        beir.load_qrels(tmp_path / "b.tsv")


def test_missing_files_list_required_layout(tmp_path):
    folder = write_toy_beir(tmp_path)
    (folder / "queries.jsonl").unlink()
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_beir(folder)
    message = str(e.value)
    assert "missing queries.jsonl" in message
    assert "corpus.jsonl" in message and "qrels/<split>.tsv" in message
    with pytest.raises(errors.BeirFormatError, match=r"not found"):
        beir.load_beir(tmp_path / "nowhere")
    with pytest.raises(errors.BeirFormatError, match=r"corpus.jsonl not found"):
        beir.load_corpus(tmp_path / "corpus.jsonl")


def test_missing_split_lists_available_splits(tmp_path):
    folder = write_toy_beir(tmp_path, split="dev")
    with pytest.raises(errors.BeirFormatError, match=r"missing qrels/test\.tsv.*\['dev'\]"):
        beir.load_beir(folder)
    assert beir.load_beir(folder, split="dev").split == "dev"


def _folder_with_unknown_qrels(tmp_path):
    return write_beir_fixture(
        tmp_path,
        {"d0": "x", "d1": "y"},
        {"q0": "a", "q1": "b", "q2": "c"},
        {
            "q0": {"d0": 1, "d9": 1},  # d9: unknown document (line 3)
            "q1": {"d1": 1},
            "qX": {"d0": 1, "d8": 1},  # unknown query (lines 5, 6; 6 also unknown doc)
        },
    )


def test_unknown_qrels_error_by_default(tmp_path):
    folder = _folder_with_unknown_qrels(tmp_path)
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_beir(folder)
    message = str(e.value)
    qrels_path = folder / "qrels" / "test.tsv"
    assert f"{qrels_path}:3:" in message
    assert "unknown document" in message
    assert "3 judgment line(s)" in message
    assert "pass --unknown_qrels=skip to drop and count them" in message


def test_unknown_qrels_in_a_training_task_name_its_binding(tmp_path):
    """The training task said "flag --unknown_qrels=skip", which aligner-train does not have."""
    import gin

    from aligner_jax.common import cli

    folder = _folder_with_unknown_qrels(tmp_path)
    cli.parse_gin([], ["import aligner_jax.tasks"])
    from aligner_jax.tasks import beir_train

    config = beir_train.beir_train_source(dataset_dir=str(folder), qrels_split="test")
    with pytest.raises(errors.BeirFormatError) as e:
        beir_train.build_beir_train_examples(config, "train")
    assert "pass --gin.beir_train_source.unknown_qrels=\"'skip'\" to drop" in str(e.value)
    gin.clear_config()


def test_a_qrels_file_without_judgments_says_so(tmp_path):
    folder = _folder_with_unknown_qrels(tmp_path)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n")
    with pytest.raises(errors.BeirFormatError, match=r"test.tsv: holds no judgment"):
        beir.load_beir(folder)


def test_unknown_qrels_skip_counts(tmp_path):
    ds = beir.load_beir(_folder_with_unknown_qrels(tmp_path), unknown_qrels="skip")
    assert ds.qrels == {"q0": {"d0": 1}, "q1": {"d1": 1}}
    assert list(ds.queries) == ["q0", "q1"]
    assert ds.stats.skipped_qrels == 3
    assert ds.stats.unknown_query_qrels == 2
    assert ds.stats.unknown_document_qrels == 2
    assert ds.stats.queries_without_qrels == 1


def test_judgments_all_zero_are_warned_about(tmp_path, caplog):
    """A split whose judgments all score 0 evaluated to 0.0 everywhere without a word."""
    folder = write_beir_fixture(tmp_path, {"d0": "x", "d1": "y"}, {"q0": "a"}, {"q0": {"d0": 0}})
    with caplog.at_level("WARNING"):
        beir.load_beir(folder)
    assert "none of its 1 judgments has a score above 0: every metric will be 0" in caplog.text


def test_unknown_qrels_mode_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"--unknown_qrels"):
        beir.load_beir(write_toy_beir(tmp_path), unknown_qrels="ignore")


def test_no_judged_query_left_is_an_error(tmp_path):
    folder = write_beir_fixture(tmp_path, {"d0": "x"}, {"q0": "a"}, {"zz": {"d0": 1}})
    with pytest.raises(errors.BeirFormatError, match=r"test\.tsv: no judgment is left"):
        beir.load_beir(folder, unknown_qrels="skip")


# ---------------------------------------------------------------- download and CLI


def test_download_unreachable_url_fails_clearly(tmp_path):
    with pytest.raises(errors.BeirDownloadError) as e:
        beir.download_dataset(
            "scifact", tmp_path, url_template="http://127.0.0.1:9/{name}.zip", timeout_s=5
        )
    message = str(e.value)
    assert "http://127.0.0.1:9/scifact.zip" in message and "no network access" in message
    assert list(tmp_path.iterdir()) == []  # the partial download is removed


def test_download_unpacks_zip_and_rejects_bad_archives(tmp_path, monkeypatch):
    import io
    import zipfile

    source = write_toy_beir(tmp_path / "src", name="toyset")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for p in sorted(source.rglob("*")):
            if p.is_file():
                z.write(p, p.relative_to(source.parent).as_posix())
    payloads = {"toyset": buffer.getvalue(), "broken": b"not a zip"}

    def fake_urlopen(url, timeout):
        assert timeout == 60.0
        return io.BytesIO(payloads[url.rsplit("/", 1)[1][: -len(".zip")]])

    monkeypatch.setattr(beir.urllib.request, "urlopen", fake_urlopen)
    target = beir.download_dataset("toyset", tmp_path / "data")
    assert target == tmp_path / "data" / "toyset"
    assert beir.load_beir(target).qrels == TOY_QRELS
    with pytest.raises(errors.BeirDownloadError, match="not return a valid zip"):
        beir.download_dataset("broken", tmp_path / "data")
    with pytest.raises(ValueError, match="expected a BEIR name"):
        beir.download_dataset("../etc", tmp_path / "data")


def _beir_binary(*args):
    """``python -m aligner_jax.beir`` (absl flags, like every binary)."""
    return run_module("aligner_jax.beir", *args, timeout=120)


def test_cli_download_error_is_one_line(tmp_path):
    proc = _beir_binary(
        "--download=scifact", f"--to={tmp_path}", "--url_template=http://127.0.0.1:9/{name}"
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("aligner-beir: error: could not download http://127.0.0.1:9/scifact")


def test_cli_stats(tmp_path):
    folder = write_toy_beir(tmp_path)
    proc = _beir_binary(f"--dataset_dir={folder}", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout)
    assert stats["name"] == "toy" and stats["num_documents"] == 12 and stats["num_queries"] == 4
    proc = _beir_binary(f"--dataset_dir={folder}")
    assert "documents        12" in proc.stdout and "queries          4 judged of 4" in proc.stdout
    proc = _beir_binary(f"--dataset_dir={folder}", "--split=dev")
    assert proc.returncode == 1 and "missing qrels/dev.tsv" in proc.stderr.strip().splitlines()[-1]


def test_identical_ids_rule_drops_only_the_query_itself_by_default():
    """CISI-like ids (q1 is also an unrelated, judged-relevant document) keep the document;
    ArguAna/Quora-like ids (the document *is* the query, modulo case and spaces) drop it."""
    corpus = {
        "a": beir.Document("a", "", "the  Query text A"),
        "b": beir.Document("b", "An unrelated title", "an unrelated document judged relevant"),
        "x": beir.Document("x", "", "other"),
    }
    queries = {"a": "the query text a", "b": "something else", "c": "no such document"}
    qrels = {"a": {"x": 1}, "b": {"b": 2}, "c": {"x": 1}}
    results = {"a": {"a": 9.0, "x": 1.0}, "b": {"b": 3.0, "x": 1.0}, "c": {"x": 1.0}}

    default = beir.IdenticalIds.of(queries, corpus, qrels)
    assert default.drop == {"a"}
    assert default.apply(results) == {"a": {"x": 1.0}, "b": {"b": 3.0, "x": 1.0}, "c": {"x": 1.0}}
    assert default.as_dict()["kept_judged_relevant"] == 1
    assert "2 query ids are also document ids" in default.describe()

    always = beir.IdenticalIds.of(queries, corpus, qrels, "always")
    assert always.drop == {"a", "b"} and always.dropped_judged_relevant == 1
    assert beir.IdenticalIds.of(queries, corpus, qrels, "never").apply(results) == results
    with pytest.raises(errors.ConfigError, match="--ignore_identical_ids=sometimes"):
        beir.IdenticalIds.of(queries, corpus, qrels, "sometimes")


def test_a_queries_file_without_text_or_missing_gets_a_message_that_fits(tmp_path):
    """A query line without "text" was told that an empty string is allowed, which was then
    refused; a missing --queries file was told a BEIR folder's layout."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"_id": "q1"}) + "\n")
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_queries(path)
    assert 'no "text" field' in str(e.value) and "empty string is allowed" not in str(e.value)
    with pytest.raises(errors.BeirFormatError) as e:
        beir.load_queries(tmp_path / "missing.jsonl")
    assert str(e.value) == f"{tmp_path / 'missing.jsonl'}: missing.jsonl not found."
    with pytest.raises(errors.BeirFormatError, match="A BEIR folder must contain corpus.jsonl"):
        beir.load_queries(tmp_path / "queries.jsonl")  # a BEIR folder's file: its layout
