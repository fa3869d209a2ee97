"""Kills an index update at every durable step in turn (``fileio.fault_point``) and checks what
is left (used by ``tests/test_crash_consistency.py``; a script, run in its own process).

  python tests/crash_driver.py --op=add --index_dir=BASE --work=DIR --fault=kill

For N = 1, 2, ... it copies the pristine index ``BASE``, forks a child that runs the update with
``ALIGNER_JAX_FAULT=<fault>:N`` (SIGKILL, or a full disk, at its N-th step), then, in this
process: the index opens with its checksums verified, its answers to fixed queries equal either
the state before the update or the state after it (exhaustive answers of the committed store and
the fast search of its committed search index), and running the same update again reaches the
after-state. Stops when an update runs past its last step without a fault. Prints one JSON line.

The child initialises JAX itself: this process only imports modules (no backend, no threads),
so forking is safe. Documents are encoded by a deterministic NumPy encoder (no model to load).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aligner_jax.common import fileio  # noqa: E402
from aligner_jax.encoding.encoder import EncodedText  # noqa: E402
from aligner_jax.indexing import centroid_index as ci  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402
from aligner_jax.indexing import updates  # noqa: E402

DIM = 16
MODEL = {"name": "numpy-test", "fingerprint": "numpy-test", "dim": DIM, "salience": "lp"}


def doc_vectors(text: str) -> np.ndarray:
    """Deterministic unit token vectors of a text (one per word)."""
    words = text.split() or [""]
    seeds = [int(hashlib.sha256(w.encode()).hexdigest()[:8], 16) for w in words]
    v = np.stack([np.random.default_rng(s).normal(size=DIM) for s in seeds]).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


class NumpyEncoder:
    """The part of ``Encoder`` the indexing path uses, without a model."""

    dim = DIM

    @dataclasses.dataclass
    class _Bundle:
        def info(self) -> dict:
            return dict(MODEL)

    bundle = _Bundle()

    def tokenize(self, texts, kind):
        return [np.arange(len(t.split()) or 1, dtype=np.int32) for t in texts]

    def encode_token_ids(self, token_ids, kind, bar=None):
        for i, ids in enumerate(token_ids):
            v = doc_vectors(self._texts[i]) if hasattr(self, "_texts") else None
            yield i, EncodedText(ids, v, np.linspace(1.0, 0.5, len(ids)).astype(np.float32))

    def count_truncated(self, texts, token_ids, kind):
        return 0

    def maxlen(self, kind):
        return 512


class TextEncoder(NumpyEncoder):
    def tokenize(self, texts, kind):
        self._texts = list(texts)
        return super().tokenize(texts, kind)


WORDS = [f"w{i}" for i in range(60)]


def corpus(n: int, seed: int, prefix: str) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "_id": f"{prefix}{i}",
            "title": "",
            "text": " ".join(rng.choice(WORDS, rng.integers(4, 12))),
        }
        for i in range(n)
    ]


def make_base(directory: Path) -> None:
    """A small index: 40 documents in shards of 8, its search index built and committed."""
    docs = corpus(40, 0, "d")
    with ts.TokenStoreWriter(directory, MODEL, shard_size=8) as writer:
        for d in docs:
            v = doc_vectors(d["text"])
            writer.add(d["_id"], v, np.linspace(1.0, 0.5, len(v)), np.arange(len(v)))
    fileio.atomic_write_json(directory / "encoder.json", {"model": "numpy-test"})
    ci.CentroidIndex.build(writer.store, ci.CentroidIndexConfig(num_centroids=8, seed=0))


QUERIES = [doc_vectors(" ".join(WORDS[i : i + 3])) for i in range(0, 30, 6)]


def answers(directory: Path) -> dict:
    """What the committed index answers: exhaustive top-5 over live documents (store) and the
    fast search's top-5 (search index). Opening verifies every checksum."""
    from aligner_jax.retrieval import centroid_search as cs

    store = ts.TokenStore(directory, verify_checksums=True)
    index = ci.CentroidIndex.load(store, verify_checksums=True)
    searcher = cs.CentroidSearcher(store, index)
    out = {
        "generation": store.manifest["search_index"]["generation"],  # compact changes only this
        "docs": store.num_docs,
        "deleted": int(store.deleted.sum()),
        "fast": [],
        "exact": [],
    }
    for q in QUERIES:
        (ranking,), _ = searcher.search(q, np.ones(len(q)), np.arange(len(q)), 5)
        out["fast"].append([store.doc_ids[int(d)] for d in ranking[0]])
        scores = []
        for i in range(store.num_docs):
            v = np.asarray(store.document(i)[0], np.float32)
            scores.append(-np.inf if store.deleted[i] else float((q @ v.T).max(1).mean()))
        top = np.argsort(-np.asarray(scores), kind="stable")[:5]
        out["exact"].append([store.doc_ids[int(d)] for d in top])
    return out


def classify(state: dict, before: dict, after: dict) -> str:
    """``before`` or ``after`` (the same answers, at the update's generation or a later one: a
    compaction run again after it was committed compacts again), else ``neither``."""
    answers = {k: v for k, v in state.items() if k != "generation"}
    if state == before:
        return "before"
    if answers == {k: v for k, v in after.items() if k != "generation"}:
        if state["generation"] >= after["generation"]:
            return "after"
    return "neither"


def run_op(op: str, directory: Path, corpus_file: Path) -> None:
    if op == "add":
        updates.update_index(str(directory), add=str(corpus_file))
    elif op == "delete":
        updates.update_index(str(directory), delete="d3,d17,d30")
    elif op == "compact":
        updates.update_index(str(directory), force_compact=True)
    elif op == "rebuild":
        updates.update_index(str(directory), search_index=True)
    elif op == "vacuum":
        updates.update_index(str(directory), vacuum_store=True)
    else:
        raise ValueError(op)


def child(op: str, directory: Path, corpus_file: Path, fault: str | None) -> int:
    """Runs the update in a forked child; returns its exit code (-9: killed)."""
    return run_in_child(lambda: run_op(op, directory, corpus_file), fault)


STEPS = [0]  # durable steps the last child took (all of them unless it was killed)


def run_in_child(job, fault: str | None = None) -> int:
    """``job()`` in a forked child (which initialises JAX itself); its exit code. The number
    of durable steps it took comes back through a pipe (none when it was killed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            fileio._steps[0] = 0  # count this update's steps only
            if fault:
                os.environ[fileio.FAULT_ENV] = fault
            job()
        except BaseException as e:  # noqa: BLE001 (reported to the parent by the exit code)
            sys.stderr.write(f"child: {type(e).__name__}: {e}\n")
            code = 3
        os.write(write, str(fileio._steps[0]).encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        taken = pipe.read()
    _, status = os.waitpid(pid, 0)
    STEPS[0] = int(taken) if taken else -1
    return os.waitstatus_to_exitcode(status)


def exact_answers(store: ts.TokenStore) -> list[list[str]]:
    """Exhaustive top-5 of every fixed query over the live documents of ``store``."""
    out = []
    vectors = [np.asarray(store.document(i)[0], np.float32) for i in range(store.num_docs)]
    for q in QUERIES:
        scores = np.array(
            [
                -np.inf if store.deleted[i] else float((q @ v.T).max(1).mean())
                for i, v in enumerate(vectors)
            ]
        )
        out.append([store.doc_ids[int(d)] for d in np.argsort(-scores, kind="stable")[:5]])
    return out


def writer(directory: Path, work: Path, n: int, out: Path) -> None:
    """``n`` transactions (add, delete, compact in turn); after each commit, the committed
    generation's exhaustive answers (what any reader may see)."""
    updates.loading.encoder_from_spec = lambda spec, *a, **k: None
    updates.Encoder = lambda bundle, config: TextEncoder()
    seen = [exact_answers(ts.TokenStore(directory))]
    for t in range(n):
        if t % 3 == 0:
            more = work / f"add{t}.jsonl"
            more.write_text("".join(json.dumps(d) + "\n" for d in corpus(4, 100 + t, f"t{t}-")))
            updates.update_index(str(directory), add=str(more))
        elif t % 3 == 1:
            live = ts.TokenStore(directory).live_positions()
            victim = sorted(live)[t % len(live)]
            updates.update_index(str(directory), delete=victim)
        else:
            updates.update_index(str(directory), force_compact=True)
        seen.append(exact_answers(ts.TokenStore(directory)))
    fileio.atomic_write_json(out, seen)


def reader(directory: Path, n: int, out: Path, writer_done: Path) -> None:
    """At least ``n`` searches, and more until the writer is done: each on the generation
    opened last (re-opened every 5 searches), with the fast search's index loaded too (its files
    may be removed by a commit meanwhile)."""
    import time

    from aligner_jax.retrieval import centroid_search as cs

    answers_seen, errors_seen = [], []
    store, i, deadline = None, 0, time.monotonic() + 600
    while i < n or (not writer_done.exists() and time.monotonic() < deadline):
        try:
            if i % 5 == 0:
                store, index = ci.CentroidIndex.open_snapshot(directory)
                searcher = cs.CentroidSearcher(store, index)
            q = QUERIES[i % len(QUERIES)]
            searcher.search(q, np.ones(len(q)), np.arange(len(q)), 5)
            answers_seen.append(exact_answers(store))
        except Exception as e:  # noqa: BLE001 (counted: the test expects none)
            errors_seen.append(f"{type(e).__name__}: {e}")
        i += 1
    fileio.atomic_write_json(out, {"answers": answers_seen, "errors": errors_seen})


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--op", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--fault", default="kill")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.op == "make_base":
        return make_base(Path(args.work) / "base")
    if args.op == "writer":
        return writer(Path(args.work) / "base", Path(args.work), args.n, Path(args.out))
    if args.op == "reader":
        done = Path(args.work) / "writer.json"
        return reader(Path(args.work) / "base", args.n, Path(args.out), done)
    work = Path(args.work)
    base, corpus_file = work / "base", work / "more.jsonl"
    if not base.exists():
        assert run_in_child(lambda: make_base(base)) == 0
    corpus_file.write_text(
        "".join(
            json.dumps(d) + "\n"
            for d in corpus(12, 1, "n")
            + [{"_id": "d3", "title": "", "text": "w1 w2 w3 back again"}]
        )
    )
    updates.loading.encoder_from_spec = lambda spec, *a, **k: None  # never load a model
    updates.Encoder = lambda bundle, config: TextEncoder()
    before = answers(base)
    after_dir = work / "after"
    shutil.rmtree(after_dir, ignore_errors=True)
    shutil.copytree(base, after_dir)
    if args.op in ("add", "vacuum"):  # so that d3 can come back, or there is one to reclaim
        assert run_in_child(lambda: updates.update_index(str(after_dir), delete="d3")) == 0
        shutil.rmtree(base)
        shutil.copytree(after_dir, base)
        before = answers(base)
    assert child(args.op, after_dir, corpus_file, None) == 0
    after = answers(after_dir)
    assert after != before, "the update changed nothing"
    results = []
    for n in range(1, args.max_steps + 1):
        trial = work / "trial"
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(base, trial)
        code = child(args.op, trial, corpus_file, f"{args.fault}:{n}")
        taken = STEPS[0]  # -1: killed at step n
        state = answers(trial)
        seen = classify(state, before, after)
        leftovers = [p.name for p in trial.rglob("*.tmp")]
        rerun = child(args.op, trial, corpus_file, None) if seen == "before" or code != 0 else 0
        final = answers(trial)
        results.append(
            {
                "step": n,
                "exit": code,
                "steps": taken,
                "state": seen,
                "rerun_exit": rerun,
                "rerun_state": "after" if classify(final, before, after) == "after" else "other",
                "tmp_left": len(leftovers),
                "tmp_after_rerun": len([p for p in trial.rglob("*.tmp")]),
            }  # fmt: skip
        )
        if 0 <= taken < n:
            break  # the update ran past its last step: no fault at step n
    print(json.dumps({"op": args.op, "fault": args.fault, "results": results}))


if __name__ == "__main__":
    main()
