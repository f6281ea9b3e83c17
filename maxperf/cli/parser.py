"""The `maxperf` parser, made of each command module's subcommands, and the reading of a command line."""

from __future__ import annotations

import argparse
import os
import sys

from maxperf import __version__
from maxperf.cli import (
    cache,
    calibrate,
    catalogs,
    estimate,
    estimate_memory,
    plan,
    report,
    run,
    supervisor,
    sweep,
    xprof,
)
from maxperf.cli import compile as compile_command
from maxperf.cli.common import print_error_document
from maxperf.spec import maxtext_line, presets
from maxperf.spec.errors import MaxperfError

DESCRIPTION = ("The `maxperf` command: parse, call the Python API, print. Exit codes: 0 ok, 1 failure, 2 bad input, "
               "3 no fit.")
# in the order `maxperf --help` lists them
COMMANDS = (catalogs.add_parsers, compile_command.add_parser, estimate.add_parser, estimate_memory.add_parser,
            calibrate.add_parser, run.add_parser, sweep.add_parser, report.add_parser, xprof.add_parser,
            plan.add_parser, cache.add_parser)


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), except that a usage error on a command line with --json also
    prints the error document."""

    json_words = False  # set by parse_args when the words hold --json

    def error(self, message):
        if self.json_words:
            print_error_document(f"{self.prog}: {message}", 2)
        super().error(message)

    def word_error(self, message):
        """A mistake in the key=value words' content (not the command line's shape): one line, exit 2, no usage."""
        if self.json_words:
            print_error_document(f"{self.prog}: {message}", 2)
        self.exit(2, f"maxperf: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="maxperf", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"maxperf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command's options and its key=value words in any order (`estimate a=1 --json b=2`): the command's own
    parser reads its arguments intermixed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if not argv or argv[0] not in commands:  # no command, -h, --version, or a mistake: the top parser says
        return parser.parse_args(argv)
    command = commands[argv[0]]
    command.json_words = "--json" in argv[1:]
    args = command.parse_intermixed_args(argv[1:])
    args.command = argv[0]
    if getattr(args, "request_words", False):
        read_maxtext_words(command, args)
    return args


def read_maxtext_words(command: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A MaxText command line's words (spec.maxtext_line) into --topology, --model and --num-slices, the words with
    no effect on the step named once on stderr; a clash with the options, or a topology or model named nowhere, is a
    usage error."""
    try:
        line = maxtext_line.read(args.overrides)
    except MaxperfError as e:
        command.word_error(str(e))
    for option, value, theirs in (("topology", line.topology, f"{maxtext_line.TOPOLOGY_KEY}={line.topology}"),
                                  ("num_slices", line.num_slices, line.slices_word)):
        mine = getattr(args, option)
        if value is not None and mine is not None and mine != value:
            command.word_error(f"--{option.replace('_', '-')} {mine} and {theirs} disagree: give one")
        if value is not None:
            setattr(args, option, value)
    if line.model is not None:
        if args.model is not None and presets.canonical(args.model) != line.model:
            command.word_error(f"--model {args.model} and {line.model_word} disagree: give one")
        args.model = line.model
    if args.num_slices is None:
        args.num_slices = 1
    if args.topology is None:
        command.error("the following arguments are required: --topology (or MaxText's compile_topology=)")
    if args.model is None and args.model_required:
        command.error("the following arguments are required: --model (or MaxText's model_name=)")
    if line.decoder_block is not None:
        try:
            maxtext_line.check_decoder_block(line.decoder_block, presets.canonical(args.model or ""))
        except MaxperfError as e:
            command.word_error(str(e))
    args.overrides = list(line.overrides)
    if line.config_file and supervisor.CHILD not in os.environ:
        print(f"maxperf: note: {line.config_file}: MaxText's defaults where maxperf's differ, before the line's own "
              f"words ({' '.join(maxtext_line.BASE_YML_DEFAULTS)})", file=sys.stderr)
    if line.ignored and supervisor.CHILD not in os.environ:  # said once: by the process the user started
        print(f"maxperf: note: MaxText's {', '.join(line.ignored)} change nothing of the step: ignored",
              file=sys.stderr)
    if line.layouts and supervisor.CHILD not in os.environ:
        print(f"maxperf: note: MaxText's {', '.join(line.layouts)} lay the weights out over fsdp and fsdp_transpose by "
              "rules of their own; maxperf lays them out by its rules, the same bytes per device, each weight gathered "
              "whole before its matmuls either way: not reproduced", file=sys.stderr)
    if line.untuned and supervisor.CHILD not in os.environ:
        print(f"maxperf: note: MaxText's {', '.join(line.untuned)} tune its own kernels and collectives; maxperf "
              "compiles jax's kernels and XLA's collectives as they come: not reproduced", file=sys.stderr)
