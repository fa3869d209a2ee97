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
    assert written == ["run.trec", "metrics.json"]
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

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio, "atomic_write_bytes", disk_full)
    with pytest.raises(OSError):
        fileio.write_outputs(tmp_path, {"run.trec": "x"}, {})
    assert not (tmp_path / "metrics.json").exists()


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
