"""The `policylens` command: train, inspect and export runs, start the dashboard or the demo.

Each subcommand is a pair `add_<name>_command(subparsers)` / `run_<name>(args)`. Heavy imports (torch, streamlit)
happen inside the `run_` functions so that `policylens runs` starts quickly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def dashboard_command(logs_dir: str, host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The `streamlit run` command line that serves the dashboard for a logs folder (absolute, so the app finds
    it whatever its working directory)."""
    app = Path(__file__).resolve().parent.parent / "dashboard" / "streamlit_app.py"
    return [
        sys.executable, "-m", "streamlit", "run", str(app),
        "--server.address", host, "--server.port", str(port),
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--", "--logs-dir", str(Path(logs_dir).resolve()),
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    import subprocess

    command = dashboard_command(args.logs_dir, args.host, args.port)
    print(f"PolicyLens dashboard on http://{args.host}:{args.port} (logs: {command[-1]}); Ctrl+C stops it.")
    try:
        return subprocess.call(command)
    except KeyboardInterrupt:  # streamlit got the same Ctrl+C and shuts down by itself
        return 0


# ---------------------------------------------------------------- demo


def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the demo comparison in the background and serve the dashboard (the README's run command)"
    )
    _add_logs_dir(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8501)
    parser.add_argument("--fresh", action="store_true", help="delete the demo runs and train them again")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from engine import demo
    from engine.runlog import list_runs

    logs_dir = Path(args.logs_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    statuses = {run["run"]: run["status"] for run in list_runs(logs_dir)}
    demo_unfinished = any(statuses.get(run.name, "missing") != "finished" for run in demo.DEMO_RUNS)
    started = False
    if args.fresh or not statuses or (demo.demo_runs_present(logs_dir) and demo_unfinished):
        print(f"policylens: training the demo runs in the background (log: {logs_dir / '.demo' / 'demo.log'})")
        demo.start_demo(logs_dir, fresh=args.fresh)
        started = True
    try:
        return run_dashboard(args)
    except KeyboardInterrupt:
        return 0
    finally:
        if started:
            print("policylens: stopping the demo training after its current step")
            demo.stop_demo(logs_dir)


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
