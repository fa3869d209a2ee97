"""Preemption notices during training: a SIGTERM saves the step reached, then the job stops.

A scheduler announces a preemption with SIGTERM some seconds before it kills the job (TPU and GCE
spot VMs, Kubernetes, SLURM with ``--signal``). Without a watch, the step reached since the last
periodic checkpoint is lost. Under :class:`Watch`, the notice only marks the run; the trainer
finishes its step, saves a checkpoint of it, and stops as SIGTERM stops every binary (exit 143);
the same command resumes from it (t5x and orbax do the same).

* One process: the watch's own SIGTERM handler marks the run (the binary's handler, which stops
  at once, is put back when the loop ends).
* Several processes (``jax.distributed``): the processes must save the same step together, so
  the notice goes through JAX's preemption service (it listens for SIGTERM on every host and
  picks the next step every process reaches: ``multihost_utils.reached_preemption_sync_point``,
  asked through orbax's ``CheckpointManager.reached_preemption``). With the service disabled
  (``jax_enable_preemption_service=False``) a multi-process run saves nothing on a notice.
"""

from __future__ import annotations

import signal
import threading

import jax
from absl import logging


class Watch:
    """``with Watch(manager) as watch: ... if watch.reached(step): save and stop``."""

    def __init__(self, manager):
        self.manager = manager
        self.noticed = False
        self._previous = None

    def __enter__(self) -> Watch:
        self._distributed = jax.process_count() > 1
        if not self._distributed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._notice)
        return self

    def _notice(self, signum, frame) -> None:
        del signum, frame
        if not self.noticed:
            logging.warning("preemption notice (SIGTERM): saving the step being trained")
        self.noticed = True

    def reached(self, step: int) -> bool:
        """Whether to save ``step`` (just trained) and stop: on every process at the same step."""
        if self._distributed:
            self.noticed = bool(self.manager.reached_preemption(step))
        return self.noticed

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
