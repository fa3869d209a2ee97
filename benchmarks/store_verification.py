r"""Load-time cost of the token store's default verification (issue 11, item 3).

Opening a store checks every file's size; on the first open it also hashes every file (sha256)
and records ``.verified.json``; later opens re-hash only files whose size, mtime, ctime or inode
changed. This measures, on a copy of a real store:

  * first open  (no record: every file hashed)             — ``TokenStore(dir)``
  * later opens (record matches: stat + manifest hash only) — ``TokenStore(dir)``, repeated
  * ``--verify_checksums`` (hash every file regardless)     — ``TokenStore(dir, True)``
  * raw hashing throughput of the same bytes: sha256, blake2b, zlib.crc32 (hashlib/zlib only)

Page cache: the files are read once before timing, so every figure is warm-cache (a cold first
open adds the disk read, which any search pays anyway when it touches the vectors).

  .venv/bin/python benchmarks/store_verification.py --index_dir=/tmp/scifact_index_copy

Prints a table and writes benchmarks/results/store_verification.{json,md}.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

from absl import app, flags

from aligner_jax.common import fileio
from aligner_jax.indexing import token_store as ts

REPO = Path(__file__).resolve().parent.parent
_INDEX_DIR = flags.DEFINE_string(
    "index_dir",
    None,
    "A complete token store (a copy: it is opened and its .verified.json rewritten).",
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions of each open.")
_OUTPUT = flags.DEFINE_string(
    "output", str(REPO / "benchmarks" / "results" / "store_verification"), "Output path stem."
)


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _hash_all(paths: list[Path], make) -> None:
    for path in paths:
        h = make()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, chunk: bytes) -> None:
        self.value = zlib.crc32(chunk, self.value)


def measure(directory: Path, repeats: int) -> dict:
    load_before = os.getloadavg()
    manifest = ts.read_manifest(directory)
    paths = [directory / m["path"] for s in manifest["shards"] for m in s["files"].values()]
    nbytes = sum(p.stat().st_size for p in paths)
    _hash_all(paths, _Crc32)  # warm the page cache
    marker = directory / ts.VERIFIED

    def first_open():
        marker.unlink(missing_ok=True)
        assert ts.TokenStore(directory).checksums_verified

    def later_open():
        assert not ts.TokenStore(directory).checksums_verified

    first = _timed(first_open, repeats)
    later = _timed(later_open, repeats)
    forced = _timed(lambda: ts.TokenStore(directory, verify_checksums=True), repeats)
    hashes = {
        name: min(_timed(lambda make=make: _hash_all(paths, make), max(1, repeats // 2)))
        for name, make in (
            ("sha256", hashlib.sha256),
            ("blake2b", hashlib.blake2b),
            ("crc32", _Crc32),
        )
    }
    return {
        "index_dir": str(directory),
        "num_files": len(paths),
        "bytes": nbytes,
        "num_docs": manifest["counts"]["num_docs"],
        "num_tokens": manifest["counts"]["num_tokens"],
        "repeats": repeats,
        "first_open_s": {"median": statistics.median(first), "all": first},
        "later_open_s": {"median": statistics.median(later), "all": later},
        "verify_checksums_open_s": {"median": statistics.median(forced), "all": forced},
        "hash_mb_per_s": {k: nbytes / 1e6 / v for k, v in hashes.items()},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "loadavg_1_5_15_before": load_before,
            "loadavg_1_5_15_after": os.getloadavg(),
        },
    }


def markdown(r: dict) -> str:
    mb = r["bytes"] / 1e6
    rows = [
        ("first open (every file hashed, record written)", r["first_open_s"]["median"]),
        ("later open (record matches: stat + manifest hash)", r["later_open_s"]["median"]),
        (
            "open with --verify_checksums (every file hashed)",
            r["verify_checksums_open_s"]["median"],
        ),
    ]
    lines = [
        "# Token store verification cost",
        "",
        f"Store `{r['index_dir']}`: {r['num_docs']:,} documents, {r['num_tokens']:,} tokens, "
        f"{r['num_files']} files, {mb:,.1f} MB; warm page cache; median of {r['repeats']} runs; "
        f"load average {r['machine']['loadavg_1_5_15_before'][0]:.1f} before, "
        f"{r['machine']['loadavg_1_5_15_after'][0]:.1f} after on {r['machine']['cpus']} CPUs "
        "(another job shared the machine).",
        "",
        "| open | seconds |",
        "|---|---|",
        *[f"| {name} | {s:.3f} |" for name, s in rows],
        "",
        "Hashing throughput of the same files (one core): "
        + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in r["hash_mb_per_s"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _INDEX_DIR.value:
        raise app.UsageError("--index_dir is required (a copy of a complete token store)")
    report = measure(Path(_INDEX_DIR.value), _REPEATS.value)
    text = markdown(report)
    print(text)
    stem = Path(_OUTPUT.value)
    stem.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(stem.with_suffix(".json"), report, sort_keys=False)
    fileio.atomic_write_text(stem.with_suffix(".md"), text)
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    app.run(main)
