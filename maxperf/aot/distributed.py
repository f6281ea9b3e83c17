"""Joining a multi-process job (one process per host) through jax.distributed, for compiling and for running."""

from __future__ import annotations

import argparse
import os

from maxperf.spec.errors import MaxperfError

# what cluster schedulers set, which jax.distributed.initialize() reads by itself
_SCHEDULER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")


def _seconds(text: str) -> int:
    """--timeout's value: a whole number of seconds above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds above 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-process (one process per host)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int, help="processes in the job")
    group.add_argument("--process-id", type=int, help="this process's index, 0 to num-processes - 1")
    group.add_argument("--timeout", type=_seconds, default=60,
                       help="seconds to wait for peers: to join, for a silent peer before giving up, and at exit "
                            "(default 60)")


def initialize(args: argparse.Namespace, platform: str | None = None) -> bool:
    """Joins the job named by the flags, else one a scheduler describes in the environment; alone otherwise.
    True when it joined a job through the flags.

    --timeout bounds each of jax's waits for peers: joining, heartbeats (a peer silent this long is dead) and the
    barrier at exit. When one runs out, jax's coordination service ends the process with a C++ check failure that
    Python cannot catch: `maxperf run` turns it into one line (maxperf.cli.supervisor)."""
    import jax

    if args.num_processes is not None and args.num_processes > 1:
        if not args.coordinator or args.process_id is None:
            raise MaxperfError("--num-processes > 1 needs --coordinator HOST:PORT and --process-id I")
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MaxperfError(f"--coordinator takes HOST:PORT with a port in 1..65535 (e.g. localhost:12345), got "
                               f"{args.coordinator!r}")
        if not 0 <= args.process_id < args.num_processes:
            raise MaxperfError(f"--process-id must be in 0..{args.num_processes - 1}, got {args.process_id}")
        if args.timeout < 1:
            raise MaxperfError(f"--timeout must be >= 1 second, got {args.timeout}")
        if platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=args.timeout,
                                   heartbeat_timeout_seconds=args.timeout, shutdown_timeout_seconds=args.timeout)
        return True
    if platform != "cpu" and any(os.environ.get(v) for v in _SCHEDULER_VARIABLES if v != "TPU_WORKER_HOSTNAMES"):
        jax.distributed.initialize()
    return False


def lost_job(index: int, count: int, why: str) -> str:
    """The one line a process says when its job lost a peer; `why` is what jax reported, in parentheses."""
    return (f"process {index} of {count} lost its job{why}: another process of the job stopped or cannot be "
            "reached, so this one gives up")
