"""The trainer: tiny BERT / T5 on CPU, 1 and 8 (forced host) devices, exact resume after SIGKILL."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gin
import numpy as np
import pytest
from fixtures import run_python, start_python, write_beir_fixture

from aligner_jax.common import cli, errors
from aligner_jax.evaluation import beir_eval
from aligner_jax.indexing import token_store as ts
from aligner_jax.training import checkpointing, input_pipeline, trainer

REPO = Path(__file__).resolve().parent.parent


def _bindings(model_dir, data_dir, steps, **extra):
    values = {
        "MODEL_DIR": repr(str(model_dir)),
        "TRAIN_STEPS": steps,
        "QUERY_LENGTH": 16,
        "DOC_LENGTH": 32,
        "WARMUP_STEPS": 2,
        "LossConfig.temperature": 0.05,
        # A smoother LP gate than the paper's 0.002 so a randomly initialised tiny model learns
        # within a few dozen steps (the paper starts from a pretrained T5).
        "AlignerConfig.epsilon": 0.1,
        "LEARNING_RATE": 3e-3,
        "BATCH_SIZE": 8,
        "DataConfig.task": "'beir_train_bm25'",
        "beir_train_source.dataset_dir": repr(str(data_dir)),
        "beir_train_source.qrels_split": "'test'",
        "train.backbone_weights": "'random'",
        "train.summary_period": 5,
        "CheckpointConfig.period": 3,
    }
    values.update(extra)
    return [f"{k} = {v}" for k, v in values.items()]


def _losses(model_dir) -> dict[int, float]:
    """Per-step losses (each step is logged once, also across a resume)."""
    out = {}
    for line in (Path(model_dir) / trainer.TRAIN_LOG).read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


WORDS = (
    "apple river stone cloud violin tiger copper lantern meadow orbit canyon pepper falcon "
    "glacier harbor velvet quartz maple thunder saddle ember mosaic nectar prism walrus "
    "tundra cobalt mango saffron beacon cactus dolphin fossil garnet hazel igloo jasmine "
    "kettle lagoon marble nutmeg oyster pebble quiver raven sequoia tulip umber vortex"
).split()


@pytest.fixture()
def toy(tmp_path):
    """48 documents of random words; each query repeats 3 words of its document."""
    rng = random.Random(0)
    docs, queries, qrels = {}, {}, {}
    for i in range(48):
        words = rng.sample(WORDS, 12)
        docs[f"d{i}"] = {"title": "", "text": " ".join(words)}
        queries[f"q{i}"] = " ".join(rng.sample(words, 3))
        qrels[f"q{i}"] = {f"d{i}": 1}
    return write_beir_fixture(tmp_path / "data", docs, queries, qrels, split="test")


# The two tiny backbones: gin files, bindings that turn dropout off, and the backbone path of an
# MLP input kernel (split over the mesh's model axis when sharded).
MODELS = {
    "bert": (
        ["models/bert_tiny.gin"],
        {"BertConfig.hidden_dropout_prob": 0.0, "BertConfig.attention_probs_dropout_prob": 0.0},
        ("layer_0", "intermediate", "kernel"),
    ),
    "t5": (
        ["models/t5_tiny.gin", "models/aligner_t5.gin"],
        {"T5Config.dropout_rate": 0.0},
        ("encoder", "layers_0", "mlp", "wi_0", "kernel"),
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_model_trains_on_one_device(name, toy, tmp_path):
    gin_files, no_dropout, _ = MODELS[name]
    cli.parse_gin([*gin_files, "runs/train.gin"], _bindings(tmp_path / "m", toy, 30, **no_dropout))
    last = trainer.train()
    losses = _losses(tmp_path / "m")
    assert sorted(losses) == list(range(1, 31))
    first, final = (
        np.mean([losses[s] for s in range(1, 6)]),
        np.mean([losses[s] for s in range(26, 31)]),
    )
    assert final < 0.7 * first, (first, final)
    assert set(last) >= {"loss", "accuracy", "grad_norm", "false_negatives"}
    steps = sorted(int(p.name) for p in (tmp_path / "m" / "checkpoints").iterdir())
    assert steps == [24, 27, 30]  # every 3 steps, keep 3
    assert list((tmp_path / "m").glob("events.out.tfevents*"))  # TensorBoard summaries
    assert "AlignerModel.config" in (tmp_path / "m" / "config.gin").read_text()


def test_non_finite_gradients_under_a_finite_loss_stop_before_a_checkpoint(
    toy, tmp_path, monkeypatch
):
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import tree_util  # noqa: PLC0415

    from aligner_jax.models.aligner_model import AlignerModel  # noqa: PLC0415

    real = AlignerModel.loss_fn

    def poisoned(self, params, batch, rng):
        loss, metrics = real(self, params, batch, rng)
        leaf = tree_util.tree_leaves(params)[0]
        poison = 0.0 * jnp.sqrt(jnp.sum(leaf * 0.0))  # 0 itself; its gradient is 0·∞ = nan
        metrics["total_loss"] = loss + poison
        return loss + poison, metrics

    monkeypatch.setattr(AlignerModel, "loss_fn", poisoned)
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 4))
    with pytest.raises(
        errors.NonFiniteLossError, match=r"gradient norm is nan \(loss [0-9.]+\) at step 1:"
    ):
        trainer.train()
    assert not list((tmp_path / "m" / "checkpoints").glob("*/"))


def test_nan_loss_stops_with_a_clear_message(toy, tmp_path):
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"],
        _bindings(tmp_path / "m", toy, 6, LEARNING_RATE=1e30),
    )
    with pytest.raises(
        errors.NonFiniteLossError, match=r"loss is (nan|inf) at step \d.*checkpoint"
    ) as stopped:
        trainer.train()
    # The step named is the log's numbering (1-based): the one after the last step logged.
    logged = [json.loads(x)["step"] for x in (tmp_path / "m" / "train_log.jsonl").open()]
    assert f"at step {(logged[-1] if logged else 0) + 1}:" in str(stopped.value)
    assert "--gin.LEARNING_RATE=" in str(stopped.value)


@pytest.mark.parametrize("binding", ["train.summary_period=0", "train.stop_after_steps=0"])
def test_periods_below_one_are_refused_before_training(toy, tmp_path, binding):
    """``summary_period=0`` used to fail after the first step (modulo by zero, a traceback)."""
    name, value = binding.split("=")
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"],
        _bindings(tmp_path / "m", toy, 6, **{name: int(value)}),
    )
    with pytest.raises(errors.ConfigError, match=rf"{name}=0: must be >= 1"):
        trainer.train()
    assert not (tmp_path / "m" / "train_log.jsonl").exists()


def _run(*args: str, **env) -> subprocess.CompletedProcess:
    """Runs ``python ARGS`` (`run_python`); asserts it succeeded."""
    proc = run_python(*args, timeout=900, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


SHARDED_SCRIPT = """
import json, sys
import jax
from aligner_jax.common import cli
from aligner_jax.training import trainer
from aligner_jax.models import partitioning
gin_files, bindings, path = (json.loads(a) for a in sys.argv[1:4])
cli.parse_gin(gin_files + ["runs/train.gin"], bindings)
assert jax.device_count() == 8, jax.devices()
trainer.train()
# The parameters really are split over the model axis.
from aligner_jax.models.aligner_model import AlignerModel
from flax import linen as nn
model = AlignerModel()
specs = nn.get_partition_spec(model.init_abstract())
mesh = partitioning.create_mesh(2)
shardings = nn.logical_to_mesh_sharding(specs, mesh, partitioning.standard_logical_axis_rules())
node = shardings["backbone"]
for key in path:
    node = node[key]
print("MLP_SPEC", tuple(node.spec))
print("MESH", dict(mesh.shape))
"""


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_model_trains_sharded_on_8_host_devices(name, toy, tmp_path):
    gin_files, no_dropout, mlp_path = MODELS[name]
    bindings = _bindings(tmp_path / "m", toy, 24, **{"train.num_partitions": 2, **no_dropout})
    args = [json.dumps(gin_files), json.dumps(bindings), json.dumps(mlp_path)]
    proc = _run("-c", SHARDED_SCRIPT, *args, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert "MLP_SPEC (None, 'model')" in proc.stdout
    assert "MESH {'data': 4, 'model': 2}" in proc.stdout
    losses = _losses(tmp_path / "m")
    first = np.mean([losses[s] for s in range(1, 7)])
    final = np.mean([losses[s] for s in range(19, 25)])
    assert final < 0.8 * first, (first, final)


def _train_cmd(bindings):
    """The arguments of ``python`` that run aligner-train (for `run_python`, `start_python`)."""
    cmd = ["-m", "aligner_jax.train", "--gin_file=models/bert_tiny.gin"]
    cmd += ["--gin_file=runs/train.gin"] + [f"--gin_bindings={b}" for b in bindings]
    return cmd


def test_killed_run_resumes_with_identical_losses(toy, tmp_path):
    steps = 12
    _run(*_train_cmd(_bindings(tmp_path / "ref", toy, steps)))

    resumed_dir = tmp_path / "killed"
    cmd = _train_cmd(_bindings(resumed_dir, toy, steps))
    kill_after = random.Random(os.getpid()).randint(4, 9)  # a random point past a checkpoint
    proc = start_python(*cmd)
    log = resumed_dir / trainer.TRAIN_LOG
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= kill_after:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    logged_before_kill = len(log.read_text().splitlines())
    assert logged_before_kill < steps

    restarted = run_python(*cmd, timeout=900)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from step" in restarted.stderr
    ref, got = _losses(tmp_path / "ref"), _losses(resumed_dir)
    assert sorted(got) == list(range(1, steps + 1))
    logged = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # each step once: the log was cut at the restore
    assert got == ref  # bit-identical: same batches, same dropout, same restored state

    # End to end: checkpoint -> token store -> evaluation, for both runs: identical indexes
    # (same sha256 of every shard file) and identical metrics.
    reports, stores = [], []
    for model_dir in (tmp_path / "ref", resumed_dir):
        gin.clear_config()
        cli.parse_gin(
            ["models/bert_tiny.gin", "eval/exhaustive.gin"],
            [f"load_encoder.checkpoint = {str(model_dir)!r}", "IndexingConfig.shard_size = 16"],
        )
        reports.append(
            beir_eval.evaluate(
                dataset_dir=str(toy),
                output_dir=str(model_dir / "eval"),
                index_dir=str(model_dir / "index"),
            )
        )
        stores.append(ts.TokenStore(model_dir / "index", verify_checksums=True))
    assert reports[0]["config"]["model"].endswith("@12")  # the final checkpoint's step
    assert reports[0]["metrics"] == reports[1]["metrics"]
    assert reports[0]["config"]["model_fingerprint"] == reports[1]["config"]["model_fingerprint"]
    files = [
        {m["path"]: m["sha256"] for s in st.manifest["shards"] for m in s["files"].values()}
        for st in stores
    ]
    assert files[0] == files[1] and len(files[0]) == 3 * 5


def test_a_preemption_notice_saves_the_step_reached_and_the_rerun_resumes_it(toy, tmp_path):
    """SIGTERM part-way: the step being trained is finished and saved (no periodic checkpoint
    falls before the end here), the job exits 143 naming it, and the same command resumes from
    it with the uninterrupted run's losses."""
    steps, far = 12, {"CheckpointConfig.period": 100}
    _run(*_train_cmd(_bindings(tmp_path / "ref", toy, steps, **far)))
    model_dir = tmp_path / "preempted"
    cmd = _train_cmd(_bindings(model_dir, toy, steps, **far))
    notice_after = random.Random(os.getpid()).randint(3, 8)
    proc = start_python(*cmd, capture=True)
    log = model_dir / trainer.TRAIN_LOG
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= notice_after:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    saved = len(log.read_text().splitlines())
    assert notice_after <= saved < steps
    folder = checkpointing.checkpoint_dir(model_dir)
    assert sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) == [saved]
    assert f"preempted after step {saved} of {steps}: saved step {saved}" in err
    assert "aligner-train: terminated (SIGTERM)" in err

    restarted = run_python(*cmd, timeout=900)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"resumed from step {saved}" in restarted.stderr
    assert _losses(model_dir) == _losses(tmp_path / "ref")


def test_pipeline_mismatch_on_resume_is_refused(toy, tmp_path):
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3))
    trainer.train()
    gin.clear_config()
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"],
        _bindings(tmp_path / "m", toy, 6, **{"DataConfig.seed": 7}),
    )
    with pytest.raises(ValueError, match="another input pipeline"):
        trainer.train()


def test_a_stop_after_steps_run_saves_its_last_step_and_another_model_is_refused(toy, tmp_path):
    """``stop_after_steps`` saves the step it stops at (between checkpoint periods it used to
    lose the steps since the last one); resuming with another model (projection_dim) is one
    CheckpointError naming the checkpoint (it was orbax's traceback) and the leaves that differ,
    found from the checkpoint's metadata before any array is read (the failed restore it used
    to start left orbax's reads pending: a "coroutine was never awaited" warning per array
    later in the test session)."""
    bindings = _bindings(tmp_path / "m", toy, 6, **{"train.stop_after_steps": 2})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "m" / "checkpoints").iterdir()) == ["2"]
    gin.clear_config()
    bindings = _bindings(tmp_path / "m", toy, 6, **{"AlignerConfig.projection_dim": 8})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    leaf = re.escape("(params.projection.kernel: (32, 16) in the checkpoint, (32, 8) now; ")
    with pytest.raises(
        errors.CheckpointError, match=r"checkpoints/2: written for another model .*" + leaf
    ):
        trainer.train()


def test_fewer_steps_than_the_newest_checkpoint_is_refused(toy, tmp_path):
    """TRAIN_STEPS below the newest checkpoint used to "train steps 3..2 of 2", report success
    and rewrite config.gin with the smaller TRAIN_STEPS."""
    bindings = _bindings(tmp_path / "m", toy, 3, WARMUP_STEPS=1)  # as below: the same optimizer
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    trainer.train()
    written = (tmp_path / "m" / "config.gin").read_text()
    gin.clear_config()
    bindings = _bindings(tmp_path / "m", toy, 2, WARMUP_STEPS=1)
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(
        errors.ConfigError, match=r"newest checkpoint is step 3, past TRAIN_STEPS=2"
    ):
        trainer.train()
    assert (tmp_path / "m" / "config.gin").read_text() == written


def test_resuming_with_other_data_bindings_is_refused(toy, tmp_path):
    """The task's data bindings are part of the pipeline a checkpoint records: resuming with
    another number of negatives (or folder) is refused, naming what changed. It used to resume
    and train on other examples, and config.gin then recorded only the new bindings."""
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3))
    trainer.train()
    gin.clear_config()
    bindings = _bindings(tmp_path / "m", toy, 6, **{"beir_train_source.num_negatives": 2})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(ValueError, match=r"another input pipeline \(sources: .*'num_negatives'"):
        trainer.train()
    # Another tokenizer too: the checkpoint's batches were tokenized with the default one.
    import shutil  # noqa: PLC0415

    from aligner_jax.tasks import vocab  # noqa: PLC0415

    other = shutil.copy(vocab.default_tokenizer_file(), tmp_path / "tokenizer.json")
    gin.clear_config()
    bindings = _bindings(
        tmp_path / "m", toy, 6, **{"task_vocabulary.tokenizer_file": repr(str(other))}
    )
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(ValueError, match=r"another input pipeline \(sources: .*'tokenizer_file'"):
        trainer.train()


def test_every_gin_file_parses():
    """Every gin file in gin/ parses (model files alone, run/eval files with what they need)."""
    needs = {
        "runs/train.gin": ["models/minilm.gin"],
        "runs/trainer.gin": ["models/minilm.gin"],
        "models/aligner_t5.gin": ["models/t5_base.gin"],
    }
    files = sorted(p.relative_to(cli.GIN_DIR).as_posix() for p in cli.GIN_DIR.rglob("*.gin"))
    assert len(files) >= 10
    for name in files:
        gin.clear_config()
        cli.parse_gin(needs.get(name, []) + [name])
        assert gin.config_str() is not None
    gin.clear_config()


def test_launch_scripts_are_valid_bash():
    for script in (REPO / "launch").iterdir():
        subprocess.run(["bash", "-n", str(script)], check=True)
        assert "aligner_jax." in script.read_text()
    for cluster in ("tpu_pod.sh", "slurm_gpu.sbatch"):  # a training and an indexing job
        text = (REPO / "launch" / cluster).read_text()
        assert "-m aligner_jax.train --multiprocess" in text, cluster
        assert "-m aligner_jax.index --multiprocess" in text, cluster
    for script in ("local_cpu.sh", "tpu_pod.sh", "slurm_gpu.sbatch", "local_processes.sh"):
        proc = subprocess.run(
            ["bash", str(REPO / "launch" / script)], capture_output=True, text=True
        )
        assert proc.returncode == 2 and "usage" in proc.stderr, script


def test_local_cpu_takes_any_model_dir_and_checks_fake_devices(tmp_path):
    """A quote in MODEL_DIR broke gin's parse of the binding the script wrote
    (``--gin.MODEL_DIR='it's'``); ``FAKE_DEVICES=abc`` reached XLA, which printed its help."""
    script = str(REPO / "launch" / "local_cpu.sh")
    env = dict(os.environ, FAKE_DEVICES="abc")
    proc = subprocess.run(
        ["bash", script, "runs/scifact_minilm.gin", str(tmp_path / "m")],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "FAKE_DEVICES=abc: expected a number of devices, e.g. FAKE_DEVICES=8"
    )
    quoted = tmp_path / 'it\'s a "run"'
    proc = subprocess.run(
        ["bash", script, "runs/scifact_minilm.gin", str(quoted), "--gin.TRAIN_STEPS=0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "--gin.TRAIN_STEPS=0 (warmup_linear_decay.total_steps): must be >= 1" in proc.stderr
    assert "gin configuration error" not in proc.stderr


def test_saved_batches_replay_the_pipeline_exactly(toy, tmp_path):
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path, toy, 1))
    config = input_pipeline.DataConfig()
    path = input_pipeline.save_batches(config, 5, tmp_path / "b.npz")
    fields = {k: v for k, v in config.identity().items() if k != "sources"}
    cached = input_pipeline.DataConfig(**{**fields, "cached_batches": str(path)})
    assert cached.identity() == config.identity()
    stream = input_pipeline.train_batches(config)
    expected = [next(stream) for _ in range(5)]
    assert expected[0]["doc_tokens"].shape == (8, 2, 32)
    assert expected[0]["doc_keys"].shape == (8, 2)  # replayed too: the loss's false negatives
    replay = input_pipeline.train_batches(cached, start_batch=2)
    for want in expected[2:]:
        got = next(replay)
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(ValueError, match=r"b\.npz holds 5 batches and the run needs more"):
        next(replay)

    other = input_pipeline.DataConfig(**{**fields, "batch_size": 4, "cached_batches": str(path)})
    with pytest.raises(ValueError, match=r"b\.npz was saved from another pipeline.*batch_size"):
        input_pipeline.train_batches(other)
    missing = input_pipeline.DataConfig(cached_batches=str(tmp_path / "none.npz"))
    with pytest.raises(FileNotFoundError, match="none.npz does not exist"):
        input_pipeline.train_batches(missing)
    (tmp_path / "bad.npz").write_text("not numpy")
    with pytest.raises(ValueError, match="bad.npz is not a saved batch file"):
        input_pipeline.train_batches(
            input_pipeline.DataConfig(cached_batches=str(tmp_path / "bad.npz"))
        )


# Run in a process where seqio, TensorFlow and clu cannot be imported (an accelerator host with
# only JAX): the trainer replays saved batches and keeps its scalars in train_log.jsonl.
NO_TF_SCRIPT = """
import importlib.machinery, sys
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ("seqio", "tensorflow", "clu", "tasks", "bm25s"):
            return None  # as if not installed
        return super().find_spec(name, path, target)
sys.meta_path = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
from absl import app
from aligner_jax.common import cli
from aligner_jax import train
cli.define_gin_flags()
sys.argv = ["aligner-train"] + sys.argv[1:]
app.run(train.main)
"""


def test_replayed_batches_train_without_seqio_and_match_the_pipeline(toy, tmp_path):
    no_dropout = {
        "BertConfig.hidden_dropout_prob": 0.0,
        "BertConfig.attention_probs_dropout_prob": 0.0,
        "train.summary_period": 2,
    }
    steps = 6
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"],
        _bindings(tmp_path / "ref", toy, steps, **no_dropout),
    )
    trainer.train()
    batches = input_pipeline.save_batches(input_pipeline.DataConfig(), steps, tmp_path / "b.npz")

    # runs/trainer.gin is runs/train.gin without `import tasks`: no task configurables to bind.
    bindings = [
        b
        for b in _bindings(tmp_path / "replay", toy, steps, **no_dropout)
        if not b.startswith("beir_train_source")
    ] + [f"DataConfig.cached_batches = {str(batches)!r}"]
    argv = ["--gin_file=models/bert_tiny.gin", "--gin_file=runs/trainer.gin"]
    argv += [f"--gin_bindings={b}" for b in bindings]
    proc = _run("-c", NO_TF_SCRIPT, *argv)
    assert "no TensorBoard summaries: clu's writer cannot be imported" in proc.stderr
    ref, got = _losses(tmp_path / "ref"), _losses(tmp_path / "replay")
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)], [ref[s] for s in sorted(ref)], rtol=1e-5
    )

    # Every summary step records its window's rates; the throughput benchmark summarises them.
    records = [
        json.loads(x) for x in (tmp_path / "replay" / trainer.TRAIN_LOG).read_text().splitlines()
    ]
    windows = [r for r in records if "steps_per_sec" in r]
    assert [r["step"] for r in windows] == [2, 4, 6]
    # The first window starts after the first (compiling) step: rates exclude compilation.
    assert [r["window_steps"] for r in windows] == [1, 2, 2]
    assert all(r["steps_per_sec"] > 0 and r["tokens_per_sec"] > 0 for r in windows)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_throughput
    finally:
        sys.path.pop(0)
    summary = train_throughput.summarise_log(tmp_path / "replay" / trainer.TRAIN_LOG)
    assert summary["steps"] == steps and summary["timed_windows"] == 2
    assert summary["steps_per_sec"] == pytest.approx(
        np.median([r["steps_per_sec"] for r in windows[1:]])
    )
    assert summary["loss_last"] == got[steps]


def test_train_log_is_cut_to_the_restored_step(tmp_path):
    log = tmp_path / trainer.TRAIN_LOG
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)]
    log.write_text("".join(lines) + '{"step": 6, "lo')  # killed mid-line after step 5
    with trainer.open_train_log(log, 3) as f:
        f.write(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4]


def test_training_from_an_export_starts_from_its_trained_heads(toy, tmp_path):
    """``train.backbone_weights='hf:DIR'`` of an aligner-export folder starts from its
    projection and salience heads, as ``load_encoder`` does with the same spec; the trainer used
    to keep only the backbone and start the heads from a fresh random init."""
    import jax
    from fixtures import run_module

    from aligner_jax.encoding import loading

    out = tmp_path / "exported"
    proc = run_module(
        "aligner_jax.export", "--gin_file=models/bert_tiny.gin", "--gin.load_encoder.seed=4",
        f"--output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = repr(f"hf:{out}")
    extra = {"train.backbone_weights": spec, "LEARNING_RATE": 0.0, "WARMUP_STEPS": 1}
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3, **extra)
    )
    trainer.train()
    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin"], [f"load_encoder.checkpoint = {str(tmp_path / 'm')!r}"])
    trained = loading.load_encoder().params
    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin"], [f"load_encoder.backbone_weights = {spec}"])
    exported = loading.load_encoder().params
    heads = [k for k in exported if k != "backbone"]
    assert heads
    for name in heads:  # learning rate 0: the heads are the export's, unchanged
        for a, b in zip(
            jax.tree_util.tree_leaves(trained[name]),
            jax.tree_util.tree_leaves(exported[name]),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_takes_a_step_folder_and_refuses_a_typo_without_creating_it(
    toy, tmp_path, monkeypatch
):
    """``CheckpointConfig.restore`` with a step folder failed ("no checkpoint") after creating
    ``STEP/checkpoints/`` inside the source checkpoint; a typo ('latset') created
    ``./latset/checkpoints/``."""
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "a", toy, 3))
    trainer.train()
    step_folder = tmp_path / "a" / "checkpoints" / "3"
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "a").rglob("*"))
    monkeypatch.chdir(tmp_path)
    for spec, started in ((str(step_folder), True), ("latset", False)):
        gin.clear_config()
        restore = {"CheckpointConfig.restore": repr(spec)}
        cli.parse_gin(
            ["models/bert_tiny.gin", "runs/train.gin"],
            _bindings(tmp_path / f"b{started}", toy, 4, WARMUP_STEPS=1, **restore),
        )
        if started:
            trainer.train()
            assert (tmp_path / "bTrue" / "checkpoints" / "4").is_dir()
        else:
            with pytest.raises(errors.CheckpointError, match=r"restore='latset': no checkpoint"):
                trainer.train()
    assert not (tmp_path / "latset").exists()
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "a").rglob("*")) == before


def test_a_misspelt_backbone_is_refused_under_the_trainers_binding_before_anything(toy, tmp_path):
    """train.backbone_weights='minlm' was refused as load_encoder.backbone_weights, after the
    run had created MODEL_DIR/checkpoints."""
    bindings = _bindings(tmp_path / "m", toy, 3, **{"train.backbone_weights": "'minlm'"})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(errors.ConfigError, match=r"^train.backbone_weights='minlm': expected"):
        trainer.train()
    assert not (tmp_path / "m").exists()


def test_an_unknown_task_lists_the_registered_tasks_and_mixtures(toy, tmp_path):
    """The list named the tasks only, not the mixture beir_train_and_selfsup."""
    bindings = _bindings(tmp_path / "m", toy, 3, **{"DataConfig.task": "'beir_trian_bm25'"})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(errors.ConfigError) as refused:
        trainer.train()
    message = str(refused.value)
    assert message.startswith("DataConfig.task='beir_trian_bm25' is not a registered")
    assert "'beir_train_bm25'" in message and "mixtures: ['beir_train_and_selfsup'" in message
    assert not (tmp_path / "m").exists()
    # a split the task lacks: a ValueError traceback from seqio, after MODEL_DIR/checkpoints
    gin.clear_config()
    bindings = _bindings(tmp_path / "m", toy, 3, **{"DataConfig.split": "'validation'"})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(errors.ConfigError, match=r"^DataConfig.split='validation': the task "):
        trainer.train()
    assert not (tmp_path / "m").exists()


def test_a_mesh_that_does_not_fit_is_refused_before_model_dir_is_made(toy, tmp_path):
    """A refused num_partitions left an empty MODEL_DIR (made before the mesh's checks)."""
    bindings = _bindings(tmp_path / "m", toy, 3, **{"train.num_partitions": 3})
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    with pytest.raises(errors.ConfigError, match="num_partitions"):
        trainer.train()
    assert not (tmp_path / "m").exists()


def test_a_run_restored_from_another_learns_from_step_0_and_resumes_its_own(toy, tmp_path):
    """``CheckpointConfig.restore='DIR'`` restored the source's step and optimizer count, so the
    new run continued a schedule already decayed to 0 (its weights stayed the source's, 3e-10
    apart), and re-running it restarted from the source and crashed (``StepAlreadyExists``)."""
    import jax

    from aligner_jax.encoding import loading

    def params(model_dir):
        gin.clear_config()
        cli.parse_gin(["models/bert_tiny.gin"], [f"load_encoder.checkpoint = {str(model_dir)!r}"])
        return jax.tree_util.tree_leaves(loading.load_encoder().params)

    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "a", toy, 3))
    trainer.train()
    restore = {"CheckpointConfig.restore": repr(str(tmp_path / "a"))}
    for _ in range(2):  # the second run resumes the first's checkpoint at step 2
        gin.clear_config()
        cli.parse_gin(
            ["models/bert_tiny.gin", "runs/train.gin"],
            _bindings(tmp_path / "b", toy, 4, **restore, **{"train.stop_after_steps": 2}),
        )
        trainer.train()
    assert sorted(_losses(tmp_path / "b")) == [1, 2, 3, 4]
    assert (tmp_path / "b" / "checkpoints" / "4").is_dir()
    moved = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(params(tmp_path / "a"), params(tmp_path / "b"), strict=True)
    )
    assert moved > 1e-4  # it learned: a fresh schedule from step 0


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"TRAIN_STEPS": "'abc'"}, "--gin.TRAIN_STEPS='abc' (warmup_linear_decay.total_steps): "
         "expected an integer"),
        ({"LEARNING_RATE": "'x'"}, "--gin.LEARNING_RATE='x' (warmup_linear_decay.peak_value): "
         "expected a finite number"),
        ({"create_optimizer.learning_rate": 100.0}, "create_optimizer.learning_rate is replaced "
         "by train.learning_rate"),
        ({"create_optimizer.b2": 1.5}, "--gin.create_optimizer.b2=1.5: must be in [0.0, 1.0]"),
    ],
)  # fmt: skip
def test_bad_optimizer_settings_are_one_line_before_model_dir(toy, tmp_path, extra, message):
    """A non-number TRAIN_STEPS or LEARNING_RATE ended in a TypeError traceback (the second after
    MODEL_DIR held checkpoints/, config.gin and logs); create_optimizer.learning_rate, which the
    module's docstring named, was silently replaced by the trainer's."""
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3, **extra)
    )
    with pytest.raises(errors.ConfigError) as refused:
        trainer.train()
    assert str(refused.value).splitlines()[0].startswith(message)  # gin adds its own note
    assert not (tmp_path / "m").exists()


def test_resuming_with_other_optimizer_settings_is_refused_but_more_steps_go_on(toy, tmp_path):
    """A resume with another LEARNING_RATE or weight decay went on silently and rewrote
    config.gin as if the whole run had used them; raising TRAIN_STEPS is how a run goes on."""
    run = ["models/bert_tiny.gin", "runs/train.gin"]
    cli.parse_gin(run, _bindings(tmp_path / "m", toy, 3))
    trainer.train()
    config_before = (tmp_path / "m" / "config.gin").read_text()
    for extra in ({"LEARNING_RATE": 0.5}, {"create_optimizer.weight_decay": 0.9}):
        gin.clear_config()
        cli.parse_gin(run, _bindings(tmp_path / "m", toy, 6, **extra))
        with pytest.raises(errors.ConfigError, match=r"checkpoints/3: the checkpoint was trained "
                           r"with other optimizer settings \((create_optimizer|warmup_linear)"):  # fmt: skip
            trainer.train()
        assert (tmp_path / "m" / "config.gin").read_text() == config_before
    gin.clear_config()
    cli.parse_gin(run, _bindings(tmp_path / "m", toy, 5))
    trainer.train()
    assert sorted(_losses(tmp_path / "m")) == [1, 2, 3, 4, 5]


def test_a_resumed_run_removes_the_temporary_folder_of_a_killed_save(toy, tmp_path):
    """A run killed while orbax wrote step N left MODEL_DIR/checkpoints/N.orbax-checkpoint-tmp
    for ever when the resumed run did not save step N again (another period)."""
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3))
    trainer.train()
    killed = tmp_path / "m" / "checkpoints" / "4.orbax-checkpoint-tmp"
    (killed / "state").mkdir(parents=True)
    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 5))
    trainer.train()
    assert not killed.exists()
    assert sorted(p.name for p in (tmp_path / "m" / "checkpoints").iterdir()) == ["3", "5"]


def test_an_incomplete_checkpoint_folder_is_named_as_such(toy, tmp_path):
    """An empty MODEL_DIR/checkpoints/N (a half-copied run) was called a checkpoint "written for
    another model or optimizer"."""
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3))
    trainer.train()
    (tmp_path / "m" / "checkpoints" / "5").mkdir()
    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 6))
    with pytest.raises(errors.CheckpointError, match=r"checkpoints/5: an incomplete checkpoint "
                       r"\(no state or data: a copy or save that did not finish\)"):  # fmt: skip
        trainer.train()


def _sentencepiece_model(path: Path) -> Path:
    spm = pytest.importorskip("sentencepiece")
    from fixtures import TOY_DOCS  # noqa: PLC0415

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([d["text"] for d in TOY_DOCS.values()] * 5),
        model_prefix=str(path.with_suffix("")),
        vocab_size=100, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return path


def test_t5x_weights_train_on_their_sentencepiece_vocabulary(toy, tmp_path):
    """``train.backbone_weights='t5x:…'`` used to tokenize the training data with the default
    WordPiece vocabulary (ids that mean nothing to T5) while evaluation encodes with T5's
    SentencePiece model beside the checkpoint."""
    from aligner_jax import tasks  # noqa: PLC0415

    checkpoint = tmp_path / "t5x" / "checkpoint_1"
    checkpoint.mkdir(parents=True)
    gin_files = ["models/t5_tiny.gin", "models/aligner_t5.gin", "runs/train.gin"]
    weights = {"train.backbone_weights": repr(f"t5x:{checkpoint}"), "WARMUP_STEPS": 1}
    cli.parse_gin(gin_files, _bindings(tmp_path / "m", toy, 2, **weights))
    with pytest.raises(errors.ConfigError, match=r"no spiece.model.*sentencepiece_model_file"):
        trainer.train()
    assert not (tmp_path / "m").exists()  # refused before MODEL_DIR is made

    spiece = _sentencepiece_model(tmp_path / "t5x" / "spiece.model")
    trainer._use_weights_vocabulary(f"t5x:{checkpoint}", None, tmp_path / "m")
    assert tasks.task_vocabulary().sp_model == spiece.read_bytes()
    gin.clear_config()
    wordpiece = {**weights, "task_vocabulary.kind": "'wordpiece'"}
    cli.parse_gin(gin_files, _bindings(tmp_path / "m", toy, 2, **wordpiece))
    with pytest.raises(errors.ConfigError, match=r"is not the tokenizer of train.backbone_weights"):
        trainer.train()


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"DOC_LENGTH": 1}, r"sequence_length\['doc'\]=1 leaves no room.*--gin.DOC_LENGTH"),
        ({"QUERY_LENGTH": 1}, r"sequence_length\['query'\]=1 leaves no room"),
        ({"task_vocabulary.kind": "'bpe'"}, r"task_vocabulary.kind='bpe'"),
        (
            {"DataConfig.task": "'selfsup_pseudo_queries'"},
            r"selfsup_pseudo_queries needs a corpus",
        ),
        (
            {
                "DataConfig.task": "'beir_train_and_selfsup'",
                "selfsup_train_source.dataset_dir": "beir_train_source.dataset_dir",
                "beir_train_source.num_negatives": 2,
            },
            r"mixes tasks with different numbers of negatives.*beir_train_bm25: 2.*"
            r"selfsup_pseudo_queries: 1",
        ),
    ],
)
def test_data_binding_errors_are_one_line_before_model_dir_is_made(toy, tmp_path, extra, message):
    """These used to surface as a traceback (a raw TensorFlow one for the mixture) after
    MODEL_DIR was created."""
    if extra.get("selfsup_train_source.dataset_dir"):
        extra["selfsup_train_source.dataset_dir"] = repr(str(toy))
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"], _bindings(tmp_path / "m", toy, 3, **extra)
    )
    with pytest.raises(errors.UserError, match=message):
        trainer.train()
    assert not (tmp_path / "m").exists()


def test_a_t5x_run_checkpointed_before_the_vocabulary_fix_is_not_resumed(toy, tmp_path):
    """Checkpoints written before stop 89 record no task_vocabulary: a t5x: run among them
    trained on WordPiece ids, and resuming it now would tokenize with SentencePiece."""
    gin_files = ["models/t5_tiny.gin", "models/aligner_t5.gin", "runs/train.gin"]
    cli.parse_gin(gin_files, _bindings(tmp_path / "m", toy, 2, WARMUP_STEPS=1))
    trainer.train()  # random weights: the default WordPiece vocabulary
    record = tmp_path / "m" / "checkpoints" / "2" / "data" / "metadata"  # orbax JsonSave
    saved = json.loads(record.read_text())
    del saved["pipeline"]["sources"]["task_vocabulary"]  # as written before stop 89
    record.write_text(json.dumps(saved))
    checkpoint = tmp_path / "t5x" / "checkpoint_1"
    checkpoint.mkdir(parents=True)
    _sentencepiece_model(tmp_path / "t5x" / "spiece.model")
    gin.clear_config()
    weights = {"train.backbone_weights": repr(f"t5x:{checkpoint}"), "WARMUP_STEPS": 1}
    cli.parse_gin(gin_files, _bindings(tmp_path / "m", toy, 4, **weights))
    with pytest.raises(errors.ConfigError, match=r"written before training from t5x: weights"):
        trainer.train()
