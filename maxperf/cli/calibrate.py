"""`maxperf calibrate`: this machine's devices measured (matmul rates, memory bandwidth) for CPU predictions."""

from __future__ import annotations

from maxperf.cli import supervisor
from maxperf.cli.common import print_json


def cmd_calibrate(args) -> int:
    from maxperf.profiler.calibrate import calibrate  # loads numpy, and jax as it measures

    print_json(calibrate())
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's devices for CPU predictions")
    supervisor.add_arguments(p)  # --verbose; jax's plugins write to the terminal only with it
    p.set_defaults(func=cmd_calibrate)
