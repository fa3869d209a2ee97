r"""PyLate loads ``aligner-export`` folders as they are (issue 25 item 6): the driver.

For each model (the bundled zero-shot MiniLM, ``models/minilm_identity.gin``: identity
projection; a randomly initialised ``models/bert_tiny.gin``: a 16-d dense projection and LP
saliences, standing in for a trained model; with ``--checkpoint``, an ``aligner-train``
MODEL_DIR too) this script, in the main venv,

  1. writes the export folder with ``hf_export.export_model(..., layout='pylate')`` (what
     ``aligner-export --format=pylate`` writes), untouched afterwards;
  2. encodes the same texts as queries and as documents with our
     ``aligner_jax.encoding.encoder.Encoder`` and saves token ids and vectors to ``vectors.npz``;

then runs ``benchmarks/peers/pylate_check.py`` with the peer venv's python (PyLate needs torch),
which loads each folder with ``pylate.models.ColBERT(FOLDER)`` alone, encodes the texts and
compares (token ids equal, max abs difference ≤ 1e-5), writing
``benchmarks/results/pylate_export.{json,md}``.

  .venv/bin/python benchmarks/pylate_export.py [--peer_python=/work/peer-venv/bin/python] \
      [--checkpoint=outputs/scifact_minilm] [--work_dir=outputs/pylate_export]

The texts: a few written to exercise the tokenizer (accents, punctuation, digits, a query longer
than the query budget, a document longer than the document budget) and, when
``--dataset_dir`` exists, the first queries and documents of SciFact.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Sequence

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import gin  # noqa: E402
import numpy as np  # noqa: E402

from aligner_jax.common import cli  # noqa: E402
from aligner_jax.encoding import loading  # noqa: E402
from aligner_jax.encoding.encoder import Encoder  # noqa: E402
from aligner_jax.weights import hf_export  # noqa: E402

CHECK = REPO / "benchmarks" / "peers" / "pylate_check.py"
# (case name, gin files, gin bindings)
MODELS = (
    ("minilm_zero_shot", ("models/minilm_identity.gin",), ()),
    ("bert_tiny_projection", ("models/bert_tiny.gin",), ("load_encoder.seed = 4",)),
)
TEXTS = (
    "statins reduce cardiovascular risk",
    "Does ß-carotene (vitamin A) lower the risk of lung cancer in smokers? Yes/no: 42%!",
    "Crème brûlée, naïve café résumé — Ångström & Œuvre; co-operation vs. coöperation.",
    "a b c",
    "What happens to the blood pressure of patients who take ACE inhibitors and diuretics "
    "together for more than five years, compared with patients who take either drug alone, "
    "and does the answer depend on their age, their kidney function, their diet or on how "
    "much salt they eat every day, as several large randomised trials have asked?",
    " ".join(["The long document repeats this sentence about microglia and neurons."] * 40),
)

_WORK_DIR = flags.DEFINE_string(
    "work_dir", str(REPO / "outputs" / "pylate_export"), "Exports and vectors go here."
)
_PEER_PYTHON = flags.DEFINE_string(
    "peer_python", "/work/peer-venv/bin/python", "Python of the venv with PyLate."
)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "Also an aligner-train MODEL_DIR (its config.gin gives the model)."
)
_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir",
    str(REPO.parent / "shared" / "data" / "beir" / "scifact"),
    "BEIR folder whose first queries and documents are added to the texts (if it exists).",
)
_SAMPLE = flags.DEFINE_integer("sample", 20, "Queries and documents taken from --dataset_dir.")
_OUTPUT = flags.DEFINE_string(
    "output", str(REPO / "benchmarks" / "results" / "pylate_export.json"), "Report JSON."
)


def dataset_texts(dataset_dir: str | pathlib.Path, sample: int) -> list[str]:
    """The first ``sample`` queries and documents (``title text``) of a BEIR folder, or none."""
    folder = pathlib.Path(dataset_dir)
    texts: list[str] = []
    for name, field in (("queries.jsonl", None), ("corpus.jsonl", "title")):
        path = folder / name
        if not path.is_file():
            return []
        with open(path, encoding="utf-8") as f:
            for line, _ in zip(f, range(sample), strict=False):
                row = json.loads(line)
                title = row.get(field, "") if field else ""
                texts.append(f"{title} {row['text']}".strip())
    return texts


def write_case(case_dir: pathlib.Path, bundle, texts: Sequence[str]) -> dict:
    """Writes ``case_dir/export`` (the pylate layout) and ``case_dir/vectors.npz`` (our
    ``Encoder``'s token ids and vectors for ``texts`` as queries and documents)."""
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    files = hf_export.export_model(
        bundle.config, bundle.params, bundle.source["tokenizer"], case_dir / "export", "pylate"
    )
    encoder = Encoder(bundle)
    arrays: dict[str, np.ndarray] = {"texts": np.asarray(list(texts))}
    for side in ("query", "doc"):
        encoded = encoder.encode(list(texts), side)
        lengths = [len(e.token_ids) for e in encoded]
        arrays[f"{side}_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays[f"{side}_token_ids"] = np.concatenate([e.token_ids for e in encoded])
        arrays[f"{side}_vectors"] = np.concatenate([e.vectors for e in encoded]).astype(np.float32)
    np.savez(case_dir / "vectors.npz", **arrays)
    return {"case": case_dir.name, "model": bundle.name, "files": files, **bundle.info()}


def load_model(gin_files: Sequence[str], bindings: Sequence[str], checkpoint: str | None = None):
    """``load_encoder`` under a fresh gin config (as ``aligner-export`` resolves it)."""
    gin.clear_config()
    cli.parse_gin(gin_files, bindings)
    if checkpoint:
        loading.bind_encoder_as_trained()
        return loading.load_encoder(checkpoint=checkpoint)
    return loading.load_encoder()


def run_check(peer_python: str, cases_dir: pathlib.Path, output: str | None) -> int:
    command = [peer_python, str(CHECK), f"--cases_dir={cases_dir}"]
    if output:
        command.append(f"--output={output}")
    return subprocess.run(command, check=False).returncode


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet_logs()
    cases_dir = pathlib.Path(_WORK_DIR.value)
    texts = list(TEXTS) + dataset_texts(_DATASET_DIR.value, _SAMPLE.value)
    models = list(MODELS)
    if _CHECKPOINT.value:
        trained = loading.trained_config(_CHECKPOINT.value)
        if not trained:
            raise app.UsageError(f"--checkpoint={_CHECKPOINT.value}: no config.gin in it")
        models.append(("trained_checkpoint", (str(trained),), ()))
    written = []
    for name, gin_files, bindings in models:
        checkpoint = _CHECKPOINT.value if name == "trained_checkpoint" else None
        bundle = load_model(gin_files, bindings, checkpoint)
        written.append(write_case(cases_dir / name, bundle, texts))
        print(f"{name}: {bundle.name}, dim {bundle.config.output_dim}, {len(texts)} texts")
    (cases_dir / "cases.json").write_text(json.dumps(written, indent=1) + "\n")
    rc = run_check(_PEER_PYTHON.value, cases_dir, _OUTPUT.value)
    if _OUTPUT.value and pathlib.Path(_OUTPUT.value).is_file():  # what made it, and the models
        report = json.loads(pathlib.Path(_OUTPUT.value).read_text())
        command = " ".join(["benchmarks/pylate_export.py", *sys.argv[1:]])
        report = {"driver_command": command, **report, "models": written}
        pathlib.Path(_OUTPUT.value).write_text(json.dumps(report, indent=1) + "\n")
        md = pathlib.Path(_OUTPUT.value).with_suffix(".md")
        models = ", ".join(f"{m['case']} = {m['name']} ({m['dim']}-d)" for m in written)
        md.write_text(
            md.read_text() + f"\nMade by `{command}` (main venv): {models}; {len(texts)} texts "
            "(benchmarks/pylate_export.py's own and the first SciFact queries and documents), "
            "each encoded as a query and as a document.\n"
        )
    sys.exit(rc)


if __name__ == "__main__":
    app.run(main)
