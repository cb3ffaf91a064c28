"""The `policylens` command: train, inspect and export runs, start the dashboard or the demo.

Each subcommand is a pair `add_<name>_command(subparsers)` / `run_<name>(args)`. Heavy imports (torch, streamlit)
happen inside the `run_` functions so that `policylens runs` starts quickly.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_LOGS_DIR = "logs"


def _add_logs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logs-dir", default=DEFAULT_LOGS_DIR, help="folder holding the runs (default: logs)")


# ---------------------------------------------------------------- train


def add_train_command(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a policy and log every token")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    raise SystemExit("policylens train: not available yet")


# ---------------------------------------------------------------- runs / sql / export


def add_runs_command(subparsers) -> None:
    parser = subparsers.add_parser("runs", help="list the runs in the logs folder")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_runs)


def run_runs(args: argparse.Namespace) -> int:
    raise SystemExit("policylens runs: not available yet")


def add_sql_command(subparsers) -> None:
    parser = subparsers.add_parser("sql", help="query a run with SQL")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_sql)


def run_sql(args: argparse.Namespace) -> int:
    raise SystemExit("policylens sql: not available yet")


def add_export_command(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write one run into a self-contained .duckdb file")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    raise SystemExit("policylens export: not available yet")


# ---------------------------------------------------------------- dashboard


def add_dashboard_command(subparsers) -> None:
    parser = subparsers.add_parser("dashboard", help="start the dashboard (http://127.0.0.1:8501 by default)")
    _add_logs_dir(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8501)
    parser.set_defaults(func=run_dashboard)


def run_dashboard(args: argparse.Namespace) -> int:
    raise SystemExit("policylens dashboard: not available yet")


# ---------------------------------------------------------------- demo


def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="train the demo comparison in the background and open the dashboard")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    raise SystemExit("policylens demo: not available yet")


# ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policylens", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        add_train_command,
        add_runs_command,
        add_sql_command,
        add_export_command,
        add_dashboard_command,
        add_demo_command,
    ):
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
