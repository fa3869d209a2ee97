"""Corpus streams for indexing: seqio tasks and TFDS-style sources give what a JSONL corpus gives."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import seqio
import tensorflow as tf
from fixtures import REPO, run_module

from aligner_jax.common import errors
from aligner_jax.data import corpus_sources as cs
from aligner_jax.indexing import token_store as ts

RECORDS = [
    {"_id": f"d{i}", "title": f"title {i}", "text": f"text of document {i} " * (i % 5 + 1)}
    for i in range(14)
]
RECORDS[3]["text"] = "naïve café — ünïcode"

TASK_MODULE = """
import seqio
import tensorflow as tf

RECORDS = {records!r}


def _dataset_fn(split, shuffle_files, seed=None):
    del shuffle_files, seed
    columns = {{key: [r[key] for r in RECORDS] for key in ("_id", "title", "text")}}
    return tf.data.Dataset.from_tensor_slices(columns)


if "{name}" not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
        "{name}",
        source=seqio.FunctionDataSource(_dataset_fn, splits=("train",)),
        output_features={{}},
    )
"""


def _register(name: str, records: list[dict], keys=("_id", "title", "text")) -> None:
    if name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)

    def dataset_fn(split, shuffle_files, seed=None):
        del split, shuffle_files, seed
        return tf.data.Dataset.from_tensor_slices({k: [r[k] for r in records] for k in keys})

    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=("train",)),
        output_features={},
    )


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_seqio_task_streams_the_same_documents_as_jsonl(tmp_path):
    _register("aligner_test_corpus", RECORDS)
    from_task, info = cs.open_corpus("seqio:aligner_test_corpus", "train")
    from_file, _ = cs.open_corpus(str(_write_jsonl(tmp_path / "corpus.jsonl", RECORDS)))
    assert list(from_task) == list(from_file)
    assert info == {
        "source": "seqio:aligner_test_corpus",
        "split": "train",
        "features": {"id_key": "_id", "text_key": "text", "title_key": "title"},
    }


def test_missing_title_feature_gives_empty_titles():
    _register("aligner_test_untitled", RECORDS, keys=("_id", "text"))
    docs = list(cs.iter_dataset_documents("seqio:aligner_test_untitled", "train"))
    assert [d.title for d in docs] == [""] * len(RECORDS)
    assert docs[3].text == RECORDS[3]["text"]


def test_renamed_features_through_corpus_features():
    renamed = [{"docid": r["_id"], "contents": r["text"]} for r in RECORDS]
    _register("aligner_test_renamed", renamed, keys=("docid", "contents"))
    with pytest.raises(ValueError, match=r"no feature '_id'.*CorpusFeatures\.id_key"):
        cs.iter_dataset_documents("seqio:aligner_test_renamed", "train")
    features = cs.CorpusFeatures(id_key="docid", text_key="contents")
    docs = list(cs.iter_dataset_documents("seqio:aligner_test_renamed", "train", features))
    assert [d.doc_id for d in docs] == [r["_id"] for r in RECORDS]


def test_bad_sources_name_the_flag():
    with pytest.raises(ValueError, match=r"--corpus=seqio:no_such_task: no seqio task"):
        cs.open_corpus("seqio:no_such_task", "train")
    _register("aligner_test_corpus", RECORDS)
    with pytest.raises(ValueError, match=r"--corpus_split=test: .* has splits \['train'\]"):
        cs.open_corpus("seqio:aligner_test_corpus", "test")
    with pytest.raises(FileNotFoundError, match=r"--corpus=/nonexistent.jsonl: no such file"):
        cs.open_corpus("/nonexistent.jsonl")
    # a TypeError / ValueError traceback before: the version is required by seqio's TFDS source
    for spec in ("tfds:mnist", "tfds:"):
        with pytest.raises(ValueError, match=rf"--corpus={spec}: give a TFDS dataset with its "):
            cs.open_corpus(spec, "train")


def test_seqio_ids_follow_the_one_id_rule():
    """A seqio/TFDS corpus kept ids with spaces, empty ones, and " 7 " apart from "7"."""
    records = [dict(RECORDS[i], _id=v) for i, v in enumerate([" 7 ", "a", "b"])]
    _register("aligner_test_ids", records)
    got = [d.doc_id for d in cs.iter_dataset_documents("seqio:aligner_test_ids", "train")]
    assert got == ["7", "a", "b"]
    for bad, reason in (("a b", r"'a b' contains whitespace"), ("", "is empty")):
        _register("aligner_test_ids", [dict(RECORDS[0]), dict(RECORDS[1], _id=bad)])
        with pytest.raises(
            errors.BeirFormatError, match=rf"record 1: the id \(feature '_id'\) {reason}"
        ):
            list(cs.iter_dataset_documents("seqio:aligner_test_ids", "train"))


def test_duplicate_ids_and_bad_utf8_name_the_record():
    _register("aligner_test_dupes", [RECORDS[0], RECORDS[1], RECORDS[0]])
    with pytest.raises(errors.BeirFormatError, match=r"record 2: duplicate document id 'd0'.*0"):
        list(cs.iter_dataset_documents("seqio:aligner_test_dupes", "train"))
    bad = [dict(RECORDS[0]), dict(RECORDS[1], text=b"\xff\xfe broken")]
    _register("aligner_test_bytes", bad)
    with pytest.raises(
        errors.BeirFormatError, match=r"record 1: feature 'text' is not valid UTF-8"
    ):
        list(cs.iter_dataset_documents("seqio:aligner_test_bytes", "train"))


def _index(corpus: str, index_dir: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return run_module(
        "aligner_jax.index",
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=index/default.gin",
        "--gin.IndexingConfig.shard_size=4",
        f"--corpus={corpus}",
        f"--index_dir={index_dir}",
        *extra,
        **env,
    )


def test_aligner_index_on_a_seqio_task_matches_the_jsonl_index(tmp_path):
    """The binary indexes a seqio task registered by a gin `import` to the same shard bytes."""
    module = tmp_path / "toy_corpus_tasks.py"
    module.write_text(textwrap.dedent(TASK_MODULE.format(records=RECORDS, name="toy_corpus")))
    gin_file = tmp_path / "toy_corpus.gin"
    gin_file.write_text("import toy_corpus_tasks\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}  # the task module beside the package
    task = _index("seqio:toy_corpus", tmp_path / "task_index", env, f"--gin_file={gin_file}")
    assert task.returncode == 0, task.stderr[-2000:]
    jsonl = _index(str(_write_jsonl(tmp_path / "c.jsonl", RECORDS)), tmp_path / "jsonl_index", env)
    assert jsonl.returncode == 0, jsonl.stderr[-2000:]
    stores = [
        ts.TokenStore(tmp_path / d, verify_checksums=True) for d in ("task_index", "jsonl_index")
    ]
    assert stores[0].doc_ids == stores[1].doc_ids == [r["_id"] for r in RECORDS]
    sums = [
        {m["path"]: m["sha256"] for s in st.manifest["shards"] for m in s["files"].values()}
        for st in stores
    ]
    assert sums[0] == sums[1] and len(sums[0]) == 4 * 5  # 4 shards x 5 files
    wrong_split = _index(
        "seqio:toy_corpus", tmp_path / "x", env, f"--gin_file={gin_file}", "--corpus_split=dev"
    )
    assert wrong_split.returncode != 0
    assert "--corpus_split=dev" in wrong_split.stderr and not (tmp_path / "x").exists()


def test_a_jsonl_corpus_is_checked_and_counted_before_it_is_indexed(tmp_path):
    """The indexing job's progress has a total (an ETA) for a JSONL corpus: its records (CRLF,
    blank lines, a line of a lone BOM or no-break space, and a last line without a newline
    included), counted as the reader counts them (a BOM-only line was one too many)."""
    import hashlib

    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in RECORDS]
    body = "\r\n".join(lines[:2]) + "\n\n  \n\u00a0\n" + "\n".join(lines[2:])
    path.write_bytes(body.encode())
    assert cs.file_sha256(path, chunk_bytes=7) == hashlib.sha256(path.read_bytes()).hexdigest()
    documents, info = cs.open_corpus(str(path))
    assert len(documents) == len(RECORDS)
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [d.doc_id for d in documents] == [r["_id"] for r in RECORDS]


def test_a_bad_line_at_the_end_stops_the_job_before_anything_is_written(tmp_path):
    """A duplicate id on the last line was found after 5 shards were written; the fixed file
    (another sha256) then could not resume them: 'started with other settings'."""
    path = _write_jsonl(tmp_path / "c.jsonl", RECORDS + [RECORDS[0]])
    with pytest.raises(errors.BeirFormatError, match=rf"{path}:15: duplicate document id 'd0'"):
        cs.open_corpus(str(path))
    proc = _index(str(path), tmp_path / "idx", {})
    assert proc.returncode == 1 and ":15: duplicate document id 'd0'" in proc.stderr
    assert not (tmp_path / "idx").exists() or not list((tmp_path / "idx").glob("shard-*"))
