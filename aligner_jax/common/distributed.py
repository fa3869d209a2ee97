"""Starting a multi-process JAX job: the flags every multi-process binary takes, and one call.

A job of N processes (hosts, or several processes on one machine: ``launch/local_processes.sh``)
is joined by :func:`jax.distributed.initialize`; after it, ``jax.devices()`` lists every
process's devices, meshes span them and jitted collectives (``psum``, an all-gather) cross
processes. Two ways to say where the job's coordinator is:

  * explicitly, the same on every process but ``--process_id``::

      --coordinator_address=10.0.0.1:12345 --num_processes=2 --process_id=0   # on host 0
      --coordinator_address=10.0.0.1:12345 --num_processes=2 --process_id=1   # on host 1

  * ``--multiprocess`` alone: JAX detects the cluster (Cloud TPU pod metadata, SLURM's
    environment, Open MPI, Kubernetes), as ``launch/tpu_pod.sh`` and ``launch/slurm_gpu.sbatch`` do.

On CPU, cross-process collectives go through gloo (``jax_cpu_collectives_implementation``), set
here before the backend starts; accelerators use their own (ICI/DCN on TPU, NCCL on GPU).
"""

from __future__ import annotations

import socket
import sys

import jax
from absl import flags, logging

from aligner_jax.common.errors import ConfigError

flags.DEFINE_string(
    "coordinator_address",
    None,
    "HOST:PORT of process 0's coordinator (multi-process jobs; with --num_processes and "
    "--process_id). Without it and without --multiprocess the job is one process.",
)
flags.DEFINE_integer("num_processes", None, "Number of processes of the job (>= 1).")
flags.DEFINE_integer("process_id", None, "This process's rank, 0 .. --num_processes - 1.")
flags.DEFINE_bool(
    "multiprocess",
    False,
    "Join a multi-process job whose coordinator JAX detects (TPU pod, SLURM, MPI, Kubernetes).",
)
flags.DEFINE_integer(
    "initialization_timeout",
    300,
    "Seconds to wait for every process of a multi-process job to join before failing.",
)

FLAG_NAMES = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "multiprocess",
    "initialization_timeout",
)
PROCESS_FLAGS = ("coordinator_address", "num_processes", "process_id", "multiprocess")
CPU_COLLECTIVES = "gloo"


def declare_key_flags() -> None:
    """Makes ``--help`` of the binary being run list these flags (call at its import)."""
    for name in FLAG_NAMES:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def flags_given(*others: str) -> list[str]:
    """The process flags (these and ``others``) given on the command line, dashes included."""
    names = (*PROCESS_FLAGS, *others)
    return [f"--{name}" for name in names if flags.FLAGS[name].present]


def initialize_from_flags() -> bool:
    """:func:`initialize` with this module's flags; returns whether the job is multi-process."""
    f = flags.FLAGS
    return initialize(
        coordinator_address=f.coordinator_address,
        num_processes=f.num_processes,
        process_id=f.process_id,
        auto=f.multiprocess,
        timeout_s=f.initialization_timeout,
    )


def check_settings(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Refuses an incomplete or inconsistent explicit setting with one line naming the flag."""
    given = {
        "--coordinator_address": coordinator_address,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} not set: a multi-process job named by --coordinator_address "
            "needs all three of --coordinator_address, --num_processes and --process_id (or "
            "--multiprocess alone on a TPU pod / SLURM cluster)"
        )
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--coordinator_address={coordinator_address}: expected HOST:PORT, e.g. 127.0.0.1:12345"
        )
    if num_processes < 1:
        raise ConfigError(f"--num_processes={num_processes}: must be >= 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process_id={process_id}: must be in 0..{num_processes - 1} (--num_processes="
            f"{num_processes})"
        )


def _check_port_free(coordinator_address: str) -> None:
    """Process 0 serves the job on the address's port (on every interface, as JAX's
    coordinator binds it): refuses a port another program holds."""
    port = int(coordinator_address.rpartition(":")[2])
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"--coordinator_address={coordinator_address}: port {port} is in use on this "
                f"host ({e.strerror}); process 0 serves the job there: choose a free port"
            ) from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
    timeout_s: int = 300,
) -> bool:
    """Joins the multi-process job described by the arguments; returns whether there is one.

    Nothing is done (one process, ``False``) when no argument is given and ``auto`` is off.
    ``auto`` with no explicit setting lets JAX detect the cluster. Must run before anything
    touches a JAX backend (``jax.devices()``, a jitted call). A job that cannot be joined (the
    coordinator's port taken, no cluster detected, counts that disagree) is a ``ConfigError``;
    a peer that never comes, or dies, ends in JAX's own abort once its timeouts pass.
    """
    explicit = (coordinator_address, num_processes, process_id) != (None, None, None)
    if not explicit and not auto:
        return False
    if explicit:
        check_settings(coordinator_address, num_processes, process_id)
    if timeout_s < 1:
        raise ConfigError(f"--initialization_timeout={timeout_s}: must be >= 1 second")
    # CPU devices of different processes exchange collectives through gloo (harmless where the
    # devices are accelerators: it only configures the CPU client).
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    if explicit and process_id == 0:
        _check_port_free(coordinator_address)  # JAX crashes (SIGSEGV) on a port in use
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        )
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not explicit:
            raise ConfigError(
                f"--multiprocess: JAX found no cluster to join ({reason}); outside a TPU pod, "
                "SLURM, MPI or Kubernetes give --coordinator_address, --num_processes and "
                "--process_id"
            ) from None
        raise ConfigError(
            f"--coordinator_address={coordinator_address}: could not join the job as process "
            f"{process_id} ({reason}); process 0 serves it on that port, which must be free "
            "there and reachable from every process"
        ) from None
    if explicit and (jax.process_count(), jax.process_index()) != (num_processes, process_id):
        raise ConfigError(
            f"--num_processes={num_processes} --process_id={process_id}: the job's coordinator "
            f"counts {jax.process_count()} processes and made this one {jax.process_index()}; "
            "give every process the same --num_processes and its own --process_id"
        )
    logging.info(
        "process %d of %d; devices: %d local, %d global",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True
