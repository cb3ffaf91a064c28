"""`policylens runs`, `sql`, `export` and `report`: reading runs.

These read runs through engine.runlog.RunReader: an in-memory DuckDB with views over the run's Parquet files,
so they work while a run trains and never write into a run folder. Bad input exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.common import add_logs_dir, fail, warn_problems


def _format_cell(value) -> str:
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format_cell(v) for v in value) + "]"
    if value is None or (isinstance(value, float) and value != value):
        return "NULL"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= 80 else text[:77] + "..."


def _print_rows(columns: list[str], rows: list, max_rows: int = 0) -> None:
    """Print a result as a plain text table (NULL for missing values), at most `max_rows` rows if > 0."""
    shown = rows if max_rows <= 0 else rows[:max_rows]
    cells = [[_format_cell(v) for v in row] for row in shown]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in shown) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    print(line(list(columns)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row).rstrip())
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more rows (use --max-rows 0 to show all)")
    print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def add_runs_command(subparsers) -> None:
    parser = subparsers.add_parser("runs", help="list the runs in the logs folder")
    add_logs_dir(parser)
    parser.set_defaults(func=run_runs)


def run_runs(args: argparse.Namespace) -> int:
    from engine.runlog import RunLogError, RunReader

    try:
        with RunReader(args.logs_dir, tables=("steps",)) as reader:  # the overview reads no token file
            columns, rows = reader.runs_overview(as_rows=True)
            warn_problems("runs", reader.problems, set())
    except RunLogError as err:
        return fail("runs", err)
    if not rows:
        print(f"no runs in {args.logs_dir} (start one with `policylens train` or `policylens demo`)")
        return 0
    headers = {"run": "name", "algorithm": "algorithm", "task": "task", "status": "status", "steps_logged": "steps",
               "heldout_accuracy": "held-out acc", "heldout_step": "at step"}
    picks = [columns.index(name) for name in headers]
    _print_rows(list(headers.values()), [[row[i] for i in picks] for row in rows])
    return 0


def add_sql_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "sql",
        help="query a run with SQL (tables: runs, steps, rollouts, tokens, token_passes, prm_steps, ref_tokens)",
        description="Run one SQL query on a run's tables, or, without a query, read statements ending in ';' "
        "from an interactive prompt (or from stdin). The tables hold this run only. Read-only: SELECT (WITH, "
        "DESCRIBE, SHOW, SUMMARIZE) and EXPLAIN SELECT, reading no file but the run's; --unsafe for a full shell.",
    )
    add_logs_dir(parser)
    parser.add_argument("run", help="run name (see `policylens runs`)")
    parser.add_argument("query", nargs="?", help='e.g. "SELECT step, reward_mean FROM steps ORDER BY step"')
    parser.add_argument("--max-rows", type=int, default=1000, help="rows to print at most (0: all; default 1000)")
    parser.add_argument("--unsafe", action="store_true",
                        help="a full DuckDB shell: any statement, any file (COPY, ATTACH, read_csv, INSTALL ...)")
    parser.set_defaults(func=run_sql)


def run_sql(args: argparse.Namespace) -> int:
    from engine.runlog import RunLogError, RunReader

    try:
        reader = RunReader(args.logs_dir, runs=[args.run], unsafe=args.unsafe)
    except RunLogError as err:
        return fail("sql", err)
    shown: set[str] = set()
    warn_problems("sql", reader.problems, shown)
    try:
        if args.query is not None:
            failed = _run_statement(reader, args.query, args.max_rows, "policylens sql: error:")
            warn_problems("sql", reader.problems, shown)
            return 2 if failed else 0
        return _sql_prompt(reader, args.run, args.max_rows, shown)
    finally:
        reader.close()


def _run_statement(reader, statement: str, max_rows: int, error_prefix: str) -> bool:
    """Print the statement's result; on a refused or failed statement print the error. True if it failed."""
    import duckdb

    from engine.runlog import RunLogError

    try:
        _print_rows(*reader.rows(statement), max_rows=max_rows)
    except (duckdb.Error, RunLogError) as err:
        print(f"{error_prefix} {err}", file=sys.stderr)
        return True
    return False


def _sql_prompt(reader, run: str, max_rows: int, shown: set[str]) -> int:
    """A small SQL prompt: statements end with ';'. Reads stdin without a prompt when it is not a terminal
    (then exits with 2 if a statement failed, so scripts notice)."""
    import contextlib

    from engine.runlog import ALL_TABLES

    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"policylens sql: run {run!r}. Tables: {', '.join(ALL_TABLES)}.")
        print("End statements with ';'.  .tables lists tables, .schema TABLE shows columns, .quit leaves.")
    failed = False
    buffer: list[str] = []
    while True:
        if interactive:
            try:
                line = input("...> " if buffer else "sql> ")
            except EOFError:
                print()
                break
            except KeyboardInterrupt:  # Ctrl-C drops the statement being typed, as in most shells
                print()
                buffer = []
                continue
        else:
            line = sys.stdin.readline()
            if not line:
                break
        stripped = line.strip()
        if not buffer and stripped.startswith("."):
            command, _, table = stripped.partition(" ")
            if command in (".quit", ".exit"):
                break
            if command == ".tables":
                print("  ".join(ALL_TABLES))
                continue
            if command != ".schema":
                print(f"unknown command {command}: try .tables, .schema TABLE or .quit", file=sys.stderr)
                failed = True
                continue
            stripped = f"DESCRIBE {table.strip() or 'tokens'};"
        if stripped:
            buffer.append(stripped)
        if buffer and buffer[-1].endswith(";"):
            statement, buffer = "\n".join(buffer), []
            failed = _run_statement(reader, statement, max_rows, "error:") or failed
            warn_problems("sql", reader.problems, shown)
    if buffer:
        print("policylens sql: ignored an unfinished statement (no ';')", file=sys.stderr)
        failed = True
    return 2 if failed and not interactive else 0


def add_export_command(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write one run into a self-contained .duckdb file")
    add_logs_dir(parser)
    parser.add_argument("run", help="run name (see `policylens runs`)")
    parser.add_argument("file", help="the DuckDB file to write, e.g. my-run.duckdb")
    parser.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    import duckdb

    from engine.runlog import RunLogError, RunReader

    target = Path(args.file)
    if target.is_dir():
        return fail("export", f"{target} is a folder; give a file name such as {args.run}.duckdb")
    if not target.parent.is_dir():
        return fail("export", f"folder {target.parent} does not exist")
    try:
        with RunReader(args.logs_dir, runs=[args.run]) as reader:
            reader.export(target, overwrite=args.overwrite)
            _, [(steps, tokens)] = reader.rows("SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM tokens)")
            warn_problems("export", reader.problems, set())
    except RunLogError as err:
        hint = "; pass --overwrite to replace it" if target.exists() and not args.overwrite else ""
        return fail("export", f"{err}{hint}")
    except (duckdb.Error, OSError) as err:
        return fail("export", err)
    print(f"exported run {args.run!r} ({steps} steps, {tokens} token rows) to {target}")
    return 0



def add_report_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write one run into a self-contained HTML file to send (no server, no network)",
        description="One HTML file with the run's config, curves, one step's groups, one rollout token by token and "
        "the step's clipping summary; it opens in any browser without Python, a server or a network.",
    )
    add_logs_dir(parser)
    parser.add_argument("run", help="run name (see `policylens runs`)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="the HTML file to write, e.g. run.html (replaced if it exists)")
    parser.add_argument("--step", type=int, help="the step to show (default: the run's last step)")
    parser.add_argument("--rollout", type=int, metavar="ID",
                        help="the rollout shown token by token (default: the step's trained rollout with the "
                        "largest |advantage|)")
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    import duckdb

    from dashboard.report import ReportError, build_report, write_report
    from engine.runlog import RunLogError, validate_run_name

    if not Path(args.logs_dir).is_dir():
        return fail("report", f"no logs folder {args.logs_dir}")
    try:
        validate_run_name(args.run, args.logs_dir)
        text = build_report(args.logs_dir, args.run, args.step, args.rollout)
        size = write_report(text, args.output)
    except (ReportError, RunLogError, duckdb.Error, OSError) as err:
        return fail("report", err)
    print(f"wrote the report of run {args.run!r} to {args.output} ({size / 1e6:.1f} MB)")
    return 0


