"""`maxperf report`: one self-contained HTML page (and its CSV tables) from compile, run, sweep and plan
directories."""

from __future__ import annotations

import sys

from maxperf.reports.render import render  # jinja2 and matplotlib load when it renders


def cmd_report(args) -> int:
    result = render(args.paths, args.out, command=sys.argv)
    print(f"wrote {result.html_path} ({result.sections} sections) and {len(result.csv_paths)} CSV tables")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="an HTML report from compile, run, sweep and plan directories")
    p.add_argument("paths", nargs="+", help="compile, run, sweep or plan directories")
    p.add_argument("-o", "--out", required=True, help="the HTML file to write")
    p.set_defaults(func=cmd_report)
