r"""Training throughput of ``aligner-train`` (steps/s, tokens/s) on whatever JAX runs on.

Runs the real trainer binary for ``--steps`` steps on batches saved from a run's seqio task, so
the accelerator host needs neither seqio nor TensorFlow, and every device sees the same batches:

  # 1. on a host with the full install: materialise the run's first batches (BM25 negatives...)
  .venv/bin/python benchmarks/train_throughput.py save-batches \
      --gin_file=runs/scifact_minilm.gin --num_batches=120 --out=outputs/batches/scifact_bs16.npz
  # 2. anywhere: train on them and summarise the trainer's own rate windows
  .venv/bin/python benchmarks/train_throughput.py run --gin_file=runs/scifact_minilm.gin \
      --batches=outputs/batches/scifact_bs16.npz --steps=100 --label=cpu_bs16_f32

``run`` reads the trainer's ``train_log.jsonl``: every ``--summary_period`` steps it records the
steps/s and real (non-padding) tokens/s of the window just ended. The first window starts after
the first (compiling) step, so it is one step shorter, and is reported apart; the figures are medians over the other windows. Each run
writes ``OUTPUT_DIR/<label>.json``; ``OUTPUT_DIR/train_throughput.md`` is regenerated from all
of them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from aligner_jax.common import cli  # noqa: E402

DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "train_throughput"


def save_batches(args) -> None:
    from aligner_jax.training import input_pipeline  # noqa: PLC0415

    bindings = ["MODEL_DIR = 'unused'", "TRAIN_STEPS = 1", *args.gin_bindings]
    cli.parse_gin(args.gin_file, bindings)
    config = input_pipeline.DataConfig()
    start = time.perf_counter()
    path = input_pipeline.save_batches(config, args.num_batches, args.out)
    print(
        f"saved {args.num_batches} batches of {config.batch_size} from {config.task!r} to {path} "
        f"({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s)"
    )


def _device_info() -> dict:
    """Asked of a separate process, so this one never holds the accelerator."""
    probe = (
        "import json, jax; d = jax.devices(); "
        "print(json.dumps({'backend': jax.default_backend(), 'device_kind': d[0].device_kind, "
        "'device_count': len(d), 'jax': jax.__version__}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise_log(log_path: Path) -> dict:
    """Rates from the trainer's windows: the first (with compilation) apart, medians of the rest."""
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    windows = [r for r in records if "steps_per_sec" in r]
    if len(windows) < 2:
        raise SystemExit(
            f"{log_path}: {len(windows)} rate window(s); run more steps than 2 x --summary_period"
        )
    timed = windows[1:]
    return {
        "steps": records[-1]["step"],
        "first_window": {k: windows[0][k] for k in ("steps_per_sec", "tokens_per_sec")},
        "steps_per_sec": statistics.median(w["steps_per_sec"] for w in timed),
        "tokens_per_sec": statistics.median(w["tokens_per_sec"] for w in timed),
        "steps_per_sec_range": [
            min(w["steps_per_sec"] for w in timed),
            max(w["steps_per_sec"] for w in timed),
        ],
        "timed_windows": len(timed),
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
    }


def run(args) -> None:
    batches = Path(args.batches).resolve()
    if not batches.is_file():
        raise SystemExit(f"--batches={args.batches}: no such file (make it with save-batches)")
    device = _device_info()
    with tempfile.TemporaryDirectory(prefix="train_throughput_") as tmp:
        model_dir = Path(tmp) / "model"
        bindings = [
            f"MODEL_DIR = {str(model_dir)!r}",
            f"TRAIN_STEPS = {args.steps}",
            f"DataConfig.cached_batches = {str(batches)!r}",
            f"train.summary_period = {args.summary_period}",
            f"CheckpointConfig.period = {args.steps}",  # one save, after the last timed step
            *args.gin_bindings,
        ]
        cmd = [sys.executable, "-m", "aligner_jax.train"]
        cmd += [f"--gin_file={g}" for g in args.gin_file]
        cmd += [f"--gin_bindings={b}" for b in bindings]
        print(f"[{args.label}] {device['device_kind']} x{device['device_count']}: training ...")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        log_path = model_dir / "train_log.jsonl"
        if proc.returncode or not log_path.is_file():
            raise SystemExit(f"[{args.label}] aligner-train failed:\n{proc.stderr[-4000:]}")
        summary = summarise_log(log_path)
        operative = (model_dir / "config.gin").read_text()
    dtype = next(
        (
            ln.split("=", 1)[1].strip().strip("'")
            for ln in operative.splitlines()
            if ln.startswith("AlignerConfig.dtype")
        ),
        "float32",
    )

    with np.load(batches) as f:
        identity = json.loads(str(f["identity"]))
        padded = int(f["query_tokens"][0].size + f["doc_tokens"][0].size)
    result = {
        "label": args.label,
        "device": device,
        "gin_files": args.gin_file,
        "gin_bindings": args.gin_bindings,
        "dtype": dtype,
        "batch_size": identity["batch_size"],
        "padded_tokens_per_step": padded,
        "pipeline": identity,
        "wall_s": wall,
        **summary,
    }
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_table(out_dir)
    print(
        f"[{args.label}] {summary['steps_per_sec']:.2f} steps/s, "
        f"{summary['tokens_per_sec']:,.0f} tokens/s (median of {summary['timed_windows']} "
        f"windows; first window {summary['first_window']['steps_per_sec']:.2f} steps/s), "
        f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, {wall:.0f} s wall"
    )


def write_table(out_dir: Path) -> Path:
    rows = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]
    lines = [
        "# Training throughput (`benchmarks/train_throughput.py`)",
        "",
        "Real (non-padding) tokens per second over query + positive + negative documents; medians "
        "of the trainer's rate windows after the first (which includes compilation).",
        "",
        "| label | device | dtype | batch | padded tokens/step | steps/s | tokens/s | "
        "first window steps/s | steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['device']['device_kind']} ×{r['device']['device_count']} | "
            f"{r['dtype']} | {r['batch_size']} | {r['padded_tokens_per_step']:,} | "
            f"{r['steps_per_sec']:.2f} | {r['tokens_per_sec']:,.0f} | "
            f"{r['first_window']['steps_per_sec']:.2f} | {r['steps']} |"
        )
    path = out_dir / "train_throughput.md"
    path.write_text("\n".join(lines) + "\n")
    return path


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (absl flags), defined only when this file runs as a script (tests import
    it for ``summarise_log``)."""
    cli.define_gin_flags()  # --gin_file / --gin_bindings of the run (both commands)
    flags.DEFINE_integer("num_batches", None, "save-batches: how many batches to save.")
    flags.DEFINE_string("out", None, "save-batches: the .npz file to write.")
    flags.DEFINE_string("batches", None, "run: a file written by save-batches.")
    flags.DEFINE_integer("steps", 100, "run: training steps.")
    flags.DEFINE_integer("summary_period", 10, "run: steps per rate window.")
    flags.DEFINE_string("label", None, "run: the result's name (OUTPUT_DIR/<label>.json).")
    flags.DEFINE_string("output_dir", str(DEFAULT_OUTPUT), "run: where results go.")


REQUIRED = {
    "save-batches": ("gin_file", "num_batches", "out"),
    "run": ("gin_file", "batches", "label"),
}


def main(argv) -> None:
    if len(argv) != 2 or argv[1] not in REQUIRED:
        raise app.UsageError(f"give one command, save-batches or run (got {argv[1:]})")
    missing = [f"--{name}" for name in REQUIRED[argv[1]] if not FLAGS[name].value]
    if missing:
        raise app.UsageError(f"{argv[1]} needs {', '.join(missing)}")
    os.chdir(REPO)
    (save_batches if argv[1] == "save-batches" else run)(FLAGS)


if __name__ == "__main__":
    define_flags()
    app.run(main)
