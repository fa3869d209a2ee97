#!/usr/bin/env python
"""Does PyLate load an ``aligner-export`` folder as it is and encode our token vectors?

Run with the peer venv's python (PyLate needs torch; aligner_jax is never imported):

    /work/peer-venv/bin/python benchmarks/peers/pylate_check.py --cases_dir DIR \
        [--output benchmarks/results/pylate_export.json] [--tolerance 1e-5]

``DIR`` holds one folder per case, written by ``benchmarks/pylate_export.py`` (main venv):
``CASE/export/`` (the ``aligner-export --format=pylate`` folder, untouched) and
``CASE/vectors.npz`` (what ``aligner_jax.encoding.encoder.Encoder`` gave for the same texts:
``texts``, and per side ``{query,doc}_{token_ids,vectors,offsets}``, texts concatenated).

For each case: ``pylate.models.ColBERT(CASE/export)`` (no argument but the folder), then
``encode(texts, is_query=True/False)``; per side, the token ids PyLate fed its model must equal
ours text by text and the largest absolute difference of the token vectors must be at most the
tolerance. Prints one line per case and side, writes a JSON (and a Markdown table beside it) and
exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

SIDES = (("query", True), ("doc", False))


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def check_case(case_dir: pathlib.Path, tolerance: float) -> dict:
    """Loads the export with PyLate, encodes the case's texts and compares with ours."""
    import torch
    from pylate import models

    ours = np.load(case_dir / "vectors.npz", allow_pickle=False)
    texts = [str(t) for t in ours["texts"]]
    start = time.perf_counter()
    model = models.ColBERT(str(case_dir / "export"), device="cpu")
    load_s = time.perf_counter() - start
    row = {
        "case": case_dir.name,
        "texts": len(texts),
        "load_s": round(load_s, 3),
        "modules": [type(m).__name__ for m in model],
        "settings": {
            "query_prefix": model.query_prefix,
            "document_prefix": model.document_prefix,
            "query_length": model.query_length,
            "document_length": model.document_length,
            "do_query_expansion": model.do_query_expansion,
            "skiplist_words": model.skiplist_words,
        },
    }
    passed = True
    for side, is_query in SIDES:
        want_ids = _split(ours[f"{side}_token_ids"], ours[f"{side}_offsets"])
        want = _split(ours[f"{side}_vectors"], ours[f"{side}_offsets"])
        with torch.no_grad():
            got = model.encode(texts, is_query=is_query, batch_size=8, convert_to_numpy=True)
        got_ids = [model.tokenize([t], is_query=is_query)["input_ids"][0].numpy() for t in texts]
        ids_equal = all(
            len(a) == len(b) and np.array_equal(a, b)
            for a, b in zip(got_ids, want_ids, strict=True)
        )
        shapes_equal = all(np.shape(g) == w.shape for g, w in zip(got, want, strict=True))
        diff = (
            max(
                float(np.abs(np.asarray(g, np.float32) - w).max())
                for g, w in zip(got, want, strict=True)
            )
            if shapes_equal
            else float("inf")
        )
        ok = bool(ids_equal and shapes_equal and diff <= tolerance)
        passed &= ok
        row[side] = {
            "tokens": int(sum(len(w) for w in want)),
            "dim": int(want[0].shape[1]),
            "token_ids_equal": ids_equal,
            "shapes_equal": shapes_equal,
            "max_abs_diff": diff,
            "pass": ok,
        }
        print(
            f"{case_dir.name} {side}: {row[side]['tokens']} tokens x {row[side]['dim']}, "
            f"token ids equal: {ids_equal}, max |PyLate - ours| = {diff:.2e} "
            f"({'pass' if ok else 'FAIL'} at {tolerance:g})"
        )
    row["pass"] = passed
    return row


def markdown(report: dict) -> str:
    lines = [
        "# PyLate loads aligner-export folders as they are",
        "",
        f"`{report['command']}` — PyLate {report['versions']['pylate']}, torch "
        f"{report['versions']['torch']}, sentence-transformers "
        f"{report['versions']['sentence_transformers']}; tolerance {report['tolerance']:g}.",
        "",
        "| case | texts | query tokens | query max abs diff | doc tokens | doc max abs diff "
        "| token ids equal | pass |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["cases"]:
        q, d = r["query"], r["doc"]
        lines.append(
            f"| {r['case']} | {r['texts']} | {q['tokens']} | {q['max_abs_diff']:.2e} | "
            f"{d['tokens']} | {d['max_abs_diff']:.2e} | "
            f"{q['token_ids_equal'] and d['token_ids_equal']} | {r['pass']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases_dir", required=True, help="folder of CASE/{export,vectors.npz}")
    ap.add_argument("--output", default=None, help="JSON to write (and .md beside it)")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to download
    import pylate
    import sentence_transformers
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cases = sorted(p for p in pathlib.Path(args.cases_dir).iterdir() if p.is_dir())
    if not cases:
        print(f"pylate_check: {args.cases_dir} holds no case folder", file=sys.stderr)
        return 1
    report = {
        "command": " ".join(["pylate_check.py"] + (argv if argv is not None else sys.argv[1:])),
        "tolerance": args.tolerance,
        "versions": {
            "pylate": pylate.__version__,
            "torch": torch.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "python": platform.python_version(),
        },
        "cases": [check_case(c, args.tolerance) for c in cases],
    }
    report["pass"] = all(r["pass"] for r in report["cases"])
    if args.output:
        out = pathlib.Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
        print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
