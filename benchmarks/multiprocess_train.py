r"""Training as 2 processes x 1 device (``launch/local_processes.sh 2 train``) against 1 process
x 2 devices (``--xla_force_host_platform_device_count=2``): the same run, the same global batches.

Runs the two one after the other (never together, so neither slows the other), then compares
the per-step losses of their ``train_log.jsonl`` (max relative difference), the wall time of the
whole command (start-up, compiling, steps, checkpoints), the steps/s after compiling (median of
the trainer's timed windows) and the peak resident memory of the largest process.

  .venv/bin/python benchmarks/multiprocess_train.py \
    --dataset_dir=../shared/data/beir/scifact --steps=20

Writes benchmarks/results/multiprocess_train.{json,md,png}.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
flags.DEFINE_string("dataset_dir", "../shared/data/beir/scifact", "BEIR folder with train qrels.")
flags.DEFINE_multi_string("gin_file", ["runs/scifact_minilm.gin"], "The run's gin files.")
flags.DEFINE_multi_string(
    "gin_bindings",
    ["BATCH_SIZE = 8", "QUERY_LENGTH = 32", "DOC_LENGTH = 128", "WARMUP_STEPS = 5"],
    "Extra bindings (both runs).",
)
flags.DEFINE_integer("steps", 20, "Training steps of each run.")
flags.DEFINE_string("workdir", "/tmp/aligner_multiprocess_train", "Scratch folder (emptied).")
flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Results folder.")
flags.DEFINE_string("name", "multiprocess_train", "Base name of the result files.")


def train_flags(model_dir: Path) -> list[str]:
    args = [f"--gin_file={g}" for g in FLAGS.gin_file]
    bindings = [
        f"MODEL_DIR = {str(model_dir)!r}",
        f"TRAIN_STEPS = {FLAGS.steps}",
        f"beir_train_source.dataset_dir = {str(Path(FLAGS.dataset_dir).resolve())!r}",
        "CheckpointConfig.period = 10",
        "train.summary_period = 5",
        *FLAGS.gin_bindings,
    ]
    return args + [f"--gin_bindings={b}" for b in bindings]


def run(cmd: list[str], devices: int) -> dict:
    """Runs ``cmd`` to completion; wall time and the peak RSS of its largest process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss: the largest waited-for process
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            log.seek(0)
            sys.exit(f"{' '.join(cmd[:4])} failed:\n{log.read()[-3000:]}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024}


def read_log(model_dir: Path) -> dict:
    records = [json.loads(x) for x in (model_dir / "train_log.jsonl").read_text().splitlines()]
    rates = [r["steps_per_sec"] for r in records if "steps_per_sec" in r][1:]  # after compiling
    return {
        "losses": [r["loss"] for r in records],
        "steps_per_sec": statistics.median(rates) if rates else None,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, style in (("1 process x 2 devices", "-o"), ("2 processes x 1 device", "--x")):
        losses = report["runs"][name]["losses"]
        ax.plot(range(1, len(losses) + 1), losses, style, label=name, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"same losses (max rel. diff {report['max_rel_loss_diff']:.1e})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    work = Path(FLAGS.workdir)
    shutil.rmtree(work, ignore_errors=True)
    one, two = work / "one_process", work / "two_processes"
    runs = {
        "1 process x 2 devices": run(
            [sys.executable, "-m", "aligner_jax.train", *train_flags(one)], devices=2
        ),
    }
    runs["2 processes x 1 device"] = run(
        ["bash", str(REPO / "launch" / "local_processes.sh"), "2", "train", *train_flags(two)],
        devices=1,
    )
    for name, model_dir in (("1 process x 2 devices", one), ("2 processes x 1 device", two)):
        runs[name].update(read_log(model_dir))
    a, b = (runs[n]["losses"] for n in runs)
    if len(a) != len(b):
        sys.exit(f"the runs logged {len(a)} and {len(b)} steps")
    diff = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))
    report = {
        "gin_files": FLAGS.gin_file,
        "bindings": FLAGS.gin_bindings,
        "steps": FLAGS.steps,
        "dataset_dir": FLAGS.dataset_dir,
        "load_average_at_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "max_rel_loss_diff": diff,
        "runs": runs,
    }
    out = Path(FLAGS.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{FLAGS.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Training: 2 processes x 1 device vs 1 process x 2 devices ({FLAGS.steps} steps)",
        "",
        f"`{' '.join(FLAGS.gin_file)}`, bindings `{'; '.join(FLAGS.gin_bindings)}`, data "
        f"`{FLAGS.dataset_dir}`; {os.cpu_count()} CPU cores, load average at the end "
        f"{report['load_average_at_end'][0]:.1f}.",
        "",
        "| run | wall s | steps/s after compiling | peak RSS MiB (largest process) | final loss |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        rate = f"{r['steps_per_sec']:.2f}" if r["steps_per_sec"] else "-"
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {rate} | {r['peak_rss_mib']:.0f} | "
            f"{r['losses'][-1]:.6f} |"
        )
    lines += ["", f"Max relative difference of the per-step losses: {diff:.2e}."]
    (out / f"{FLAGS.name}.md").write_text("\n".join(lines) + "\n")
    plot(report, out / f"{FLAGS.name}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
