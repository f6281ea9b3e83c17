"""The `maxperf` parser, made of each command module's subcommands, and the reading of a command line."""

from __future__ import annotations

import argparse
import sys

from maxperf import __version__
from maxperf.cli import calibrate, catalogs, estimate, estimate_memory, plan, report, run, sweep, xprof
from maxperf.cli import compile as compile_command
from maxperf.cli.common import print_error_document

DESCRIPTION = ("The `maxperf` command: parse, call the Python API, print. Exit codes: 0 ok, 1 failure, 2 bad input, "
               "3 no fit.")
# in the order `maxperf --help` lists them
COMMANDS = (catalogs.add_parsers, compile_command.add_parser, estimate.add_parser, estimate_memory.add_parser,
            calibrate.add_parser, run.add_parser, sweep.add_parser, report.add_parser, xprof.add_parser,
            plan.add_parser)


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), except that a usage error on a command line with --json also
    prints the error document."""

    json_words = False  # set by parse_args when the words hold --json

    def error(self, message):
        if self.json_words:
            print_error_document(f"{self.prog}: {message}", 2)
        super().error(message)


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
    return args
