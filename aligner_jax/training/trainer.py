"""The trainer (t5x style): one gin-configurable function, :func:`train`, behind ``aligner-train``.

The same gin files run on one CPU device, on 8 forced host devices and on
a TPU pod: the parameters carry logical axis names and a mesh with ``data`` and ``model`` axes
(``train.num_partitions`` = model-parallel size) places them.

Many processes (``common/distributed.py``, ``launch/local_processes.sh``): the mesh spans every
process's devices, each process reads the same global batches and places the rows of its own
devices, the gradients are all-reduced by the jitted step, and orbax writes each checkpoint
collectively (every process its shards). The losses are those of one process with as many
devices, and a checkpoint resumes under another process count at the same batch. Process 0
alone writes ``train_log.jsonl``, ``config.gin`` and the summaries; ``MODEL_DIR`` must be storage
every process sees.

Checkpoints (orbax, every ``CheckpointConfig.period`` steps, keeping ``keep``) hold the train
state and the input pipeline position; a restarted job restores the newest one and continues with
exactly the batches and dropout randomness an uninterrupted job would have used. A preemption
notice (SIGTERM) saves the step being trained before the job stops (``preemption.py``). TensorBoard
summaries (clu metric writers) report loss, accuracy, learning rate, steps/s and tokens/s. A NaN
or infinite loss stops the job with a clear message and no checkpoint of the bad state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from absl import logging
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from aligner_jax.common import checks, fileio, progress
from aligner_jax.common.errors import ConfigError, NonFiniteLossError, Terminated
from aligner_jax.encoding import loading as loading_lib
from aligner_jax.models import partitioning
from aligner_jax.models.aligner_model import AlignerModel
from aligner_jax.training import checkpointing, input_pipeline, optimizers, preemption
from aligner_jax.weights import hf_models, param_checks

TRAIN_LOG = "train_log.jsonl"


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def _state_specs(model: AlignerModel, tx: optax.GradientTransformation):
    boxed_params = model.init_abstract()
    boxed_opt = jax.eval_shape(tx.init, boxed_params)
    return TrainState(
        step=PartitionSpec(),
        params=nn.get_partition_spec(boxed_params),
        opt_state=nn.get_partition_spec(boxed_opt),
    )


def _with_shardings(abstract, shardings):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


@gin.configurable
def train(
    model_dir: str | None = None,
    model: AlignerModel | None = None,
    num_train_steps: int | None = None,
    data: input_pipeline.DataConfig | None = None,
    learning_rate: Any = 1e-4,
    optimizer_fn=optimizers.create_optimizer,
    checkpoint: checkpointing.CheckpointConfig | None = None,
    backbone_weights: str | None = "minilm",
    seed: int = 0,
    num_partitions: int = 1,
    summary_period: int = 10,
    stop_after_steps: int | None = None,
) -> dict:
    """Trains ``model`` on ``data`` for ``num_train_steps`` steps; returns the last metrics.

    Args:
      model_dir: checkpoints, summaries, ``train_log.jsonl`` and ``config.gin`` go here.
      model: an ``AlignerModel`` (gin: ``train.model = @AlignerModel()``).
      num_train_steps: total optimizer steps (a restarted job stops at the same total).
      data: the input pipeline (task, batch size, feature lengths, seed).
      learning_rate: a float or an optax schedule (gin: ``@warmup_linear_decay()``).
      optimizer_fn: called as ``optimizer_fn(learning_rate=...)`` (gin: ``create_optimizer``).
      checkpoint: period, how many to keep, what to restore.
      backbone_weights: initial backbone weights when starting fresh: ``'minilm'`` (the bundled
        model), ``'hf:/path/folder'`` (a Hugging Face BERT-family / T5 folder, whose config.json
        also sets the backbone architecture and whose tokenizer tokenizes the training data
        unless ``task_vocabulary`` is bound, to the same vocabulary),
        ``'t5x:/path/checkpoint_N'`` (a T5X T5 v1.1 checkpoint) or ``'random'``.
      seed: parameter init, dropout and data order seed.
      num_partitions: size of the mesh's ``model`` axis (tensor parallelism).
      summary_period: steps between summaries / log lines.
      stop_after_steps: stop this run after that many steps (tests, time-boxed jobs); a later
        run resumes from the checkpoints.
    """
    checks.required("train.model_dir", model_dir)  # unbound: no run file
    checks.required("train.num_train_steps", num_train_steps)
    checks.required("train.model", model)
    # bound to an unset macro (``MODEL_DIR = %gin.REQUIRED``): gin passes its sentinel
    if not isinstance(model_dir, str | os.PathLike) or not str(model_dir):
        raise ConfigError(
            "MODEL_DIR (train.model_dir) is not set: add --gin.MODEL_DIR=\"'/path/to/model_dir'\""
        )
    if isinstance(num_train_steps, bool) or not isinstance(num_train_steps, int):
        raise ConfigError(
            f"TRAIN_STEPS (train.num_train_steps) is {num_train_steps!r}: add --gin.TRAIN_STEPS=1000"
        )
    if backbone_weights:
        loading_lib.check_weights_spec(backbone_weights, "train.backbone_weights")
    if checks.is_bound("create_optimizer.learning_rate"):
        raise ConfigError(
            "create_optimizer.learning_rate is replaced by train.learning_rate, which the "
            "trainer passes: set --gin.LEARNING_RATE=... (the schedule's peak) or "
            "--gin.train.learning_rate=... instead"
        )
    if not callable(learning_rate):  # a schedule checks its own settings
        checks.number("train.learning_rate", learning_rate, low=0.0)
    checks.integer("train.summary_period", summary_period, minimum=1)
    if stop_after_steps is not None:
        checks.integer("train.stop_after_steps", stop_after_steps, minimum=1)
    data = data or input_pipeline.DataConfig()
    checkpoint = checkpoint or checkpointing.CheckpointConfig()
    config = loading_lib.config_for_weights(model.config, backbone_weights)
    if config != model.config:  # hf: weights bring their backbone's (and heads') architecture
        model = AlignerModel(config, model.loss)
    tx = optimizer_fn(learning_rate=learning_rate)  # its settings checked before MODEL_DIR
    model_dir = fileio.check_output_dir(model_dir, "MODEL_DIR")
    mesh = partitioning.create_mesh(num_partitions)
    _check_batch_fits_mesh(data, mesh)  # checked before MODEL_DIR is made: a refusal leaves none
    pretrained = bool(backbone_weights) and backbone_weights.startswith((hf_models.PREFIX, "t5x:"))
    if pretrained and not data.cached_batches:  # replayed batches were tokenized when saved
        _use_weights_vocabulary(backbone_weights, config.backbone, model_dir)
    input_pipeline.check_task(data)  # with the vocabulary the data will be tokenized with
    model_dir.mkdir(parents=True, exist_ok=True)
    rules = partitioning.standard_logical_axis_rules()

    with mesh, nn.logical_axis_rules(rules):
        state_shardings = nn.logical_to_mesh_sharding(_state_specs(model, tx), mesh, rules)
        batch_sharding = NamedSharding(mesh, PartitionSpec(partitioning.DATA_AXIS))

        def state_from(params):
            return TrainState(
                step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
            )

        def init_state(rng):
            return state_from(nn.meta.unbox(model.init(rng)))

        abstract_state = _with_shardings(
            jax.eval_shape(init_state, jax.random.PRNGKey(seed)), state_shardings
        )
        mngr = checkpointing.manager(model_dir, checkpoint)
        fresh = _FreshState(abstract_state, init_state, state_from, state_shardings, seed)
        optimizer = optimizers.identity(learning_rate)
        state, start_step = _restore_or_init(
            mngr, checkpoint, data, optimizer, fresh, model, backbone_weights
        )
        if start_step > num_train_steps:
            raise ConfigError(
                f"{checkpointing.checkpoint_dir(model_dir)}: its newest checkpoint is step "
                f"{start_step}, past TRAIN_STEPS={num_train_steps}: nothing to train (raise "
                "--gin.TRAIN_STEPS to go on, or use another MODEL_DIR)"
            )
        base_rng = jax.random.PRNGKey(seed + 1)

        def train_step(state: TrainState, batch):
            rng = jax.random.fold_in(base_rng, state.step)
            grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
            (_, metrics), grads = grad_fn(state.params, batch, rng)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics["grad_norm"] = optax.global_norm(grads)
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        step_fn = jax.jit(
            train_step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, None),
            donate_argnums=(0,),
        )
        batches = input_pipeline.train_batches(data, start_batch=start_step)
        writer = _summary_writer(model_dir)
        if start_step == 0:
            writer.write_hparams(_hparams(model, data, num_train_steps, seed, num_partitions))
        chief = jax.process_index() == 0
        log_file = open_train_log(model_dir / TRAIN_LOG, start_step) if chief else _NullLog()
        if chief:
            fileio.atomic_write_text(model_dir / "config.gin", gin.operative_config_str())
        last_saved = start_step
        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
        metrics_host: dict[str, float] = {}
        end = (
            num_train_steps
            if stop_after_steps is None
            else min(num_train_steps, start_step + stop_after_steps)
        )
        logging.info("training steps %d..%d of %d on %s", start_step, end, num_train_steps, mesh)
        run_start = time.perf_counter()
        bar = progress.Progress(end - start_step, "train", "step")
        preempted = None
        try:
            with preemption.Watch() as watch:
                for step in range(start_step, end):
                    global_batch = next(batches)
                    batch_tokens = sum(
                        int(np.count_nonzero(global_batch[k])) for k in input_pipeline.TOKEN_KEYS
                    )
                    window_tokens += batch_tokens
                    batch = {k: _place(v, batch_sharding) for k, v in global_batch.items()}
                    state, metrics = step_fn(state, batch)
                    metrics_host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    window_steps += 1
                    if step == start_step and (step + 1) % summary_period and step + 1 != end:
                        # Rates exclude compiling: the first window starts after this run's first step.
                        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
                    loss, grad_norm = metrics_host["total_loss"], metrics_host["grad_norm"]
                    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
                        what = (
                            f"training loss is {loss}"
                            if not np.isfinite(loss)
                            else f"training gradient norm is {grad_norm} (loss {loss:.4g})"
                        )
                        raise NonFiniteLossError(
                            f"{what} at step {step + 1}: "
                            f"stopping without saving this state. The last checkpoint is step "
                            f"{last_saved} in {checkpointing.checkpoint_dir(model_dir)} (its weights "
                            "may already be diverging: if a resume stops again, start again in "
                            "another MODEL_DIR); lower the learning rate (--gin.LEARNING_RATE=... "
                            "with the run gins, the schedule's peak), check the data, or use float32."
                        )
                    lr = optimizers.learning_rate_at(learning_rate, step)
                    record = {"step": step + 1, "lr": lr, **metrics_host}
                    done = step + 1
                    if done % summary_period == 0 or done == end:
                        elapsed = time.perf_counter() - window_start
                        # The rates of the window ending here (after the first step: no compiling).
                        record.update(
                            steps_per_sec=window_steps / elapsed,
                            tokens_per_sec=window_tokens / elapsed,
                            window_steps=window_steps,
                        )
                        scalars = dict(metrics_host)
                        scalars.update(
                            learning_rate=lr,
                            steps_per_sec=record["steps_per_sec"],
                            tokens_per_sec=record["tokens_per_sec"],
                        )
                        writer.write_scalars(done, scalars)
                        logging.info(
                            "step %d/%d loss %.4f acc %.3f lr %.2e %.2f steps/s %.0f tokens/s",
                            done,
                            num_train_steps,
                            scalars["loss"],
                            scalars["accuracy"],
                            lr,
                            scalars["steps_per_sec"],
                            scalars["tokens_per_sec"],
                        )
                        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                    bar.update(1, tokens=batch_tokens)
                    if done % checkpoint.period == 0 or done == num_train_steps:
                        checkpointing.save(mngr, done, state, _data_state(data, done, optimizer))
                        last_saved = done
                    if watch.reached(done) and done != end:  # asked at every step, on every process
                        if last_saved != done:
                            checkpointing.save(
                                mngr, done, state, _data_state(data, done, optimizer)
                            )
                            last_saved = done
                        preempted = done
                        break
        finally:
            bar.close()
            log_file.close()
            mngr.wait_until_finished()
            writer.flush()
        if preempted is not None:
            logging.warning(
                "preempted after step %d of %d: saved step %d in %s; re-run the same command "
                "to resume from it",
                preempted, num_train_steps, preempted, checkpointing.checkpoint_dir(model_dir),
            )  # fmt: skip
            raise Terminated()
        if last_saved != end and end > start_step:  # the last step, also of a stop_after_steps
            checkpointing.save(
                mngr, end, state, _data_state(data, end, optimizer)
            )  # run (t5x saves it)
            mngr.wait_until_finished()
            last_saved = end
    if jax.process_index() == 0:  # one summary per job (every process holds the same one)
        print(
            summary(
                model_dir, start_step, end, num_train_steps, time.perf_counter() - run_start,
                bar.rate(), metrics_host, mngr.latest_step(),
            )
        )  # fmt: skip
    return metrics_host


def _place(value, sharding: NamedSharding) -> jax.Array:
    """A global array from the host value every process holds: each process puts the slices of
    its own devices (multi-process meshes included)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _check_batch_fits_mesh(data: input_pipeline.DataConfig, mesh) -> None:
    replicas = mesh.shape[partitioning.DATA_AXIS]
    if data.batch_size % replicas:
        raise ConfigError(
            f"--gin.BATCH_SIZE={data.batch_size} (DataConfig.batch_size) must be a multiple of "
            f"the mesh's data axis ({replicas} = {jax.device_count()} devices / "
            f"train.num_partitions)"
        )


class _NullLog:
    """``train_log.jsonl`` of processes other than 0 (process 0 writes the file)."""

    def write(self, text: str) -> None:
        del text

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def summary(
    model_dir: Path,
    start_step: int,
    end: int,
    num_train_steps: int,
    seconds: float,
    steps_per_s: float,
    metrics: dict[str, float],
    checkpoint_step: int | None,
) -> str:
    """The end-of-run summary: steps, time, final loss and the newest checkpoint."""
    ckpt = checkpointing.checkpoint_dir(model_dir)
    lines = [
        "=" * 72,
        f"ALIGNER training: steps {start_step}..{end} of {num_train_steps} in {seconds:.1f}s "
        f"({steps_per_s:.2f} steps/s after compiling)"
        + ("" if end == num_train_steps else "; stopped early, re-run to resume"),
        "final loss "
        + (f"{metrics['loss']:.4f} at step {end}" if "loss" in metrics else "-")
        + (f", accuracy {metrics['accuracy']:.3f}" if "accuracy" in metrics else ""),
        "checkpoint "
        + (f"{ckpt / str(checkpoint_step)}" if checkpoint_step is not None else f"none in {ckpt}"),
        f"model_dir  {model_dir} (config.gin, {TRAIN_LOG}, TensorBoard events)",
        "=" * 72,
    ]
    return "\n".join(lines)


class _LoggingOnlyWriter:
    """Stands in for clu's writer where clu/TensorFlow cannot be imported: the trainer's log lines
    and ``train_log.jsonl`` still carry every scalar."""

    def write_hparams(self, hparams):
        logging.info("hparams: %s", hparams)

    def write_scalars(self, step, scalars):
        del step, scalars  # already in the log line and train_log.jsonl

    def flush(self):
        pass


def open_train_log(path: Path, start_step: int):
    """``train_log.jsonl`` opened for appending after ``start_step``: records of later steps
    (written before a kill, after the checkpoint that was restored) and a torn last line are
    dropped first, so each step appears once."""
    if path.exists():
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if step <= start_step and line.endswith("\n"):
                kept.append(line)
        fileio.atomic_write_text(path, "".join(kept))
    return open(path, "a")  # noqa: SIM115 (closed by the caller)


def _summary_writer(model_dir: Path):
    """clu's TensorBoard writer (process 0) or a logging writer (other processes)."""
    try:
        from clu import metric_writers  # noqa: PLC0415  (imports TensorFlow)
    except ImportError as e:
        logging.warning(
            "no TensorBoard summaries: clu's writer cannot be imported (%s); scalars go to %s",
            e,
            model_dir / TRAIN_LOG,
        )
        return _LoggingOnlyWriter()
    return metric_writers.create_default_writer(
        str(model_dir), just_logging=jax.process_index() > 0, asynchronous=False
    )


def _data_state(data: input_pipeline.DataConfig, batches_consumed: int, optimizer: dict) -> dict:
    return {
        "batches_consumed": batches_consumed,
        "pipeline": data.identity(),
        "optimizer": optimizer,
    }


def _hparams(model, data, steps, seed, partitions) -> dict:
    cfg = model.config
    return {
        "projection": cfg.projection,
        "salience": cfg.salience,
        "objective": model.loss.objective,
        "alignment": model.loss.alignment,
        "temperature": model.loss.temperature,
        "task": data.task,
        "batch_size": data.batch_size,
        "num_train_steps": steps,
        "seed": seed,
        "num_partitions": partitions,
    }


@dataclasses.dataclass(frozen=True)
class _FreshState:
    """How to make a train state: its abstract (sharded) shape, the jittable constructors from a
    seed or from parameters, and where each leaf lives on the mesh."""

    abstract: Any
    init: Callable[[jax.Array], TrainState]
    from_params: Callable[[Any], TrainState]
    shardings: Any
    seed: int


_VOCABULARY_BINDINGS = ("kind", "tokenizer_file", "sentencepiece_model_file")


def _use_weights_vocabulary(backbone_weights: str, backbone_config, model_dir: Path) -> None:
    """Training data from ``hf:`` or ``t5x:`` weights is tokenized with their own tokenizer (as
    ``load_encoder`` encodes with it: the folder's, or T5's SentencePiece model beside the
    checkpoint): ``task_vocabulary`` is bound to it when no ``task_vocabulary`` binding is given,
    and a configured vocabulary that differs is refused. A T5X checkpoint with no SentencePiece
    model beside it needs ``task_vocabulary.sentencepiece_model_file``."""
    from aligner_jax import tasks  # noqa: PLC0415  (TensorFlow: only when the task runs)

    explicit = [name for name in _VOCABULARY_BINDINGS if checks.is_bound(f"task_vocabulary.{name}")]
    try:
        spec = loading_lib.resolve_tokenizer(loading_lib.AUTO, backbone_weights, backbone_config)
    except ConfigError:  # a T5X checkpoint without its SentencePiece model beside it
        if explicit and hasattr(tasks.task_vocabulary(), "sp_model"):
            return  # the SentencePiece model bound is the one it can be checked against
        raise ConfigError(
            f"train.backbone_weights={backbone_weights!r} is a T5 checkpoint, whose training "
            "data needs T5's SentencePiece vocabulary, and no spiece.model or "
            "sentencepiece.model is beside it: bind task_vocabulary.kind = 'sentencepiece' and "
            "task_vocabulary.sentencepiece_model_file = '/path/spiece.model'"
        ) from None
    kind = "sentencepiece" if spec.startswith("sentencepiece:") else "wordpiece"
    file = Path(spec.removeprefix("sentencepiece:").removeprefix("wordpiece:"))
    if explicit:
        configured = tasks.task_vocabulary()
        if not _same_vocabulary(configured, kind, file):
            raise ConfigError(
                f"task_vocabulary ({configured!r}) is not the tokenizer of "
                f"train.backbone_weights={backbone_weights!r} ({file}): remove the "
                f"task_vocabulary.{explicit[0]} binding to train with the folder's tokenizer"
            )
        return
    if kind == "wordpiece" and file.suffix == ".txt":  # WordPieceVocabulary reads tokenizer.json
        built = tokenizers.BertWordPieceTokenizer(
            str(file), lowercase=hf_models.lowercase(file.parent)
        )
        file = model_dir / "tokenizer.json"
        model_dir.mkdir(parents=True, exist_ok=True)
        # Atomic: every process of a multi-process job writes the same file and reads it back.
        fileio.atomic_write_text(file, built.to_str())
    gin.bind_parameter("task_vocabulary.kind", kind)
    name = "tokenizer_file" if kind == "wordpiece" else "sentencepiece_model_file"
    gin.bind_parameter(f"task_vocabulary.{name}", str(file))
    tasks.task_vocabulary()  # checks the file now, and config.gin records the bindings
    logging.info("training data tokenized with %s (the tokenizer of %s)", file, backbone_weights)


def _same_vocabulary(vocabulary, kind: str, file: Path) -> bool:
    """Whether a seqio ``vocabulary`` maps tokens to the ids of the tokenizer ``file``."""
    from aligner_jax import tasks  # noqa: PLC0415  (TensorFlow: only when the task runs)

    if kind == "sentencepiece":
        return getattr(vocabulary, "sp_model", None) == file.read_bytes()
    if not isinstance(vocabulary, tasks.WordPieceVocabulary):
        return False
    if file.suffix == ".txt":
        lines = file.read_text(encoding="utf-8").splitlines()
        ids = {token: i for i, token in enumerate(lines)}
    else:
        ids = tokenizers.Tokenizer.from_file(str(file)).get_vocab()
    return tokenizers.Tokenizer.from_file(vocabulary.tokenizer_file).get_vocab() == ids


def _restore_or_init(
    mngr, checkpoint, data, optimizer: dict, fresh: _FreshState, model, backbone_weights
):
    """Restores the newest (or a given) checkpoint, or initialises a fresh state (with the
    backbone weights loaded from ``backbone_weights``)."""
    abstract_state, state_shardings = fresh.abstract, fresh.shardings
    latest = mngr.latest_step()
    if checkpoint.restore == "none" and latest is not None:
        raise ConfigError(
            f"{checkpointing.checkpoint_dir(mngr.directory.parent)} already holds checkpoints "
            "but --gin.CheckpointConfig.restore=\"'none'\": use another MODEL_DIR or --gin.CheckpointConfig.restore=\"'latest'\""
        )
    if checkpoint.restore not in ("latest", "none") and latest is None:
        # A new run from another run's weights: its own step 0 and a fresh optimizer (the
        # source's step and schedule count would continue a schedule already decayed to 0).
        model_dir, step = checkpointing.restore_source(checkpoint.restore)
        source = checkpointing.manager(model_dir, checkpointing.CheckpointConfig(), create=False)
        state, _ = checkpointing.restore(source, step, abstract_state)
        state = jax.jit(fresh.from_params, out_shardings=state_shardings)(state.params)
        logging.info(
            "initialised from %s step %d: its weights, a fresh optimizer, step 0 and data from "
            "the start",
            checkpoint.restore,
            step,
        )
        return state, 0
    if latest is not None:  # this run's own checkpoints (a restore= source started the run)
        state, data_state = checkpointing.restore(mngr, latest, abstract_state)
        saved, now = dict(data_state.get("pipeline") or {}), data.identity()
        if "sources" not in saved or data.cached_batches:  # recorded since stop 84; a replay
            saved.pop("sources", None)  # (cached batches) may run where no task is registered
            now.pop("sources")
        elif input_pipeline.VOCABULARY not in saved["sources"]:  # written before stop 89
            if (backbone_weights or "").startswith("t5x:"):
                raise ConfigError(
                    f"{mngr.directory}/{latest}: written before training from t5x: weights "
                    "tokenized its data with T5's SentencePiece model (it trained on WordPiece "
                    "ids); resuming would change the tokens under it: start again in another "
                    "MODEL_DIR"
                )
            now["sources"].pop(input_pipeline.VOCABULARY, None)
        if saved != now:
            changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
            raise ConfigError(
                f"{mngr.directory}/{latest}: the checkpoint was written with another input "
                f"pipeline ({', '.join(f'{k}: {saved.get(k)} then, {now.get(k)} now' for k in changed)}); "
                "resume with the same task, data bindings, seed and batch size, or use another "
                "MODEL_DIR"
            )
        before = data_state.get("optimizer")  # recorded since stop 86
        if before is not None and before != optimizer:
            changed = sorted(
                k for k in before.keys() | optimizer.keys() if before.get(k) != optimizer.get(k)
            )
            raise ConfigError(
                f"{mngr.directory}/{latest}: the checkpoint was trained with other optimizer "
                f"settings ({'; '.join(f'{k}: {before.get(k)} then, {optimizer.get(k)} now' for k in changed)}); "
                "resume with the same LEARNING_RATE, WARMUP_STEPS and optimizer bindings (only "
                "TRAIN_STEPS may grow), or start another MODEL_DIR from it with "
                "--gin.CheckpointConfig.restore"
            )
        start = int(data_state["batches_consumed"])
        logging.info("resumed from step %d (%d batches consumed)", latest, start)
        return state, start
    state = jax.jit(fresh.init, out_shardings=state_shardings)(jax.random.PRNGKey(fresh.seed))
    if backbone_weights and backbone_weights != "random":
        loaded = loading_lib.load_backbone_params(
            backbone_weights, model.config.backbone, fresh.seed
        )
        param_checks.check_param_tree(
            state.params["backbone"], loaded, f"backbone {backbone_weights!r}"
        )
        params = dict(state.params)
        params["backbone"] = jax.tree_util.tree_map(
            _place, loaded, state_shardings.params["backbone"]
        )
        heads = loading_lib.exported_heads(backbone_weights, state.params)
        for name, value in (heads or {}).items():  # an aligner-export folder's trained heads
            params[name] = jax.tree_util.tree_map(_place, value, state_shardings.params[name])
        state = jax.jit(fresh.from_params, out_shardings=state_shardings)(params)
        what = f"backbone and heads ({', '.join(sorted(heads))})" if heads else "backbone"
        logging.info("%s initialised from %s", what, backbone_weights)
    return state, 0
