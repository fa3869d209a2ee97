"""Atomic writes with the umask's mode, output-folder checks, metrics.json as commit marker."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat

import pytest

from aligner_jax.common import errors, fileio


def test_atomic_files_get_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        path = fileio.atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not list(tmp_path.glob(".*.tmp"))


def test_output_dir_checks_create_nothing(tmp_path, monkeypatch):
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(errors.ConfigError, match=r"^--output_dir=.*/f: is a file, not a folder"):
        fileio.check_output_dir(a_file, "--output_dir")
    with pytest.raises(errors.ConfigError, match=r"/f/out: .*/f is a file, not a folder"):
        fileio.check_output_dir(a_file / "out", "--output_dir")
    assert fileio.check_output_dir(tmp_path / "new" / "out", "--output_dir")
    assert not (tmp_path / "new").exists()

    # No write permission / read-only filesystem (simulated: root ignores permission bits).
    def read_only(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fileio.tempfile, "mkstemp", read_only)
    with pytest.raises(
        errors.ConfigError,
        match=r"^--index_dir=.*/new: cannot write in .* \(Read-only file system\)",
    ):
        fileio.check_output_dir(tmp_path / "new", "--index_dir")


def test_metrics_json_is_written_last_with_the_files_checksums(tmp_path, monkeypatch):
    (tmp_path / "metrics.json").write_text("{}")  # from an earlier run
    written = []
    real = fileio.atomic_write_bytes
    monkeypatch.setattr(
        fileio, "atomic_write_bytes", lambda p, d: written.append(p.name) or real(p, d)
    )
    report = fileio.write_outputs(tmp_path, {"run.trec": "q Q0 d 1 1.0 t\n"}, {"x": 1})
    assert written == [fileio.PENDING_OUTPUTS, "run.trec", "metrics.json"]
    assert not (tmp_path / fileio.PENDING_OUTPUTS).exists()
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved == report
    assert saved["files"] == {"run.trec": hashlib.sha256(b"q Q0 d 1 1.0 t\n").hexdigest()}


def test_a_rerun_removes_the_files_of_the_run_before_that_it_does_not_write(tmp_path):
    """A re-run without --adapt once left adaptation.json beside a metrics.json not listing
    it (and contradicting it); files the job never wrote stay."""
    (tmp_path / "notes.txt").write_text("the user's")
    fileio.write_outputs(tmp_path, {"run.trec": "a", "adaptation.json": "{}"}, {})
    report = fileio.write_outputs(tmp_path, {"run.trec": "b"}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "notes.txt", "run.trec"]
    assert list(report["files"]) == ["run.trec"]


def test_interrupted_output_leaves_no_metrics_json(tmp_path, monkeypatch):
    (tmp_path / "metrics.json").write_text("{}")  # from an earlier run
    real = fileio.atomic_write_bytes

    def disk_full(path, data):
        if path.name != fileio.PENDING_OUTPUTS:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(fileio, "atomic_write_bytes", disk_full)
    with pytest.raises(OSError):
        fileio.write_outputs(tmp_path, {"run.trec": "x"}, {})
    assert not (tmp_path / "metrics.json").exists()


def test_a_run_after_an_interrupted_one_removes_what_the_one_before_wrote(tmp_path, monkeypatch):
    """--adapt wrote adaptation.json; a re-run interrupted after it removed metrics.json lost
    the list, so the run after it left adaptation.json beside a metrics.json not listing it."""
    fileio.write_outputs(tmp_path, {"run.trec": "a", "adaptation.json": "{}"}, {})
    real = fileio.atomic_write_bytes

    def interrupted(path, data):
        if path.name == "run.trec":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(fileio, "atomic_write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fileio.write_outputs(tmp_path, {"run.trec": "b"}, {})
    monkeypatch.setattr(fileio, "atomic_write_bytes", real)
    report = fileio.write_outputs(tmp_path, {"run.trec": "c"}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "run.trec"]
    assert list(report["files"]) == ["run.trec"]


def test_permission_error_names_the_output_not_the_temporary(tmp_path, monkeypatch):
    def denied(path):
        tmp = str(path.parent / f".{path.name}.0000.tmp")
        raise PermissionError(errno.EACCES, "Permission denied", tmp)

    monkeypatch.setattr(fileio, "_create_temporary", denied)
    with pytest.raises(OSError) as info:
        fileio.atomic_write_text(tmp_path / "metrics.json", "{}")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'metrics.json'}: Permission denied"), message
    assert ".tmp" not in message
    assert isinstance(info.value, errors.USER_ERRORS)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_release_pages_drops_a_maps_pages_from_rss_and_keeps_its_bytes(tmp_path):
    import numpy as np
    from index_utils import mapped_rss_kib

    values = np.arange(1 << 20, dtype=np.int32)  # 4 MiB
    np.save(tmp_path / "a.npy", values)
    mapped = fileio.load_npy(tmp_path / "a.npy")
    assert int(mapped.sum(dtype=np.int64)) == int(values.sum(dtype=np.int64))  # every page read
    assert mapped_rss_kib(mapped) >= 4000
    assert fileio.release_pages(mapped)
    assert mapped_rss_kib(mapped) < 100
    np.testing.assert_array_equal(mapped, values)  # read back from the page cache
    assert not fileio.release_pages(values)  # not a map: nothing to release


def test_npy_stream_writes_rows_without_copying_them(tmp_path):
    """A streamed ``.npy`` holds what was written (np.load, sha256) and writing a block does
    not copy it: the token lists of a 100M-token build write 256 MiB blocks, and a copy per
    block set the build's peak memory (stop 63: 1.11 GiB at 10× SciFact with token lists)."""
    import tracemalloc

    import numpy as np

    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 255, (1 << 17, 64), dtype=np.uint8) for _ in range(2)]
    path = tmp_path / "rows.npy"
    tracemalloc.start()
    try:
        with fileio.NpyStream(path, (2 << 17, 64), np.uint8) as stream:
            tracemalloc.reset_peak()
            for block in blocks:
                stream.write(block)
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < blocks[0].nbytes // 4, peak  # a copy of a block would be 8 MiB
    np.testing.assert_array_equal(np.load(path), np.concatenate(blocks))
    assert fileio.sha256_tracked(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_size_limit_is_one_line_for_npy_and_sqlite_writes(tmp_path):
    """Under ``ulimit -f`` (as on a full disk) NumPy's short write had no errno and SQLite's
    error was no OSError: ``aligner-index --add`` ended in a traceback instead of one line."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, resource, numpy as np
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        from aligner_jax.common import errors, fileio
        from aligner_jax.indexing import documents
        for name, write in [
            ("npy", lambda: fileio.atomic_save_npy({str(tmp_path)!r} + "/a.npy", np.ones(10**6))),
            ("sqlite", lambda: documents.write_shard({str(tmp_path)!r}, 0, [
                documents.IndexDocument(f"d{{i}}", "", os.urandom(4000).hex(), {{}})
                for i in range(100)])),
        ]:
            try:
                write()
                print(name, "written")
            except errors.OutputWriteError as e:
                print(name, "|", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" | ", 1) for line in out.stdout.splitlines())
    assert lines["npy"].startswith(f"{tmp_path}/a.npy: not written (File too large)")
    assert lines["sqlite"].startswith(f"{tmp_path}/documents.sqlite: not written (")
    assert not list(tmp_path.glob(".*.tmp"))  # nothing partial left


def test_a_journal_left_by_a_failed_write_is_one_line_where_it_cannot_be_undone(
    tmp_path, monkeypatch
):
    """Read-only, the rollback of a hot journal needs a writer: once a traceback."""
    import sqlite3

    from aligner_jax.indexing import documents

    documents.write_shard(tmp_path, 0, [documents.IndexDocument("d0", "t", "x", {})])

    class HotJournal:  # the read-only connection's first read: the journal needs a rollback
        def execute(self, *_):
            raise sqlite3.OperationalError("attempt to write a readonly database")

        def close(self):
            pass

    def connect(target, *args, **kwargs):
        if str(target).startswith("file:"):
            return HotJournal()
        raise sqlite3.OperationalError("attempt to write a readonly database")  # read-only

    monkeypatch.setattr(documents.sqlite3, "connect", connect)
    with pytest.raises(errors.IndexIntegrityError, match=r"documents.sqlite: a write that failed"):
        documents.DocumentTable(tmp_path, [{"index": 0, "num_docs": 1}]).fetch([0])
