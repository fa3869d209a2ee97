"""Preemption notices during training: a SIGTERM saves the step reached, then the job stops.

A scheduler announces a preemption with SIGTERM some seconds before it kills the job (TPU and GCE
spot VMs, Kubernetes, SLURM with its signal option). Without a watch, the step reached since the
last periodic checkpoint is lost. Under :class:`Watch`, the notice only marks the run; the trainer
finishes its step, saves a checkpoint of it, and stops as SIGTERM stops every binary (exit 143);
the same command resumes from it (t5x and orbax do the same).

* The watch's own SIGTERM handler marks the run (the binary's handler, which stops at once, is
  put back when the loop ends).
* Several processes (``jax.distributed``) must save the same step together: after every step
  they share their marks (``multihost_utils.process_allgather``, one small collective per step)
  and all stop when any was marked. (JAX's own preemption service,
  ``reached_preemption_sync_point``, never fired on the CPU processes of
  ``launch/local_processes.sh``: this watch does not rely on it.)
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils


class Watch:
    """``with Watch() as watch: ... if watch.reached(step): save and stop``."""

    def __init__(self):
        self.noticed = False
        self._previous = None

    def __enter__(self) -> Watch:
        self._distributed = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._notice)
        return self

    def _notice(self, signum, frame) -> None:
        del signum, frame
        if not self.noticed:
            logging.warning("preemption notice (SIGTERM): saving the step being trained")
        self.noticed = True

    def reached(self, step: int) -> bool:
        """Whether to save ``step`` (just trained) and stop: on every process at the same step."""
        del step  # every process asks after each of its steps, in the same order
        if self._distributed:
            marks = multihost_utils.process_allgather(np.asarray(self.noticed, np.int32))
            self.noticed = bool(np.any(marks))
        return self.noticed

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
