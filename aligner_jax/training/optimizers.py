"""Optimizers and learning-rate schedules chosen in gin (optax), as ``gin/runs/trainer.gin``
binds them::

    train.optimizer_fn = @create_optimizer
    create_optimizer.name = 'adamw'            # adamw | adam | adafactor | sgd
    train.learning_rate = @warmup_linear_decay()
    warmup_linear_decay.peak_value = %LEARNING_RATE
    warmup_linear_decay.warmup_steps = %WARMUP_STEPS
    warmup_linear_decay.total_steps = %TRAIN_STEPS

The trainer passes ``train.learning_rate`` to ``create_optimizer`` (a binding of
``create_optimizer.learning_rate`` is refused: it would be replaced).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import gin
import optax

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "adafactor", "sgd")
_CONFIGURABLES = (
    "create_optimizer",
    "constant_schedule",
    "warmup_linear_decay",
    "warmup_cosine_decay",
)


@gin.configurable
def constant_schedule(value: float = 1e-4) -> optax.Schedule:
    return optax.constant_schedule(value)


def _linear_decay(peak_value, warmup_steps, total_steps, end_value) -> optax.Schedule:
    if total_steps <= warmup_steps:
        raise ConfigError(
            f"warmup_linear_decay: total_steps={total_steps} must exceed warmup_steps="
            f"{warmup_steps} (with the run gins: --gin.TRAIN_STEPS > --gin.WARMUP_STEPS)"
        )
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak_value, warmup_steps),
            optax.linear_schedule(peak_value, end_value, total_steps - warmup_steps),
        ],
        [warmup_steps],
    )


def _cosine_decay(peak_value, warmup_steps, total_steps, end_value) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak_value, warmup_steps, total_steps, end_value)


def _warmup_schedule(name: str, decay: Callable[..., optax.Schedule], shape: str):
    """The gin configurable ``name``: linear warm-up, then ``decay`` (one signature for all)."""

    def schedule(
        peak_value: float = 1e-4,
        warmup_steps: int = 100,
        total_steps: int | None = None,
        end_value: float = 0.0,
    ) -> optax.Schedule:
        checks.required(f"{name}.total_steps", total_steps)
        checks.number(f"{name}.peak_value", peak_value, low=0.0)
        checks.integer(f"{name}.warmup_steps", warmup_steps, minimum=0)
        checks.integer(f"{name}.total_steps", total_steps, minimum=1)
        checks.number(f"{name}.end_value", end_value, low=0.0)
        return decay(peak_value, warmup_steps, total_steps, end_value)

    schedule.__name__ = schedule.__qualname__ = name
    schedule.__doc__ = (
        f"Linear warm-up to ``peak_value`` then {shape} decay to ``end_value`` at ``total_steps``."
    )
    return gin.configurable(name)(schedule)


warmup_linear_decay = _warmup_schedule("warmup_linear_decay", _linear_decay, "linear")
warmup_cosine_decay = _warmup_schedule("warmup_cosine_decay", _cosine_decay, "cosine")


@gin.configurable
def create_optimizer(
    name: str = "adamw",
    learning_rate: float | optax.Schedule = 1e-4,
    weight_decay: float = 0.01,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
) -> optax.GradientTransformation:
    """An optax optimizer (with optional global-norm clipping) named in gin."""
    checks.number("create_optimizer.weight_decay", weight_decay, low=0.0)
    checks.number("create_optimizer.clip_norm", clip_norm, low=0.0, low_open=True, allow_none=True)
    checks.number("create_optimizer.b1", b1, 0.0, 1.0)
    checks.number("create_optimizer.b2", b2, 0.0, 1.0)
    if name == "adamw":
        opt = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    elif name == "adam":
        opt = optax.adam(learning_rate, b1=b1, b2=b2)
    elif name == "adafactor":
        opt = optax.adafactor(learning_rate)
    elif name == "sgd":
        opt = optax.sgd(learning_rate, momentum=b1)
    else:
        raise ConfigError(f"create_optimizer.name={name!r}: choose one of {OPTIMIZERS}")
    if clip_norm:
        opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
    return opt


def learning_rate_at(learning_rate: float | optax.Schedule, step: int) -> float:
    return float(learning_rate(step)) if callable(learning_rate) else float(learning_rate)


def identity(learning_rate) -> dict:
    """What a resumed run must share with its checkpoint: the gin bindings of the optimizer and
    the schedules (``total_steps`` aside: raising TRAIN_STEPS goes on training) and a constant
    learning rate; values as JSON keeps them."""
    out = {}
    for name in _CONFIGURABLES:
        bound = dict(gin.get_bindings(name))
        bound.pop("total_steps", None)
        if bound:
            out[name] = bound
    if not callable(learning_rate):
        out["learning_rate"] = float(learning_rate)
    return json.loads(json.dumps(out, sort_keys=True, default=repr))
