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
    from aligner_jax.indexing import centroid_index as ci
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
        "compact meta": (
            store / ci.SUBDIR / ci.META,
            lambda: updates.compact(str(store), force=True),
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
        "compact meta",
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
