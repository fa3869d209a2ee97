"""Named sharding: logical axis names, the rules that map them to mesh axes, and mesh helpers.

Every parameter and main activation in our models carries *logical* axis names (t5x style):

  batch, length, embed, mlp, heads, kv, joined_kv, vocab, relpos_buckets, abspos_buckets,
  token_type, proj, salience

A short rule list maps logical names to the two mesh axes ``data`` and ``model``. The same model
code therefore runs on one CPU device, on 8 forced host devices and on a TPU pod; only the mesh
shape changes (``num_partitions`` = size of the ``model`` axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import gin
import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from aligner_jax.common.errors import ConfigError

DATA_AXIS = "data"
MODEL_AXIS = "model"

# (logical name, mesh axis or None). Order matters: the first rule whose mesh axis is still free
# wins (flax semantics), so activations' ``batch`` takes ``data`` and weights shard over ``model``.
STANDARD_LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA_AXIS),
    ("vocab", MODEL_AXIS),
    ("mlp", MODEL_AXIS),
    ("heads", MODEL_AXIS),
    ("joined_kv", MODEL_AXIS),
    ("kv", None),
    ("embed", None),
    ("length", None),
    ("relpos_buckets", None),
    ("abspos_buckets", None),
    ("token_type", None),
    ("proj", None),
    ("salience", None),
)


@gin.configurable
def standard_logical_axis_rules(
    additional_rules: Sequence[tuple[str, str | None]] = (),
) -> tuple[tuple[str, str | None], ...]:
    """The default rules, with ``additional_rules`` taking precedence (bind them in gin)."""
    return tuple(additional_rules) + STANDARD_LOGICAL_AXIS_RULES


@gin.configurable
def create_mesh(num_partitions: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D ``(data, model)`` mesh over all (or the given) devices.

    Args:
      num_partitions: size of the ``model`` axis (tensor parallelism); must divide the device count.
      devices: defaults to ``jax.devices()`` (all processes' devices on a multi-host job).
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_partitions < 1 or len(devices) % num_partitions:
        raise ConfigError(
            f"num_partitions={num_partitions} (--gin.train.num_partitions when training) must "
            f"divide the number of devices ({len(devices)})."
        )
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // num_partitions, num_partitions)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def logical_to_sharding(logical_spec_tree, mesh: Mesh, rules=None):
    """Maps a pytree of logical PartitionSpecs to NamedShardings on ``mesh``."""
    rules = standard_logical_axis_rules() if rules is None else rules
    return nn.logical_to_mesh_sharding(logical_spec_tree, mesh, rules)


def params_shardings(boxed_params, mesh: Mesh, rules=None):
    """NamedShardings for a (possibly ``nn.LogicallyPartitioned``-boxed) parameter tree."""
    logical_specs = nn.get_partition_spec(boxed_params)
    return logical_to_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Shards the leading (batch) dimension of an input array over ``data``."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
