"""Every user error of issue 11 ends in one line naming the flag, file or document (no traceback)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures import start_python, write_toy_beir

from aligner_jax.common import cli, errors, fileio
from aligner_jax.data import beir
from aligner_jax.indexing import token_store as ts


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return write_toy_beir(tmp_path_factory.mktemp("data"))


def _one_line_error(proc, program="aligner-eval") -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{program}: error: ") or last.startswith("FATAL Flags parsing error:")
    return last


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--gin.SearchConfig.k_prime='abc'"],
            "--gin.SearchConfig.k_prime='abc': expected an integer",
        ),
        (["--gin.SearchConfig.top_k=0"], "--gin.SearchConfig.top_k=0: must be >= 1"),
        (["--gin.SearchConfig.query_batch_size=0"], "query_batch_size=0: must be >= 1"),
        (["--gin_bindings=SearchConfig.top_k = (1"], "gin configuration error: "),
        (["--gin_file=no/such.gin"], "--gin_file=no/such.gin: not found in the gin search paths"),
        (["--gin_file="], "--gin_file=: not found"),
        (["--gin.SearchConfig.top_k"], "--gin.SearchConfig.top_k: expected --gin.NAME=VALUE"),
    ],
)
def test_eval_flag_and_gin_errors(run_binary, toy, tmp_path, args, expected):
    proc = run_binary(
        "evaluate",
        "--gin_file=eval/zero_shot.gin",
        f"--dataset_dir={toy}",
        f"--output_dir={tmp_path / 'out'}",
        *args,
    )
    assert expected in _one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_output_dir_that_is_a_file_or_under_a_file(run_binary, toy, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, expected in ((a_file, "is a file, not a folder"), (a_file / "sub", "is a file")):
        proc = run_binary(
            "evaluate",
            "--gin_file=eval/zero_shot.gin",
            f"--dataset_dir={toy}",
            f"--output_dir={out}",
        )
        assert f"--output_dir={out}: " in _one_line_error(proc) and expected in proc.stderr


def test_lone_surrogate_is_refused_naming_file_and_line(tmp_path):
    data = write_toy_beir(tmp_path)
    corpus = data / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    lines[3] = json.dumps({"_id": "d3", "title": "", "text": "bad \ud800 text"})
    corpus.write_text("\n".join(lines) + "\n")
    assert "\\ud800" in corpus.read_text()  # valid JSON: the escape, not a raw code point
    with pytest.raises(
        errors.BeirFormatError, match=r"corpus\.jsonl:4: \"text\" contains the lone"
    ):
        beir.load_beir(data)


def test_negative_qrels_are_counted_and_said_how_they_are_treated(tmp_path, caplog):
    data = write_toy_beir(tmp_path)
    qrels = data / "qrels" / "test.tsv"
    qrels.write_text(qrels.read_text() + "q0\td5\t-1\n")
    with caplog.at_level(logging.WARNING):
        dataset = beir.load_beir(data)
    assert dataset.qrels["q0"]["d5"] == 0 and dataset.stats.negative_qrels == 1
    assert "1 judgment(s) with a negative score (first on line 7) are treated as score 0" in (
        caplog.text
    )


def test_full_disk_names_the_file_and_keeps_completed_files(tmp_path):
    def fill(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    fileio.atomic_write_text(tmp_path / "done.txt", "kept")
    with pytest.raises(errors.OutputWriteError) as info:
        fileio.atomic_write(tmp_path / "shard.npy", fill)
    assert str(info.value).startswith(f"{tmp_path / 'shard.npy'}: not written (No space left")
    assert "files completed before it are kept" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.txt"]  # no temporary left
    assert isinstance(info.value, errors.USER_ERRORS)


def test_ctrl_c_is_one_line_saying_what_was_kept(capsys):
    def job():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit("aligner-index", job, on_interrupt="the complete shards in X are kept")
    assert exit_info.value.code == 130
    assert (
        capsys.readouterr().err == "aligner-index: interrupted: the complete shards in X are kept\n"
    )


def test_train_without_model_dir(run_binary):
    proc = run_binary(
        "train",
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=runs/trainer.gin",
        "--gin.TRAIN_STEPS=200",
    )
    assert "MODEL_DIR" in _one_line_error(proc, "aligner-train")


@pytest.mark.parametrize(
    ("binding", "expected"),
    [
        ("beir_train_source.dataset_dir='/nope/beir'", "/nope/beir does not exist"),
        ("beir_train_source.num_negatives=-1", "expected an integer ≥ 0"),
    ],
)
def test_a_bad_task_binding_is_one_line(run_binary, tmp_path, binding, expected):
    """The tasks' own checks of their bindings are user errors: one line, no traceback (they
    raised plain ValueErrors, which kept about 50 frames and gin's notes)."""
    proc = run_binary(
        "train",
        "--gin_file=runs/scifact_minilm.gin",
        f"--gin.MODEL_DIR='{tmp_path / 'm'}'",
        "--gin.train.backbone_weights='random'",
        "--gin.DATA_DIR='../shared/data/beir/scifact'",
        f"--gin.{binding}",
    )
    assert expected in _one_line_error(proc, "aligner-train")


@pytest.mark.parametrize("file_name", ["corpus.jsonl", "queries.jsonl"])
def test_lone_surrogate_in_an_id_is_refused_naming_file_and_line(tmp_path, file_name):
    data = write_toy_beir(tmp_path)
    path = data / file_name
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "_id": "bad\ud800id"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        errors.BeirFormatError, match=re.escape(f'{file_name}:2: "_id" contains the lone')
    ):
        beir.load_beir(data)


def _broken_json_readers(directory):
    """Each reader of a JSON file of an index and the file it reads (made invalid below)."""
    from aligner_jax.indexing import ann, updates
    from aligner_jax.lexical import minicoil
    from aligner_jax.retrieval import searcher

    store = directory / "store"
    return {
        "searcher encoder.json": (
            store / "encoder.json",
            lambda: searcher.Searcher.load(str(store)),
        ),
        "add encoder.json": (
            store / "encoder.json",
            lambda: updates.add_documents(str(store), str(directory / "corpus.jsonl")),
        ),
        "minicoil.json": (
            directory / "minicoil" / "minicoil.json",
            lambda: minicoil.MiniCoilIndex.load(directory / "minicoil"),
        ),
        "token_index.json": (
            directory / "ann" / "token_index.json",
            lambda: ann.TokenIndex.load(ts.TokenStore(store), directory / "ann"),
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "searcher encoder.json",
        "add encoder.json",
        "minicoil.json",
        "token_index.json",
    ],
)
def test_invalid_json_of_an_index_names_the_file(tmp_path, case):
    from index_utils import random_documents, write_store

    write_store(tmp_path / "store", random_documents(5, 8), dim=8)
    (tmp_path / "corpus.jsonl").write_text('{"_id": "new", "text": "a new document"}\n')
    path, read = _broken_json_readers(tmp_path)[case]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": 1,,}')
    with pytest.raises(errors.IndexIntegrityError, match=re.escape(f"{path}: not valid JSON")):
        read()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.ENOSPC, "/out/ckpt/d/0.bin: not written (No space left on device); the files "),
        (errno.EDQUOT, "/out/ckpt/d/0.bin: not written (Disk quota exceeded); "),
        (errno.EFBIG, "/out/ckpt/d/0.bin: not written (File too large); "),
        (errno.EROFS, "/out/ckpt/d/0.bin: not written (Read-only file system); "),
        (errno.EACCES, "/out/ckpt/d/0.bin: Permission denied; "),
    ],
)
def test_storage_errors_outside_fileio_are_one_line_naming_the_file(capsys, code, expected):
    def job():  # as orbax, np.save or a log append would fail
        raise OSError(code, os.strerror(code), "/out/ckpt/d/0.bin")

    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit("aligner-train", job)
    message = str(exit_info.value.code)
    assert message.startswith(f"aligner-train: error: {expected}"), message
    assert "\n" not in message and "Errno" not in message


def test_other_os_errors_keep_their_traceback():
    def job():
        raise OSError(errno.EIO, "Input/output error", "/out/x")

    with pytest.raises(OSError, match="Input/output error"):
        cli.call_or_exit("aligner-train", job)


def test_a_bug_keeps_its_traceback():
    """A plain ValueError (here NumPy's shape mismatch) is a bug, not a user error: it propagates
    with its traceback instead of exiting with one line."""

    def job():
        return np.zeros(3) + np.zeros(4)

    with pytest.raises(ValueError, match="could not be broadcast together") as info:
        cli.call_or_exit("aligner-eval", job)
    assert not isinstance(info.value, errors.UserError)
    assert info.traceback[-1].name == "job"  # raised where the bug is


def test_ctrl_c_during_the_imports_of_a_binary_is_one_line(tmp_path):
    """A real SIGINT while ``python -m aligner_jax.index`` imports jax: one line, exit 130."""
    data = write_toy_beir(tmp_path)
    args = [f"--corpus={data / 'corpus.jsonl'}", f"--index_dir={tmp_path / 'index'}"]
    proc = start_python("-m", "aligner_jax.index", *args, capture=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "numpy" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)  # numpy's libraries are mapped once the binary's imports have begun
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "aligner-index: interrupted: before the job started; nothing was written"
    )
    assert not (tmp_path / "index").exists()


def _interrupt_during_flag_parsing(main, *args, **kwargs):
    raise KeyboardInterrupt


def _interrupt_after_the_job(main, *args, **kwargs):
    cli.call_or_exit("aligner-search", lambda: None)  # the job returned; its summary is printing
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "run,said",
    [
        (_interrupt_during_flag_parsing, "before the job started; nothing was written"),
        (_interrupt_after_the_job, "after the job finished; its outputs are complete"),
    ],
)
def test_ctrl_c_around_the_job_is_one_line_saying_what_was_kept(monkeypatch, capsys, run, said):
    """Ctrl-C while flags are parsed, or after the job returned (its summary printing): one
    line, exit 130, saying whether anything was written."""
    monkeypatch.setattr(cli.app, "run", run)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aligner-search"])
    with pytest.raises(SystemExit) as exit_info:
        cli.run(lambda argv: None)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == f"aligner-search: interrupted: {said}\n"


# ---------------------------------------------------------------------------------------------
# Issue 24 items 4 and 6: no silent answers, no tracebacks (a real MiniLM index of the toy
# collection, built once in-process; the jobs are called as their binaries call them).


@pytest.fixture(scope="module")
def toy_index(tmp_path_factory):
    """``aligner-index`` (zero-shot bundled MiniLM) on the toy corpus, search index included."""
    import gin

    from aligner_jax.indexing import indexer

    root = tmp_path_factory.mktemp("toy_index")
    data = write_toy_beir(root)
    cli.parse_gin(["models/minilm_identity.gin", "index/default.gin"])
    try:
        indexer.index_corpus(str(data / "corpus.jsonl"), str(root / "index"), search_index=True)
    finally:
        gin.clear_config()
    return root / "index", data


def _copy_index(toy_index, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(toy_index[0], tmp_path / "index"))


def _search(index_dir, **kwargs) -> str:
    from aligner_jax.retrieval import search_job

    return search_job.search_job(str(index_dir), **kwargs)


def _write_queries(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_search_refuses_a_corpus_file_as_queries(toy_index, tmp_path):
    index_dir, data = toy_index
    with pytest.raises(errors.BeirFormatError, match=r'corpus\.jsonl:1: record has a "title": '):
        _search(index_dir, queries=str(data / "corpus.jsonl"), output=str(tmp_path / "run"))
    # the same ids without titles: every document id is a query id
    records = [{"_id": d.doc_id, "text": d.text} for d in beir.iter_corpus(data / "corpus.jsonl")]
    queries = _write_queries(tmp_path / "q.jsonl", records)
    with pytest.raises(errors.BeirFormatError, match="this is the corpus, not queries"):
        _search(index_dir, queries=str(queries), output=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    # an empty title (Hugging Face's BeIR query exports have one) is a query file's
    queries = _write_queries(tmp_path / "q.jsonl", [{"_id": "a", "title": "", "text": "bees"}])
    assert beir.load_queries(queries) == {"a": "bees"}


def test_eval_refuses_a_corpus_file_as_queries_even_when_ids_match(tmp_path):
    """CISI-like numeric ids: the corpus given as queries.jsonl matches the qrels' query ids."""
    docs = {str(i): {"title": "", "text": f"document number {i}"} for i in range(1, 6)}
    data = write_toy_beir(tmp_path)
    (data / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": i, **d}) + "\n" for i, d in docs.items())
    )
    _write_queries(data / "queries.jsonl", [{"_id": i, "text": d["text"]} for i, d in docs.items()])
    (data / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t2\t1\n")
    with pytest.raises(errors.BeirFormatError, match=r"queries\.jsonl: its ids include every one"):
        beir.load_beir(data)


@pytest.mark.parametrize("text", ["", "   \t "])
def test_empty_and_blank_queries_are_refused_naming_the_line(tmp_path, text):
    path = _write_queries(
        tmp_path / "queries.jsonl", [{"_id": "q1", "text": "bees"}, {"_id": "q2", "text": text}]
    )
    with pytest.raises(errors.BeirFormatError, match=r"queries\.jsonl:2: query 'q2' has an empty"):
        beir.load_queries(path)


def test_empty_or_blank_query_text_in_search(toy_index):
    with pytest.raises(errors.ConfigError, match="--query is empty"):
        _search(toy_index[0], query="  ")


def test_an_empty_queries_file_is_one_line(toy_index, tmp_path, capsys):
    queries = tmp_path / "queries.jsonl"
    queries.write_text("\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit(
            "aligner-search",
            _search,
            index_dir=toy_index[0],
            queries=str(queries),
            output=str(tmp_path / "run.trec"),
        )
    assert str(exit_info.value.code) == (
        f"aligner-search: error: {queries}: the query set is empty (no records). Add one "
        '{"_id": ..., "text": ...} object per line.'
    )


def test_a_missing_or_malformed_queries_file_is_named_as_a_queries_file(toy_index, tmp_path):
    """A missing --queries file was "nonexist.jsonl: nonexist.jsonl not found." without the
    flag; a malformed line showed a corpus record as the example (a new user's findings)."""
    missing = tmp_path / "nonexist.jsonl"
    with pytest.raises(
        errors.MissingPathError, match=r"^--queries=.*nonexist\.jsonl: no such file"
    ):
        _search(toy_index[0], queries=str(missing), output=str(tmp_path / "run.trec"))
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"_id": "q1", "text": "bees"\n')
    with pytest.raises(
        errors.BeirFormatError, match=r'q\.jsonl:1: .* e\.g\. \{"_id": "q1", "text"'
    ):
        _search(toy_index[0], queries=str(bad), output=str(tmp_path / "run.trec"))


def test_output_in_a_missing_folder_is_created_and_a_folder_refused_before_search(
    toy_index, tmp_path, monkeypatch
):
    index_dir, data = toy_index
    run = tmp_path / "new" / "sub" / "run.trec"
    summary = _search(index_dir, queries=str(data / "queries.jsonl"), output=str(run), k=2)
    assert run.is_file() and f"wrote {run}" in summary
    assert len(run.read_text().splitlines()) == 2 * len(beir.load_queries(data / "queries.jsonl"))

    from aligner_jax.retrieval import searcher

    def never(*args, **kwargs):
        raise AssertionError("the index was opened before --output was checked")

    monkeypatch.setattr(searcher.Searcher, "load", never)
    with pytest.raises(errors.ConfigError, match=r"--output=.*: is a folder; give a file"):
        _search(index_dir, queries=str(data / "queries.jsonl"), output=str(tmp_path))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(errors.ConfigError, match="is a file, not a folder"):
        _search(index_dir, queries=str(data / "queries.jsonl"), output=str(a_file / "run.trec"))


def test_search_says_when_a_query_was_truncated(toy_index, tmp_path):
    long_query = " ".join(["honey bees"] * 400)  # > 512 word pieces
    out = _search(toy_index[0], query=long_query, k=1)
    assert out.splitlines()[-1] == "note: the query was cut at 512 tokens"
    assert "note:" not in _search(toy_index[0], query="honey bees", k=1)
    queries = _write_queries(
        tmp_path / "q.jsonl", [{"_id": "a", "text": long_query}, {"_id": "b", "text": "bees"}]
    )
    out = _search(toy_index[0], queries=str(queries), output=str(tmp_path / "run"), k=1)
    assert "truncated: 1 of 2 queries were cut at 512 tokens;" in out


def test_search_after_every_document_was_deleted_is_one_line(toy_index, tmp_path):
    from aligner_jax.indexing import updates

    index_dir = _copy_index(toy_index, tmp_path)
    ids = ts.TokenStore(index_dir).doc_ids
    updates.update_index(str(index_dir), delete=",".join(ids))
    with pytest.raises(errors.ConfigError, match=r"no live documents \(all 12 were deleted"):
        _search(index_dir, query="honey bees")
    assert updates.update_index(str(index_dir), force_compact=True)["rebuilt"]
    assert updates.update_index(str(index_dir), search_index=True)["search_index_rebuilt"]
    logged = [u["op"] for u in ts.read_manifest(index_dir)["updates"]]  # once adds/deletes only
    assert logged[-3:] == ["delete", "force_compact", "search_index"]


def test_delete_names_no_id(toy_index, tmp_path):
    from aligner_jax.indexing import updates

    with pytest.raises(errors.ConfigError, match="--delete=,: names no document id"):
        updates.update_index(str(toy_index[0]), delete=",")


def test_an_empty_update_flag_or_a_missing_add_file_is_named(toy_index, tmp_path):
    """``--delete=`` once ran as if absent (and said --corpus was required); a missing
    ``--add`` file was described as a whole BEIR folder."""
    from fixtures import run_python

    from aligner_jax.indexing import updates

    index_dir = _copy_index(toy_index, tmp_path)
    before = (index_dir / ts.MANIFEST).read_bytes()
    proc = run_python("-m", "aligner_jax.index", f"--index_dir={index_dir}", "--delete=")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("--delete= is empty; expected:")
    proc = run_python(  # --corpus beside an update was ignored
        "-m", "aligner_jax.index", f"--index_dir={index_dir}", "--corpus=c.jsonl", "--add=a.jsonl"
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "--corpus/--dataset_dir build an index: not with --add etc."
    )
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(errors.MissingPathError, match=f"^--add={missing}: no such file; give a"):
        updates.update_index(str(index_dir), add=str(missing))
    assert (index_dir / ts.MANIFEST).read_bytes() == before


def test_an_empty_corpus_is_refused_naming_it_before_anything_is_written(tmp_path):
    from aligner_jax.data import corpus_sources

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n\n")
    with pytest.raises(errors.BeirFormatError, match=f"--corpus={corpus}: the corpus holds no"):
        corpus_sources.open_corpus(str(corpus))


def test_full_disk_during_add_is_one_line_and_loses_nothing(toy_index, tmp_path, monkeypatch):
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import updates
    from aligner_jax.retrieval import searcher

    index_dir = _copy_index(toy_index, tmp_path)
    committed = [index_dir / ts.MANIFEST, ci.published_meta(index_dir)]
    before = [p.read_bytes() for p in committed]
    ranked = searcher.Searcher.load(str(index_dir)).search("bees make honey", k=12)
    new = _write_queries(
        tmp_path / "more.jsonl", [{"_id": "n1", "title": "", "text": "bees make honey"}]
    )
    real = fileio.atomic_write

    def full(path, write):
        if str(path).endswith(".npy"):
            raise fileio.storage_error(path, errno.ENOSPC)
        return real(path, write)

    monkeypatch.setattr(fileio, "atomic_write", full)
    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit(
            "aligner-index", updates.update_index, index_dir=str(index_dir), add=str(new)
        )
    message = str(exit_info.value.code)
    assert message.startswith(f"aligner-index: error: {index_dir}/") and "\n" not in message
    assert "No space left on device" in message
    assert [p.read_bytes() for p in committed] == before  # the index is the one before
    assert searcher.Searcher.load(str(index_dir)).search("bees make honey", k=12) == ranked
    monkeypatch.setattr(fileio, "atomic_write", real)
    assert updates.update_index(str(index_dir), add=str(new))["added_docs"] == 1


@pytest.mark.parametrize(
    ("damage", "repair"),
    [
        ("missing", "search_index"),
        ("flipped byte", "search_index"),
        ("another store's", "search_index"),
        ("flipped byte", "force_compact"),
    ],
)
def test_search_index_rebuild_repairs_a_missing_damaged_or_foreign_search_index(
    toy_index, tmp_path, damage, repair
):
    """``aligner-index --index_dir=DIR --search_index`` (what the messages suggest) rebuilds it
    with its recorded settings (the defaults when they cannot be read): the same rankings."""
    import shutil

    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import updates
    from aligner_jax.retrieval import searcher

    index_dir = _copy_index(toy_index, tmp_path)
    expected = searcher.Searcher.load(str(index_dir)).search("honey bees in the hive", k=5)
    meta = ci.published_meta(index_dir)
    if damage == "missing":
        shutil.rmtree(index_dir / ci.SUBDIR)
    elif damage == "flipped byte":
        data = bytearray(meta.read_bytes())
        data[len(data) // 2] ^= 0x20
        meta.write_bytes(bytes(data))
    else:
        other = tmp_path / "other"
        shutil.copytree(index_dir, other)
        updates.update_index(str(other), delete="d0")
        shutil.rmtree(index_dir / ci.SUBDIR)
        shutil.copytree(other / ci.SUBDIR, index_dir / ci.SUBDIR)
    with pytest.raises(errors.UserError):
        searcher.Searcher.load(str(index_dir)).search("honey bees in the hive", k=5)
    summary = updates.update_index(str(index_dir), **{repair: True})
    assert summary.get("search_index_rebuilt") or summary.get("rebuilt")
    assert searcher.Searcher.load(str(index_dir)).search("honey bees in the hive", k=5) == expected


def test_following_the_search_index_message_repairs_the_index(toy_index, tmp_path, run_binary):
    """The command a refused search index suggests, run as written, repairs it (issue 24
    item 5: a message is true when following it repairs the case it was given for)."""
    import shlex
    import shutil

    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import updates
    from aligner_jax.retrieval import searcher

    index_dir = _copy_index(toy_index, tmp_path)
    expected = searcher.Searcher.load(str(index_dir)).search("honey bees in the hive", k=5)
    other = Path(shutil.copytree(index_dir, tmp_path / "other"))
    updates.update_index(str(other), delete="d0")
    shutil.rmtree(index_dir / ci.SUBDIR)  # a search index from another store dropped in
    shutil.copytree(other / ci.SUBDIR, index_dir / ci.SUBDIR)
    with pytest.raises(errors.IndexIntegrityError) as info:
        searcher.Searcher.load(str(index_dir))
    suggested = re.search(r"aligner-(\w+)((?: --\S+)+)", str(info.value))
    assert suggested, str(info.value)
    binary = {"eval": "evaluate"}.get(suggested.group(1), suggested.group(1))
    proc = run_binary(binary, *shlex.split(suggested.group(2)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["search_index_rebuilt"]
    assert searcher.Searcher.load(str(index_dir)).search("honey bees in the hive", k=5) == expected


def test_ctrl_c_during_an_update_says_what_to_run(toy_index, capsys):
    from aligner_jax.indexing import updates

    def job():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        cli.call_or_exit("aligner-index", job, on_interrupt=updates.interrupted("IDX"))
    err = capsys.readouterr().err
    # an update is published by one rename or not at all: the index is as its last commit
    assert "as its last committed update left it" in err and "re-run the same command" in err


def test_delete_and_add_in_one_command_are_one_commit(toy_index, tmp_path, monkeypatch):
    """``--delete=d1 --add=new_d1.jsonl`` replaces a document: interrupted while adding, the
    index keeps d1 (once the delete was committed alone, and re-running the command failed on
    the id already deleted); completed, d1 has its new text and the search index one update."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import indexer, updates
    from aligner_jax.retrieval import searcher

    index_dir = _copy_index(toy_index, tmp_path)
    before = (index_dir / ts.MANIFEST).read_bytes()
    new = _write_queries(tmp_path / "new.jsonl", [{"_id": "d1", "text": "volcanic ash clouds"}])

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(indexer, "encode_shard", interrupted)
        with pytest.raises(KeyboardInterrupt):
            updates.update_index(str(index_dir), delete="d1", add=str(new))
    assert (index_dir / ts.MANIFEST).read_bytes() == before  # nothing committed
    summary = updates.update_index(str(index_dir), delete="d1", add=str(new))  # the re-run
    assert summary["deleted_docs"] == 1 and summary["added_docs"] == 1
    manifest = ts.read_manifest(index_dir)
    assert [u["op"] for u in manifest["updates"]][-2:] == ["delete", "add"]
    meta = json.loads(ci.published_meta(index_dir).read_text())
    assert meta["updates"][-1]["op"] == "delete+add"  # one generation for both
    hits = searcher.Searcher.load(str(index_dir)).search("volcanic ash clouds", k=1)
    assert hits[0].doc_id == "d1" and hits[0].text == "volcanic ash clouds"


def test_an_index_dir_that_is_no_folder_is_one_line(tmp_path):
    from aligner_jax.indexing import updates

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for path, what in ((tmp_path / "missing", "no such folder"), (a_file, "is a file, not a")):
        with pytest.raises(errors.MissingPathError, match=re.escape(f"--index_dir={path}: {what}")):
            _search(path, query="bees")
        with pytest.raises(errors.MissingPathError, match=re.escape(f"--index_dir={path}: not a")):
            updates.update_index(str(path), delete="d1")


def test_add_counts_the_documents_it_cut_and_search_says_so(toy_index, tmp_path):
    from aligner_jax.indexing import updates

    index_dir = _copy_index(toy_index, tmp_path)
    long_doc = {"_id": "long", "title": "", "text": " ".join(["honey bees"] * 600)}
    more = _write_queries(tmp_path / "more.jsonl", [long_doc, {"_id": "short", "text": "bees"}])
    summary = updates.update_index(str(index_dir), add=str(more))
    assert summary["added_docs"] == 2 and summary["truncated_docs"] == 1
    assert ts.read_manifest(index_dir)["stats"]["truncated_docs"] == 1  # the toy corpus: none
    note = _search(index_dir, query="honey bees", k=1).splitlines()[-1]
    assert note == f"note: the index cut 1 documents at {summary['doc_maxlen']} tokens"


def test_deleting_an_unknown_id_is_one_line_and_deletes_nothing(toy_index, tmp_path, capsys):
    from aligner_jax.indexing import updates

    index_dir = _copy_index(toy_index, tmp_path)
    manifest = (index_dir / ts.MANIFEST).read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit(
            "aligner-index", updates.update_index, index_dir=str(index_dir), delete="d1,nope"
        )
    message = str(exit_info.value.code)
    assert (
        message.startswith("aligner-index: error: --delete: 1 ids are not ") and "\n" not in message
    )
    assert str(index_dir) in message and message.endswith("(e.g. ['nope']); nothing was deleted")
    assert (index_dir / ts.MANIFEST).read_bytes() == manifest


_SUGGESTED_BINDING = re.compile(
    r"""--gin\.([A-Za-z_][\w.]*)=((?:"[^"\n]*"|'[^'\n]*'|[^\s"'`),;:])+)"""
)


def test_every_binding_a_message_or_docstring_shows_survives_a_shell():
    """A ``--gin.X=V`` the package prints (messages, docstrings) or the docs show works when
    pasted into a shell:
    the shell strips one level of quotes, and gin then needs a Python literal (or a @ / %
    reference), so a string value must be written ``"'full'"``, not ``'full'``."""
    import ast
    import shlex

    wrong = []
    repo = Path(__file__).parent.parent
    for path in [
        *sorted((repo / "aligner_jax").rglob("*.py")),
        repo / "README.md",
        repo / "WORKSPACE.md",
    ]:
        text = path.read_text().replace('\\"', '"')
        for number, line in enumerate(text.splitlines(), 1):
            for name, value in _SUGGESTED_BINDING.findall(line):
                if "{" in value or value in ("VALUE",):  # f-string fields, placeholders
                    continue
                try:
                    (word,) = shlex.split(value)
                    if not word.startswith(("@", "%")):
                        ast.literal_eval(word)
                except (ValueError, SyntaxError):
                    wrong.append(f"{path.name}:{number}: --gin.{name}={value}")
    assert not wrong, "bindings a shell turns into non-literals:\n" + "\n".join(wrong)


@pytest.mark.parametrize("file_name", ["corpus.jsonl", "queries.jsonl"])
def test_whitespace_inside_an_id_is_refused_naming_file_and_line(tmp_path, file_name):
    """Such ids were indexed, then written into TREC runs that --rerank_run and trec_eval split
    at the space (``q1 Q0 doc 1 1 0.66``: "7 fields")."""
    data = write_toy_beir(tmp_path)
    path = data / file_name
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "_id": "doc\t2"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        errors.BeirFormatError, match=re.escape(f"{file_name}:2: \"_id\" 'doc\\t2' contains white")
    ):
        beir.load_beir(data)


def test_whitespace_inside_an_id_is_refused_by_the_python_index_and_the_writer(tmp_path):
    from aligner_jax.indexing import token_store as ts

    model = {"name": "test", "fingerprint": "f", "dim": 4, "projection": "dense"}
    with pytest.raises(errors.ConfigError, match="contains whitespace"):
        with ts.TokenStoreWriter(tmp_path / "s", model) as writer:
            writer.add("doc 1", np.eye(4, dtype=np.float32)[:2])


@pytest.mark.parametrize(
    ("gin_file", "warned"), [("models/minilm.gin", True), ("models/minilm_identity.gin", False)]
)
def test_untrained_heads_on_a_pretrained_backbone_are_named(gin_file, warned, caplog):
    """models/minilm.gin without a checkpoint (as WORKSPACE's TPU-pod indexing example was
    written) indexed with random 128-d projection and salience heads without a word."""
    from aligner_jax.encoding import loading

    cli.parse_gin([gin_file])
    with caplog.at_level("WARNING"):
        bundle = loading.load_encoder()
    said = "randomly initialised (pretrained backbone 'minilm'" in caplog.text
    assert said == warned, caplog.text
    assert bundle.config.projection == ("dense" if warned else "identity")


def test_an_unfinished_index_rerun_with_a_changed_corpus_names_it(tmp_path):
    """A job stopped after its first shards, re-run on an edited corpus: the re-run said
    "manifest.json is missing ... re-run the command that built it", which is what the user
    just did; the real cause, the corpus's changed checksum, was computed and dropped. (A bad
    line no longer leads here: the corpus is checked whole before the first shard.)"""
    import gin

    from aligner_jax.indexing import indexer

    data = write_toy_beir(tmp_path)
    corpus = data / "corpus.jsonl"
    index_dir = tmp_path / "index"
    cli.parse_gin(["models/minilm_identity.gin"], ["IndexingConfig.shard_size = 5"])
    try:
        indexer.index_corpus(str(corpus), str(index_dir), search_index=False)
        (index_dir / ts.MANIFEST).unlink()  # as if stopped before the last shard
        corpus.write_text(corpus.read_text().replace("Honey bees", "Honey bee"))
        with pytest.raises(errors.IndexIntegrityError) as refused:
            indexer.index_corpus(str(corpus), str(index_dir), search_index=False)
    finally:
        gin.clear_config()
    message = str(refused.value)
    assert "did not finish" in message and "other settings" in message and "'corpus'" in message


def test_the_same_corpus_at_another_path_resumes_and_reuses_its_index(tmp_path):
    """A corpus moved (or mounted elsewhere) was 'started with other settings': only its path
    differed, bytes and sha256 the same."""
    import gin

    from aligner_jax.indexing import indexer

    corpus = write_toy_beir(tmp_path) / "corpus.jsonl"
    moved = tmp_path / "elsewhere" / "corpus.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(corpus.read_bytes())
    index_dir = tmp_path / "index"
    cli.parse_gin(["models/minilm_identity.gin"], ["IndexingConfig.shard_size = 5"])
    try:
        indexer.index_corpus(str(corpus), str(index_dir))
        before = (index_dir / ts.MANIFEST).read_bytes()
        again = indexer.index_corpus(str(moved), str(index_dir))
    finally:
        gin.clear_config()
    assert again.complete and again.shards_written == 0
    assert (index_dir / ts.MANIFEST).read_bytes() == before  # search index still published
    assert json.loads(before)["corpus"]["path"] == str(corpus.resolve())


@pytest.mark.parametrize(
    ("binding", "quoted"),
    [
        ("MODEL_DIR=/tmp/x", "--gin.MODEL_DIR=\"'/tmp/x'\""),
        ("DataConfig.task=beir_train_bm25", "--gin.DataConfig.task=\"'beir_train_bm25'\""),
    ],
)
def test_an_unquoted_string_binding_is_named_with_its_quoted_form(binding, quoted):
    """A shell strips the quotes of ``--gin.MODEL_DIR=/tmp/x``; gin then said "Unable to parse
    value. (line 1)" or "malformed node or string ... <ast.Name object at 0x...>"."""
    import gin

    try:
        with pytest.raises(errors.ConfigError) as refused:
            cli.parse_gin(["runs/scifact_minilm.gin"], [binding])
    finally:
        gin.clear_config()
    assert str(refused.value).endswith(f"quote it: {quoted}")


def test_a_misspelt_macro_binding_is_refused_with_the_close_name():
    """gin accepted ``--gin.TRAIN_STEPSS=5`` and trained the gin file's 600 steps."""
    import gin

    try:
        with pytest.raises(errors.ConfigError) as refused:
            cli.parse_gin(["runs/scifact_minilm.gin"], ["MODEL_DIR='/tmp/x'", "TRAIN_STEPSS=5"])
        gin.clear_config()
        cli.parse_gin(["runs/scifact_minilm.gin"], ["MODEL_DIR='/tmp/x'", "TRAIN_STEPS=5"])
        assert gin.query_parameter("%TRAIN_STEPS") == 5
    finally:
        gin.clear_config()
    assert str(refused.value) == (
        "--gin.TRAIN_STEPSS: no gin file uses the macro TRAIN_STEPSS (%TRAIN_STEPSS), so this "
        "binding would change nothing; did you mean --gin.TRAIN_STEPS?"
    )


def test_a_compressed_corpus_is_named_as_compressed_not_as_invalid_utf8(tmp_path):
    """--corpus=x.jsonl.gz said "invalid UTF-8 ... re-encode it with iconv -f latin1"."""
    import gzip

    path = tmp_path / "corpus.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"_id": "a", "text": "fine"}\n'))
    with pytest.raises(
        errors.BeirFormatError, match=r"corpus.jsonl.gz: a compressed file .*gunzip"
    ):
        list(beir.iter_corpus(path))


def test_a_bad_search_index_binding_is_refused_as_itself(tmp_path, caplog):
    """--search_index with --gin.CentroidIndexConfig.residual_bits=3 first warned "recorded
    search index settings refused (...); using the defaults", blaming the index's record."""
    import gin

    from aligner_jax.indexing import centroid_index as ci

    cli.parse_gin([], ["CentroidIndexConfig.residual_bits = 3"])
    try:
        with pytest.raises(errors.ConfigError, match=r"residual_bits=3"):
            ci.recorded_config(tmp_path)
    finally:
        gin.clear_config()
    assert "recorded search index settings refused" not in caplog.text


def test_rerank_run_beside_a_first_stage_names_where_that_stage_came_from(tmp_path):
    """--gin_file=eval/hybrid.gin --rerank_run=... said "drop --gin.evaluate.first_stage=
    'hybrid'", a flag the user had not typed."""
    from aligner_jax.evaluation import beir_eval
    from aligner_jax.retrieval import searcher as search_lib

    config = search_lib.SearchConfig()
    with pytest.raises(
        errors.ConfigError, match=r"which is 'hybrid' here \(a gin file such as eval/hybrid.gin"
    ):
        beir_eval.check_first_stage("hybrid", str(tmp_path / "run.trec"), False, config)


def test_sigterm_inside_a_binary_is_handled_as_ctrl_c_with_status_143(monkeypatch, capsys):
    """A cluster's or service manager's SIGTERM killed a binary without its cleanup (an
    embedded publish left its hidden .partial folder behind); it is now Ctrl-C's path: what was
    written is kept, temporary files are removed, one line, exit 143."""
    cleaned = []

    def job():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises before this ends
        finally:
            cleaned.append(True)

    def run(main, *args, **kwargs):
        cli.call_or_exit("aligner-publish", job, on_interrupt="nothing was published")

    monkeypatch.setattr(cli.app, "run", run)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aligner-publish"])
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.run(lambda argv: None)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert exit_info.value.code == 143 and cleaned == [True]
    assert capsys.readouterr().err == (
        "aligner-publish: terminated (SIGTERM): nothing was published\n"
    )


def _toy_corpus_and_an_addition(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the toy corpus.jsonl, a one-document corpus to --add, where the index goes)."""
    corpus = write_toy_beir(tmp_path) / "corpus.jsonl"
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "x1", "title": "", "text": "an added document"}) + "\n")
    return corpus, more, tmp_path / "index"


def test_rerunning_the_build_of_an_updated_index_counts_the_corpus_alone(tmp_path):
    """It printed the corpus's documents and shards beside the updated index's tokens."""
    import gin

    from aligner_jax.indexing import indexer, updates

    corpus, more, index_dir = _toy_corpus_and_an_addition(tmp_path)
    cli.parse_gin(["models/minilm_identity.gin"], ["IndexingConfig.shard_size = 5"])
    try:
        first = indexer.index_corpus(str(corpus), str(index_dir), search_index=False)
        updates.update_index(str(index_dir), add=str(more))
        again = indexer.index_corpus(str(corpus), str(index_dir), search_index=False)
    finally:
        gin.clear_config()
    assert (again.num_docs, again.num_tokens, again.num_shards) == (
        first.num_docs, first.num_tokens, first.num_shards,
    )  # fmt: skip
    assert ts.read_manifest(index_dir)["counts"]["num_tokens"] > first.num_tokens


def test_an_add_says_which_indexing_bindings_it_does_not_apply(tmp_path, caplog):
    """--add with --gin.IndexingConfig.shard_size=1 used the index's recorded settings without
    a word; --compact with --search_index dropped the compact silently."""
    import gin

    from aligner_jax.indexing import indexer, updates

    corpus, more, index_dir = _toy_corpus_and_an_addition(tmp_path)
    cli.parse_gin(["models/minilm_identity.gin"], ["IndexingConfig.shard_size = 5"])
    try:
        indexer.index_corpus(str(corpus), str(index_dir), search_index=False)
    finally:
        gin.clear_config()
    cli.parse_gin([], ["IndexingConfig.shard_size = 1"])
    try:
        with caplog.at_level("WARNING"):
            updates.update_index(str(index_dir), add=str(more))
    finally:
        gin.clear_config()
    assert "not applied: {'shard_size': 1}" in caplog.text
    with pytest.raises(errors.ConfigError, match=r"--search_index \(alone\) rebuilds .* give one"):
        updates.update_index(str(index_dir), compact_index=True, search_index=True)
