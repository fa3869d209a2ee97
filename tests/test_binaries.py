"""Every binary, as a person meets it: --help (exit 0, the gin flags, copy-pasteable examples),
a working default without --gin_file, one-line errors, quiet logs (issue 13, items 5, 7, 8).

The binaries are found, not listed: the top-level modules of ``aligner_jax/`` and setup.py's
console scripts, so a new binary is covered when it is added.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shlex
import subprocess
import sys

import gin
import pytest
from fixtures import REPO, run_module, write_toy_beir

from aligner_jax.common import cli
from aligner_jax.common.errors import ConfigError

GIN_FLAGS = ("--gin_file", "--gin_bindings", "--gin_search_paths")
GINLESS = {"beir"}  # aligner-beir downloads and counts BEIR folders: no model, no gin
MODULES = sorted(
    p.stem for p in (REPO / "aligner_jax").glob("*.py") if p.stem != "__init__"
)  # fmt: skip


def console_scripts() -> dict[str, tuple[str, str]]:
    """setup.py's ``console_scripts``: ``{script: (module, function)}``."""
    text = (REPO / "setup.py").read_text()
    found = re.findall(r'"(aligner-[\w-]+)=([\w.]+):(\w+)"', text)
    assert found, "no console_scripts in setup.py"
    return {name: (module, fn) for name, module, fn in found}


SCRIPTS = console_scripts()


def _module_ast(module: str) -> ast.Module:
    path = REPO / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{module}: no such module ({path})"
    return ast.parse(path.read_text())


def _constant(module: str, name: str):
    """A module-level constant read from the source (importing two binaries into one process
    would define their flags twice)."""
    for node in _module_ast(module).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


def test_every_binary_module_has_a_console_script():
    """Each top-level module is a binary with a console script; each script's target exists."""
    targets = {module for module, _ in SCRIPTS.values()}
    assert {f"aligner_jax.{m}" for m in MODULES} <= targets
    for script, (module, fn) in SCRIPTS.items():
        defined = {n.name for n in _module_ast(module).body if isinstance(n, ast.FunctionDef)}
        assert fn in defined, f"{script}: {module} defines no {fn}()"


def _listed_flags(help_text: str) -> set[str]:
    names = set()
    for m in re.finditer(r"^\s+(?:-\w,)?--(\[no\])?(\w+):", help_text, re.M):
        names.add(m.group(2))
        if m.group(1):
            names.add("no" + m.group(2))
    return names


def _examples(help_text: str) -> list[list[str]]:
    """The example commands of the help text: a line starting with ``python -m`` (or a console
    script) and its continuation lines."""
    lines, out, i = help_text.splitlines(), [], 0
    while i < len(lines):
        if re.match(r"\s+(python -m |\.venv/bin/python |aligner-)", lines[i]):
            command = [lines[i]]
            while command[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                command.append(lines[i])
            out.append(command)
        i += 1
    return out


def check_help(name: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    listed = _listed_flags(text)
    wanted = {"verbosity", "progress"} | (
        set() if name in GINLESS else {f.lstrip("-") for f in GIN_FLAGS}
    )
    assert wanted <= listed, f"{name} --help lacks {wanted - listed}"
    assert "\\\\" not in text, f"{name} --help prints a doubled backslash"
    examples = _examples(text)
    assert examples, f"{name} --help shows no example command"
    for command in examples:
        for line in command[:-1]:  # continuations end with one backslash after a space
            assert line.endswith(" \\") and not line.endswith("\\\\ \\"), line
        assert not command[-1].endswith("\\"), command
        for nxt in command[1:]:
            assert nxt.startswith("    "), f"continuation not indented: {nxt!r}"
        argv = shlex.split(" ".join(ln.rstrip("\\") for ln in command))  # quotes balance
        if argv[:3] != ["python", "-m", f"aligner_jax.{name}"]:
            continue
        for arg in argv[3:]:
            assert arg.startswith("--"), f"{name}: {arg!r} in an example is not a flag"
            flag = arg[2:].split("=", 1)[0]
            assert flag.startswith("gin.") or flag in listed, f"{name}: example uses --{flag}"


@pytest.mark.parametrize("name", MODULES)
def test_help_of_every_binary_module(name):
    check_help(name, run_module(f"aligner_jax.{name}", "--help", timeout=120))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_of_every_console_script(script):
    """As installed: ``sys.argv[0]`` is the script and ``__main__`` is setuptools' wrapper
    (no docstring), yet --help shows the binary's text and flags."""
    module, fn = SCRIPTS[script]
    code = f"import sys; sys.argv[0] = {script!r}; from {module} import {fn}; {fn}()"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    check_help(module.rsplit(".", 1)[1], proc)


@pytest.mark.parametrize(
    "name", [m for m in MODULES if _constant(f"aligner_jax.{m}", "DEFAULT_GIN_FILES")]
)
def test_default_gin_files_configure_a_model(name):
    """A binary's default (no --gin_file) parses and names a model."""
    files = _constant(f"aligner_jax.{name}", "DEFAULT_GIN_FILES")
    cli.parse_gin(list(files))
    assert gin.query_parameter("load_encoder.config") is not None
    assert gin.query_parameter("AlignerConfig.projection") == "identity"  # zero-shot


def test_binaries_without_a_default_say_what_they_need():
    """Every binary but train/search has a default gin config; train names the missing run."""
    with_default = {m for m in MODULES if _constant(f"aligner_jax.{m}", "DEFAULT_GIN_FILES")}
    assert with_default >= {"evaluate", "index", "sweep", "explain"}
    assert _constant("aligner_jax.evaluate", "DEFAULT_GIN_FILES") == ("eval/zero_shot.gin",)
    proc = run_module("aligner_jax.train", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (last,) = proc.stderr.strip().splitlines()[-1:]
    assert last.startswith("aligner-train: error: no --gin_file: name a run, e.g. ")
    assert "--gin_file=runs/scifact_minilm.gin" in last and "Required bindings" not in last


_RUN_FILE = "add a run file, e.g. --gin_file=runs/scifact_minilm.gin"


def _unbound_calls(tmp_path):
    from aligner_jax.encoding import loading
    from aligner_jax.models.aligner_model import AlignerModel
    from aligner_jax.training import optimizers, trainer

    out = str(tmp_path / "model")
    return {
        **{
            f"{schedule}.total_steps": (
                getattr(optimizers, schedule),
                f"gin: {schedule}.total_steps is not set: add a gin file that binds it, or "
                f"--gin.{schedule}.total_steps=VALUE",
            )
            for schedule in ("warmup_linear_decay", "warmup_cosine_decay")
        },
        "load_encoder.config": (
            loading.load_encoder,
            "gin: load_encoder.config is not set: add a model file, e.g. "
            "--gin_file=models/minilm.gin, or --gin.load_encoder.config=VALUE",
        ),
        "AlignerModel.config": (
            AlignerModel,
            "gin: AlignerModel.config is not set: add a gin file that binds it, or "
            "--gin.AlignerModel.config=VALUE",
        ),
        "train.model_dir": (
            trainer.train,
            f"gin: train.model_dir is not set: {_RUN_FILE}, or --gin.train.model_dir=VALUE",
        ),
        "train.num_train_steps": (
            lambda: trainer.train(model_dir=out),
            f"gin: train.num_train_steps is not set: {_RUN_FILE}, or "
            "--gin.train.num_train_steps=VALUE",
        ),
        "train.model": (
            lambda: trainer.train(model_dir=out, num_train_steps=1),
            f"gin: train.model is not set: {_RUN_FILE}, or --gin.train.model=VALUE",
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "load_encoder.config",
        "AlignerModel.config",
        "train.model_dir",
        "train.num_train_steps",
        "train.model",
        "warmup_linear_decay.total_steps",
        "warmup_cosine_decay.total_steps",
    ],
)
def test_unbound_required_parameter_is_a_config_error_naming_what_to_add(tmp_path, name):
    """A parameter a gin file must bind, left unbound: a typed ``ConfigError`` (not gin's
    ``RuntimeError``), printed by a binary as one line; nothing written."""
    call, expected = _unbound_calls(tmp_path)[name]
    with pytest.raises(ConfigError):
        call()
    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit("aligner-train", call)
    assert exit_info.value.code == f"aligner-train: error: {expected}"
    assert not (tmp_path / "model").exists()


def test_evaluate_without_gin_file_runs_the_zero_shot_default(tmp_path):
    """The issue's command: ``python -m aligner_jax.evaluate --dataset_dir=D --output_dir=O``."""
    data = write_toy_beir(tmp_path / "data")
    out = tmp_path / "out"
    proc = run_module(
        "aligner_jax.evaluate", f"--dataset_dir={data}", f"--output_dir={out}", timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["config"]["projection"] == "identity" and metrics["config"]["search"] == "centroid"
    )
    assert metrics["metrics"]["ndcg@10"] > 0.9
    assert "no --gin_file: using the default eval/zero_shot.gin" in proc.stderr
    assert f"wrote      metrics.json, run.trec, results.json, config.gin in {out}" in proc.stdout


TRAIN_BINDINGS = {
    "TRAIN_STEPS": 20,
    "QUERY_LENGTH": 16,
    "DOC_LENGTH": 32,
    "BATCH_SIZE": 8,
    "WARMUP_STEPS": 2,
    "DataConfig.task": "'beir_train_bm25'",
    "beir_train_source.qrels_split": "'test'",
    "train.backbone_weights": "'random'",
    "CheckpointConfig.period": 3,
}


def test_twenty_step_training_prints_at_most_25_lines(tmp_path):
    """Quiet logs: no orbax/clu INFO, gin's 'Path not found', jax's TPU probe or TensorFlow's
    cuInit lines at the default verbosity; the trainer's own lines and its summary remain. Run
    without the test helpers' TF_CPP_MIN_LOG_LEVEL / JAX_PLATFORMS: the binary quiets itself."""
    data = write_toy_beir(tmp_path / "data")
    model_dir = tmp_path / "m"
    bindings = {**TRAIN_BINDINGS, "MODEL_DIR": repr(str(model_dir))}
    bindings["beir_train_source.dataset_dir"] = repr(str(data))
    proc = run_module(
        "aligner_jax.train",
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=runs/train.gin",
        *[f"--gin.{k}={v}" for k, v in bindings.items()],
        as_user=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 25, "\n".join(lines)
    text = "\n".join(lines)
    for noise in ("orbax", "checkpoint_manager", "Path not found", "cuInit", "backend 'tpu'"):
        assert noise not in text, noise
    assert "step 20/20 loss" in text  # the project's own lines stay
    assert f"checkpoint {model_dir / 'checkpoints' / '20'}" in proc.stdout
    assert re.search(r"ALIGNER training: steps 0\.\.20 of 20 in [0-9.]+s", proc.stdout)
    assert "final loss " in proc.stdout


def test_export_without_gin_file_takes_the_training_config(tmp_path):
    """``aligner-export --checkpoint=STEP_FOLDER`` with no --gin_file: the model is the one the
    MODEL_DIR's config.gin (written by aligner-train) describes; a --checkpoint folder without
    one is refused in one line naming --gin_file. (Without --checkpoint the default is the
    bundled zero-shot model: test_default_gin_files_configure_a_model.)"""
    from aligner_jax.training import trainer

    data = write_toy_beir(tmp_path / "data")
    model_dir = tmp_path / "m"
    bindings = {
        **TRAIN_BINDINGS,
        "TRAIN_STEPS": 2,
        "WARMUP_STEPS": 1,
        "QUERY_LENGTH": 8,
        "CheckpointConfig.period": 2,
        "MODEL_DIR": repr(str(model_dir)),
        "beir_train_source.dataset_dir": repr(str(data)),
    }
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"], [f"{k} = {v}" for k, v in bindings.items()]
    )
    trainer.train()
    out = tmp_path / "exported"
    step = model_dir / "checkpoints" / "2"
    proc = run_module("aligner_jax.export", f"--checkpoint={step}", f"--output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"no --gin_file: using the default {model_dir / 'config.gin'}" in proc.stderr
    recorded = json.loads((out / "aligner_config.json").read_text())
    assert (recorded["projection"], recorded["salience"], recorded["hidden_size"]) == (
        "dense",
        "lp",
        32,  # bert_tiny, as trained
    )
    assert recorded["query_maxlen"] == 8

    proc = run_module("aligner_jax.export", f"--checkpoint={data}", f"--output_dir={out}_2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"aligner-export: error: no --gin_file: --checkpoint={data} has no config.gin (written "
        "by aligner-train in MODEL_DIR): name the model file it was trained with, e.g. "
        "--gin_file=models/minilm.gin"
    )
    proc = run_module("aligner_jax.export", f"--checkpoint={data}_x", f"--output_dir={out}_3")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"aligner-export: error: no --gin_file: --checkpoint={data}_x: no such folder"
    )


def _record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("absl", level, path, 1, "message", None, None)


def test_library_logs_are_quiet_unless_verbosity_is_raised():
    """The one filter of common/cli.py: the project's records at any level, other libraries'
    from WARNING up, gin's false "Path not found" never; at --verbosity=1 everything."""
    project = str(REPO / "aligner_jax") + os.sep
    verbosity = [0]
    quiet = cli.QuietLibraries([project], verbosity=lambda: verbosity[0])
    orbax = "/venv/site-packages/orbax/checkpoint/checkpoint_manager.py"
    gin_probe = "/venv/site-packages/gin/resource_reader.py"
    assert quiet.filter(_record(str(REPO / "aligner_jax/training/trainer.py"), logging.INFO))
    assert not quiet.filter(_record(orbax, logging.INFO))
    assert quiet.filter(_record(orbax, logging.WARNING))
    assert not quiet.filter(_record(gin_probe, logging.ERROR))
    verbosity[0] = 1
    assert quiet.filter(_record(orbax, logging.INFO)) and quiet.filter(
        _record(gin_probe, logging.ERROR)
    )


def test_unset_required_macro_is_one_line_naming_the_macro(tmp_path):
    """runs/trainer.gin declares ``TRAIN_STEPS = %gin.REQUIRED``: left unset, aligner-train says
    which macro to set (it was a ``TypeError`` traceback inside the schedule)."""
    from aligner_jax.training import trainer

    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/trainer.gin"], [f"MODEL_DIR = {str(tmp_path / 'm')!r}"]
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.call_or_exit("aligner-train", trainer.train)
    assert exit_info.value.code == (
        "aligner-train: error: gin: TRAIN_STEPS (warmup_linear_decay.total_steps) is not set: "
        "add --gin.TRAIN_STEPS=VALUE"
    )
    assert not (tmp_path / "m").exists()
