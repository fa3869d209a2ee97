"""Reading the encoder parameters of an aligner-train checkpoint
(``weights.aligner_checkpoint.restore_params``): the params only, never the optimizer state."""

from __future__ import annotations

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest
from fixtures import run_python

from aligner_jax.common.errors import CheckpointError
from aligner_jax.weights import aligner_checkpoint

OPT_BYTES = 160 << 20  # an optimizer state far larger than the params

# In a child (the test process holds the arrays): RSS before and peak during restore_params of
# the second checkpoint, after one of the first.
_CHILD = """
import json, sys
from aligner_jax.weights import aligner_checkpoint
def status_kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
aligner_checkpoint.restore_params(sys.argv[1])  # warm: JAX's backend, orbax's threads
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
params, step = aligner_checkpoint.restore_params(sys.argv[2])
print(json.dumps({"step": step, "before_kib": before, "peak_kib": status_kib("VmHWM"),
                  "kernel": params["dense"]["kernel"].tolist()}))
"""


def _save(model_dir, state, step=3):
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        path = (model_dir / "checkpoints" / str(step) / "state").resolve()
        checkpointer.save(path, args=ocp.args.StandardSave(state))


def test_restore_params_reads_the_params_and_not_the_optimizer_state(tmp_path):
    """The whole train state used to be restored to keep its params: with Adam the moments are
    twice the params' bytes, all read and held while an evaluation loads a checkpoint. Here the
    optimizer state is 160 MiB and the params 48 bytes: the child's peak RSS may not rise by
    half of it."""
    kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {
        "step": np.int32(3),
        "params": {"dense": {"kernel": kernel}},
        "opt_state": {"mu": np.zeros(OPT_BYTES // 4, np.float32)},
    }
    _save(tmp_path / "run", state)
    _save(tmp_path / "warm", {**state, "opt_state": {"mu": np.zeros(4, np.float32)}})
    del state
    proc = run_python("-c", _CHILD, str(tmp_path / "warm"), str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["step"] == 3
    np.testing.assert_array_equal(np.asarray(got["kernel"], np.float32), kernel)
    rise_kib = got["peak_kib"] - got["before_kib"]
    assert rise_kib < (OPT_BYTES >> 10) // 2, f"peak RSS rose {rise_kib >> 10} MiB"


def test_restore_params_returns_numpy_arrays_and_refuses_a_state_without_params(tmp_path):
    kernel = np.ones((2, 3), np.float32)
    _save(tmp_path / "run", {"params": {"dense": {"kernel": kernel}}, "step": np.int32(3)})
    params, step = aligner_checkpoint.restore_params(tmp_path / "run")
    assert step == 3 and isinstance(params["dense"]["kernel"], np.ndarray)
    np.testing.assert_array_equal(params["dense"]["kernel"], kernel)
    _save(tmp_path / "other", {"weights": kernel})
    with pytest.raises(CheckpointError, match=r"other/checkpoints/3/state: not an aligner-train"):
        aligner_checkpoint.restore_params(tmp_path / "other")
