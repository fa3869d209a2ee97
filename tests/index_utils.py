"""Helpers for tests that need a token store without running an encoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aligner_jax.indexing import token_store as ts


def random_documents(num_docs: int, dim: int, seed: int = 0, min_len: int = 3, max_len: int = 40):
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(num_docs):
        m = int(rng.integers(min_len, max_len + 1))
        v = rng.normal(size=(m, dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        docs.append(
            ts.EncodedDocument(
                doc_id=f"doc{i}",
                vectors=v.astype(np.float16),
                salience=rng.uniform(0.1, 1.0, size=m).astype(np.float32),
                token_ids=rng.integers(5, 60, size=m).astype(np.int32),
            )
        )
    return docs


def write_store(
    directory: Path, docs, dim: int, shard_size: int = 7, fingerprint: str = "test-model"
) -> ts.TokenStore:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for s, start in enumerate(range(0, len(docs), shard_size)):
        entries.append(ts.write_shard(directory, s, docs[start : start + shard_size], dim))
    manifest = {
        "model": {"name": "test", "fingerprint": fingerprint, "dim": dim, "projection": "dense"},
        "counts": {
            "num_docs": len(docs),
            "num_tokens": sum(e["num_tokens"] for e in entries),
            "num_shards": len(entries),
        },
        "shards": entries,
    }
    ts.write_manifest(directory, manifest)
    return ts.TokenStore(directory)


def mapped_rss_kib(array: np.ndarray) -> int:
    """Resident KiB of the memory map holding ``array``'s first byte, from ``/proc/self/smaps``
    (Linux): pages of a mapped file this process touched and still has mapped."""
    address, inside = array.ctypes.data, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds address {address:#x}")
