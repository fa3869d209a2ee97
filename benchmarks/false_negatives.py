r"""What masking in-batch false negatives changes: two trained models, one with the mask
(``LossConfig.mask_false_negatives=True``) and one without (the default), compared query by
query on the evaluations ``aligner-eval`` wrote for each.

    .venv/bin/python benchmarks/false_negatives.py \
      --dataset_dirs=../shared/data/beir/scifact,../shared/data/beir/cisi \
      --baseline_evals=outputs/fn_off_scifact,outputs/fn_off_cisi \
      --treatment_evals=outputs/fn_on_scifact,outputs/fn_on_cisi

Each ``*_evals`` folder is an ``aligner-eval`` output (``results.json``, ``metrics.json``) of
the same dataset and split with the same search settings; only the model differs (settings the
index resolves from each model's store, the centroid count, may differ and are reported). The
models are read from ``metrics.json``'s ``config.model`` (``DIR@STEP``) and their
``train_log.jsonl`` summarised (loss, accuracy and the ``false_negatives`` metric: relevant
in-batch documents per row, counted with the mask on or off). Per query: nDCG@10, Recall@100
and MRR@10 recomputed with pytrec_eval from ``results.json`` (checked against
``metrics.json``); reported: each mean, the mean difference (treatment − baseline) with its
paired bootstrap 95 % interval (``metrics.paired_bootstrap``), and how many queries went up,
down or stayed.

``--control_log``: the ``train_log.jsonl`` of a rerun of the baseline's training with today's
code (for a baseline trained by an older version): its losses are compared step by step with
the baseline's own log; equal losses mean the baseline is today's ``mask_false_negatives=False``.
Writes ``<output>/<name>.{json,md,png}`` (``benchmarks/results``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import result_files  # noqa: E402

from aligner_jax.data import beir  # noqa: E402
from aligner_jax.evaluation import metrics  # noqa: E402

_DATASET_DIRS = flags.DEFINE_list("dataset_dirs", None, "BEIR folders, one per comparison.")
_BASELINE = flags.DEFINE_list("baseline_evals", None, "aligner-eval outputs of the baseline.")
_TREATMENT = flags.DEFINE_list("treatment_evals", None, "aligner-eval outputs of the treatment.")
_BASELINE_NAME = flags.DEFINE_string("baseline_name", "no mask", "Label of the baseline.")
_TREATMENT_NAME = flags.DEFINE_string("treatment_name", "mask", "Label of the treatment.")
_CONTROL_LOG = flags.DEFINE_string(
    "control_log", None, "train_log.jsonl of a rerun of the baseline's training (optional)."
)
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 2000, "Paired bootstrap resamples.")
_OUTPUT = flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Results folder.")
_NAME = flags.DEFINE_string("name", "false_negatives", "Result files <output>/<name>.*")

METRICS = ("ndcg@10", "recall@100", "mrr@10")
LAST_STEPS = 50  # the training summary's final window


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise app.UsageError(f"{path} does not exist: give aligner-eval output folders") from None


def train_log(model: str) -> list[dict]:
    """The model's ``train_log.jsonl`` rows (``model`` as ``metrics.json`` names it)."""
    path = Path(model.rsplit("@", 1)[0]) / "train_log.jsonl"
    if not path.exists():
        raise app.UsageError(f"{path} does not exist: the evaluated model has no training log")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_summary(rows: list[dict]) -> dict:
    last = [r for r in rows if r["step"] > rows[-1]["step"] - LAST_STEPS]

    def mean(rs, key):
        values = [r[key] for r in rs if key in r]
        return float(np.mean(values)) if values else None

    return {
        "steps": rows[-1]["step"],
        f"loss_last_{LAST_STEPS}": mean(last, "loss"),
        f"accuracy_last_{LAST_STEPS}": mean(last, "accuracy"),
        "false_negatives_per_row": mean(rows, "false_negatives"),
        "logged_rows": len(rows),
    }


def control_check(baseline_rows: list[dict], control_rows: list[dict]) -> dict:
    """Step-by-step loss of the baseline's log against a rerun's."""
    base = {r["step"]: r["loss"] for r in baseline_rows}
    pairs = [
        (r["step"], abs(base[r["step"]] - r["loss"])) for r in control_rows if r["step"] in base
    ]
    common = [step for step, _ in pairs]
    diffs = [diff for _, diff in pairs]
    return {
        "steps_compared": common,
        "max_abs_loss_difference": max(diffs) if diffs else None,
        "false_negatives_counted": sum(r.get("false_negatives", 0) > 0 for r in control_rows),
    }


# Settings resolved from the store each model wrote rather than chosen: the centroid count
# follows the number of tokens stored, which differs between two models (tokens of salience 0
# are left out). Reported per side, not required equal.
STORE_RESOLVED = {"centroid_stages": ("num_centroids",)}


def search_settings(config: dict) -> tuple[dict, dict]:
    """(the search settings that must match, the store-resolved ones) of an evaluation."""
    settings, resolved = {}, {}
    for key, value in config.items():
        if "model" in key:
            continue
        names = STORE_RESOLVED.get(key, ())
        if isinstance(value, dict) and names:
            resolved.update({n: value[n] for n in names if n in value})
            value = {k: v for k, v in value.items() if k not in names}
        settings[key] = value
    return settings, resolved


def compare(dataset_dir: str, baseline_dir: str, treatment_dir: str) -> dict:
    base_m = read_json(Path(baseline_dir) / "metrics.json")
    treat_m = read_json(Path(treatment_dir) / "metrics.json")
    for key in ("dataset", "split", "num_queries", "num_docs"):
        if base_m[key] != treat_m[key]:
            raise app.UsageError(
                f"{baseline_dir} and {treatment_dir} differ in {key}: "
                f"{base_m[key]!r} against {treat_m[key]!r}"
            )
    settings, base_store = search_settings(base_m["config"])
    other, treat_store = search_settings(treat_m["config"])
    if settings != other:
        changed = sorted(
            k for k in settings.keys() | other.keys() if settings.get(k) != other.get(k)
        )
        raise app.UsageError(f"{baseline_dir} and {treatment_dir} searched differently: {changed}")
    qrels = beir.load_beir(dataset_dir, base_m["split"]).qrels
    evaluations = {}
    for name, folder, m in (
        ("baseline", baseline_dir, base_m),
        ("treatment", treatment_dir, treat_m),
    ):
        ev = metrics.evaluate_run(qrels, read_json(Path(folder) / "results.json"), (10, 100))
        if not math.isclose(ev["ndcg@10"], m["metrics"]["ndcg@10"], abs_tol=1e-9):
            raise app.UsageError(
                f"{folder}: nDCG@10 from results.json {ev['ndcg@10']:.6f} is not metrics.json's "
                f"{m['metrics']['ndcg@10']:.6f}: the folder was not written by one evaluation"
            )
        evaluations[name] = ev
    queries = sorted(evaluations["baseline"].per_query)
    row = {
        "dataset": base_m["dataset"],
        "split": base_m["split"],
        "queries": len(queries),
        "search": settings,
        "baseline_eval": str(baseline_dir),
        "treatment_eval": str(treatment_dir),
        "baseline_model": base_m["config"]["model"],
        "treatment_model": treat_m["config"]["model"],
        "baseline_store": base_store,
        "treatment_store": treat_store,
    }
    for metric in METRICS:
        x = [evaluations["treatment"].per_query[q][metric] for q in queries]
        y = [evaluations["baseline"].per_query[q][metric] for q in queries]
        d = np.subtract(x, y)
        row[metric] = {
            "baseline": float(np.mean(y)),
            "treatment": float(np.mean(x)),
            "difference": float(np.mean(d)),
            "ci95": metrics.paired_bootstrap(x, y, _BOOTSTRAP.value, seed=0),
            "queries_up": int(np.sum(d > 1e-12)),
            "queries_down": int(np.sum(d < -1e-12)),
        }
    return row


def markdown(results: dict) -> str:
    b, t = results["baseline_name"], results["treatment_name"]
    lines = [
        "# In-batch false negatives masked or not (`benchmarks/false_negatives.py`)",
        "",
        f"{results['machine']}. Treatment − baseline ({t} − {b}), ×100, with the paired "
        f"bootstrap 95 % interval ({results['bootstrap']} resamples of the queries); up / down: "
        "queries whose metric rose / fell.",
        "",
        "| dataset | queries | metric | " + f"{b} | {t} | difference [95 % CI] | up / down |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        for metric in METRICS:
            m = row[metric]
            lo, hi = m["ci95"]
            lines.append(
                f"| {row['dataset']} ({row['split']}) | {row['queries']} | {metric} | "
                f"{100 * m['baseline']:.2f} | {100 * m['treatment']:.2f} | "
                f"{100 * m['difference']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] | "
                f"{m['queries_up']} / {m['queries_down']} |"
            )
    lines += ["", "Training (each model's `train_log.jsonl`):", ""]
    lines += [
        f"| model | steps | loss, last {LAST_STEPS} | accuracy, last {LAST_STEPS} | "
        "false negatives per row (mean of the logged values) |",
        "|---|---|---|---|---|",
    ]
    for name, summary in results["training"].items():
        fn = summary["false_negatives_per_row"]
        lines.append(
            f"| {name} | {summary['steps']} | {summary[f'loss_last_{LAST_STEPS}']:.3f} | "
            f"{summary[f'accuracy_last_{LAST_STEPS}']:.3f} | "
            f"{'not logged' if fn is None else f'{fn:.4f}'} |"
        )
    if results.get("control"):
        c = results["control"]
        lines += [
            "",
            f"Control: a rerun of the baseline's training with today's code and "
            f"`mask_false_negatives=False`, steps {c['steps_compared'][0]}–"
            f"{c['steps_compared'][-1]}: largest loss difference from the baseline's log "
            f"{c['max_abs_loss_difference']:.3g}; it counted false negatives at "
            f"{c['false_negatives_counted']} of its logged steps.",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, centres, errors = [], [], []
    for row in results["rows"]:
        for metric in METRICS:
            m = row[metric]
            labels.append(f"{row['dataset']}\n{metric}")
            centres.append(100 * m["difference"])
            errors.append(
                [100 * (m["difference"] - m["ci95"][0]), 100 * (m["ci95"][1] - m["difference"])]
            )
    x = np.arange(len(labels))
    ax.errorbar(x, centres, yerr=np.asarray(errors).T, fmt="o", capsize=4)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel(f"{results['treatment_name']} − {results['baseline_name']} (points)")
    ax.set_title("Masking in-batch false negatives: difference with 95 % interval", fontsize=10)
    plotting.save(fig, path)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    lists = (_DATASET_DIRS.value, _BASELINE.value, _TREATMENT.value)
    if not all(lists) or len({len(v) for v in lists}) != 1:
        raise app.UsageError(
            "--dataset_dirs, --baseline_evals and --treatment_evals: give as many of each"
        )
    rows = [compare(*triple) for triple in zip(*lists, strict=True)]
    training = {}
    for name, key in (
        (_BASELINE_NAME.value, "baseline_model"),
        (_TREATMENT_NAME.value, "treatment_model"),
    ):
        models = {row[key] for row in rows}
        if len(models) != 1:
            raise app.UsageError(f"the {name} evaluations are of several models: {sorted(models)}")
        training[name] = training_summary(train_log(models.pop()))
    control = None
    if _CONTROL_LOG.value:
        control_rows = [
            json.loads(line)
            for line in Path(_CONTROL_LOG.value).read_text().splitlines()
            if line.strip()
        ]
        control = control_check(train_log(rows[0]["baseline_model"]), control_rows)
    results = {
        "machine": result_files.machine(),
        "baseline_name": _BASELINE_NAME.value,
        "treatment_name": _TREATMENT_NAME.value,
        "bootstrap": _BOOTSTRAP.value,
        "rows": rows,
        "training": training,
        "control": control,
        "command": " ".join(sys.argv),
    }
    path = result_files.save(results, _NAME.value, markdown, plot, _OUTPUT.value)
    print(f"wrote {path}, .md, .png")


if __name__ == "__main__":
    app.run(main)
