"""The `policylens` command: train, inspect and export runs, start the dashboard or the demo.

Each subcommand is a pair `add_<name>_command(subparsers)` / `run_<name>(args)`. Heavy imports (torch, streamlit)
happen inside the `run_` functions so that `policylens runs` starts quickly. The commands live in `training.py`
(train, warmstart), `logs.py` (runs, sql, export, report), `serve.py` (dashboard, demo) and `importing.py` (import);
`common.py` holds what they share.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli.common import CONFIG_COMMANDS, DEFAULT_LOGS_DIR, passive_thread_waits
from engine.cli.importing import add_import_command
from engine.cli.logs import add_export_command, add_report_command, add_runs_command, add_sql_command
from engine.cli.serve import (
    add_dashboard_command,
    add_demo_command,
    dashboard_command,
    has_desktop,
    local_url,
    open_browser_when_up,
)
from engine.cli.training import add_train_command, add_warmstart_command

__all__ = ["DEFAULT_LOGS_DIR", "build_parser", "dashboard_command", "has_desktop", "local_url", "main",
           "open_browser_when_up"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; given `command` (the first word of the command line, the subcommand about to run),
    the config commands other than it are named without their flags (see CONFIG_COMMANDS)."""
    parser = argparse.ArgumentParser(prog="policylens", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, add_command in (
        ("train", add_train_command),
        ("warmstart", add_warmstart_command),
        ("runs", add_runs_command),
        ("sql", add_sql_command),
        ("export", add_export_command),
        ("report", add_report_command),
        ("dashboard", add_dashboard_command),
        ("demo", add_demo_command),
        ("import", add_import_command),
    ):
        if name in CONFIG_COMMANDS and command not in (None, name):
            subparsers.add_parser(name, help=CONFIG_COMMANDS[name])
        else:
            add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the subcommand: no option precedes it
    if command in CONFIG_COMMANDS:
        passive_thread_waits()  # before the parser imports torch (engine.config's flags)
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # `train --nproc` starts the same command again under torchrun
    return args.func(args) or 0

