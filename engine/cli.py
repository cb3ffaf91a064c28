"""The `policylens` command: train, inspect and export runs, start the dashboard or the demo.

Each subcommand is a pair `add_<name>_command(subparsers)` / `run_<name>(args)`. Heavy imports (torch, streamlit)
happen inside the `run_` functions so that `policylens runs` starts quickly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

DEFAULT_LOGS_DIR = "logs"


def _add_logs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logs-dir", default=DEFAULT_LOGS_DIR, help="folder holding the runs (default: logs)")


# ---------------------------------------------------------------- train


TRAIN_EXAMPLES = """examples:
  policylens train --algo dapo --task linear --steps 200 --run-name dapo-linear
  policylens train --algo grpo --supervision process --run-name grpo-prm
  policylens train --config my.json --eps-high 0.3 --run-name custom     (file, then flags)
  policylens train --resume dapo-linear --steps 300                      (continue, same step numbering)
  policylens train --nproc 2 --algo dapo --run-name dapo-2               (2 data-parallel processes, torchrun)
  torchrun --nproc_per_node 2 -m engine.cli train --algo dapo --run-name dapo-2              (the same, by hand)
"""

# Fields that may change when a run is resumed; the rest of the saved config is the run's identity.
RESUME_OVERRIDABLE = ("steps", "eval_every", "checkpoint_every", "device", "log_tokens")


def add_train_command(subparsers) -> None:
    from engine.config import add_config_arguments

    parser = subparsers.add_parser(
        "train", help=CONFIG_COMMANDS["train"], epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a tiny policy with GRPO, DAPO, GSPO, ASPO ... and log every token of every step. "
        "Every config field is a flag; unset flags come from --config, then the algorithm preset.",
    )
    _add_logs_dir(parser)
    parser.add_argument("--run-name", help="name of the new run (default: <algo>-<task>-<date>-<time>)")
    parser.add_argument("--config", metavar="FILE", help="JSON config file (field: value); flags override it")
    parser.add_argument("--resume", metavar="NAME", help="continue the run NAME from its last checkpoint")
    parser.add_argument("--cache-dir", help="where warm-started models are cached (default: <logs-dir>/.cache)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the model is tiny, and on a busy 2-core machine two "
                        "threads run far slower than one; 0 = torch's choice)")
    parser.add_argument("--warm-start-threads", type=int, default=None,
                        help="torch CPU threads while the warm start trains, when it is not cached yet (default: "
                        "--threads; 0: one per core, at most 4)")
    parser.add_argument("--warm-start-progress", metavar="FILE",
                        help="keep {step, steps, loss} of the warm start's SFT in this JSON file while it trains")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="train data-parallel on N processes on this machine (starts torchrun; the batch size "
                        "is global, split over the processes in whole groups)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    add_config_arguments(parser)
    parser.set_defaults(func=run_train)


def _check_local_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with the thread counts and paths train/warmstart were given (None: nothing), so that bad
    input fails at once instead of after the warm start."""
    for flag in ("threads", "warm_start_threads"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            return f"--{flag.replace('_', '-')} must be >= 0 (0: automatic), got {value}"
    for flag in ("logs_dir", "cache_dir"):
        value = getattr(args, flag, None)
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            return f"--{flag.replace('_', '-')} {value} is a file, not a folder"
    for flag in ("warm_start_progress", "progress_file"):
        value = getattr(args, flag, None)
        if value is not None and (not Path(value).name or not Path(value).resolve().parent.is_dir()):
            return f"--{flag.replace('_', '-')} {value!r}: give a file in an existing folder"
    return None


def _passive_thread_waits() -> None:
    """Let torch's OpenMP threads sleep while they wait, instead of spinning (unless OMP_WAIT_POLICY is set): with
    one core kept busy by another process, spinning threads made the warm start's SFT about 10x slower. OpenMP
    reads this once, when torch loads it, so it is set before anything imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_train(args: argparse.Namespace) -> int:
    import json

    from engine.config import ConfigError, TrainConfig, config_from_args, knob_fields
    from engine.runlog.layout import RUN_JSON, RunInfo, RunLogError, validate_run_name

    if (problem := _check_local_paths(args)) is not None:
        return _fail("train", problem)
    try:
        # Names are checked before anything is read or trained: '' is an error, not "no name given", and a name
        # can never lead outside the logs folder.
        if args.resume is not None:
            validate_run_name(args.resume, args.logs_dir)
            if args.run_name is not None and args.run_name != args.resume:
                return _fail("train", f"--run-name {args.run_name!r} with --resume {args.resume!r}: a resumed run "
                             "keeps its name")
        elif args.run_name is not None:
            validate_run_name(args.run_name, args.logs_dir)
    except RunLogError as err:
        return _fail("train", err)
    try:
        if args.resume is not None:
            run_dir = Path(args.logs_dir) / args.resume
            if not (run_dir / RUN_JSON).is_file():
                return _fail("train", f"no run {args.resume!r} in {args.logs_dir} (no {RUN_JSON})")
            try:
                saved = RunInfo.read(run_dir).train_config()
            except RunLogError as err:
                return _fail("train", f"cannot resume {args.resume!r}: {RUN_JSON} is unreadable ({err})")
            given = {f.name: getattr(args, f.name) for f in knob_fields() if getattr(args, f.name) is not None}
            fixed = sorted(k for k in given if k not in RESUME_OVERRIDABLE and given[k] != saved.get(k))
            if fixed or args.config:
                return _fail("train", f"--resume continues the saved config; only {', '.join(RESUME_OVERRIDABLE)} "
                             f"may change (got {', '.join(fixed) or '--config'})")
            cfg = TrainConfig.from_dict(saved, **given)
            name = args.resume
        else:
            cfg = config_from_args(args)
            name = args.run_name if args.run_name is not None else (
                f"{cfg.algo}-{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    except ConfigError as err:
        return _fail("train", err)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from engine.distributed import check_world, launched_by_torchrun, world_size_from_env

    under_torchrun = launched_by_torchrun()
    nproc = args.nproc if args.nproc is not None else world_size_from_env()
    try:
        check_world(cfg, nproc)
    except ConfigError as err:
        return _fail("train", err)
    if under_torchrun and args.nproc is not None and args.nproc != world_size_from_env():
        return _fail("train", f"--nproc {args.nproc} under torchrun, which started {world_size_from_env()} "
                     "processes: leave --nproc out (torchrun's --nproc_per_node sets it)")
    if under_torchrun and world_size_from_env() > 1 and args.resume is None and args.run_name is None:
        return _fail("train", "name the run (--run-name) when starting it with torchrun: every process must log "
                     "into the same run")
    if nproc > 1 and not under_torchrun:
        return _launch_torchrun(args, nproc, name)

    from engine.rollout import DynamicSamplingError
    from engine.train import train

    try:  # train() checks the run's name and folder before the warm start
        status = train(cfg, name, args.logs_dir, resume=args.resume is not None, cache_dir=args.cache_dir,
                       progress=not args.no_progress, num_threads=args.threads or None,
                       warm_start_threads=args.warm_start_threads, warm_start_progress=args.warm_start_progress)
    except (RunLogError, DynamicSamplingError, FileNotFoundError, ValueError) as err:
        return _fail("train", err)
    except KeyboardInterrupt:
        print(f"policylens train: aborted; run {name!r} marked stopped", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # once, not once per torchrun process
        print(f"run {name!r} {status}: {Path(args.logs_dir) / name}")
    return 0


def _launch_torchrun(args: argparse.Namespace, nproc: int, name: str) -> int:
    """`policylens train --nproc N ...`: the same command on N processes started by torchrun on this machine, the
    run's name fixed here so that every process logs into the same run."""
    import subprocess

    from engine.distributed import torchrun_command

    train_args = _without_nproc(args.argv[args.argv.index("train") + 1 :])
    if args.resume is None and args.run_name is None:
        train_args += ["--run-name", name]
    launcher = subprocess.Popen(torchrun_command(nproc, train_args))
    # SIGTERM to this process reaches torchrun, which stops its processes (instead of leaving them orphaned)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: launcher.terminate())
    try:
        while True:
            try:
                code = launcher.wait()
                break
            except KeyboardInterrupt:  # torchrun got Ctrl-C too and stops its processes: wait for it
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code:
        _mark_crashed(args.logs_dir, name)
        print(f"policylens train: torchrun exited with code {code}; run {name!r}: "
              f"{_run_status(args.logs_dir, name)}", file=sys.stderr)
    return code


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _mark_crashed(logs_dir: str, name: str) -> None:
    """After torchrun failed: a run.json still saying `running` (rank 0 was killed before it could record
    anything) says `crashed`. Nothing happens when the run does not exist or a writer still holds it."""
    from engine.runlog import RunInfo, RunLogError, RunWriter

    try:
        if RunInfo.read(Path(logs_dir) / name).status == "running":
            RunWriter.resume(logs_dir, name, background=False).close("crashed")  # fails while a writer holds it
    except (RunLogError, OSError, ValueError):
        pass


def _run_status(logs_dir: str, name: str) -> str:
    from engine.runlog import list_runs

    return next((r["status"] for r in list_runs(logs_dir) if r["run"] == name), "not created")


def add_warmstart_command(subparsers) -> None:
    from engine.config import add_config_arguments

    parser = subparsers.add_parser(
        "warmstart", help=CONFIG_COMMANDS["warmstart"],
        description="Supervised warm start of the built-in model, cached in the cache folder so that every "
        "`policylens train` with the same task, seed, model and SFT settings starts at once. Takes the same config "
        "flags as train; prints the held-out greedy accuracy of the warm start.",
    )
    _add_logs_dir(parser)
    parser.add_argument("--cache-dir", help="where warm-started models are cached (default: <logs-dir>/.cache)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: one per core, at most 4, as the model is tiny; run it "
                        "when nothing else trains)")
    parser.add_argument("--progress-file", metavar="FILE",
                        help="keep {step, steps, loss} of the SFT in this JSON file (the demo's progress bar)")
    add_config_arguments(parser)
    parser.set_defaults(func=run_warmstart)


def run_warmstart(args: argparse.Namespace) -> int:
    from engine.config import ConfigError, config_from_args

    if (problem := _check_local_paths(args)) is not None:
        return _fail("warmstart", problem)
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        return _fail("warmstart", err)
    if cfg.model is not None:
        return _fail("warmstart", f"--model {cfg.model} is used as it is; only the built-in model has a warm start")

    from engine.policy import greedy_accuracy, sft_progress_reporter
    from engine.tasks import get_task
    from engine.train import load_models, resolve_device

    task = get_task(cfg.task, seed=cfg.task_seed)
    cache_dir = args.cache_dir or Path(args.logs_dir) / ".cache"
    model, _, tokenizer, desc = load_models(cfg, task, resolve_device(cfg.device), cache_dir, sft_threads=args.threads,
                                            progress=sft_progress_reporter(args.progress_file))
    problems = list(task.heldout[: cfg.eval_size])
    accuracy = greedy_accuracy(model, tokenizer, task, problems, cfg.max_new_tokens)
    print(desc)
    print(f"held-out greedy accuracy {accuracy:.1%} on {len(problems)} prompts")
    return 0


# ---------------------------------------------------------------- runs / sql / export
# These read runs through engine.runlog.RunReader: an in-memory DuckDB with views over the run's Parquet files,
# so they work while a run trains and never write into a run folder. Bad input exits with code 2.


def _fail(command: str, message: object) -> int:
    print(f"policylens {command}: error: {message}", file=sys.stderr)
    return 2


def _warn_problems(command: str, problems: list[str], shown: set[str]) -> None:
    """Print each file or run the reader left out once (a query can find more: a damaged data page)."""
    for problem in problems:
        if problem not in shown:
            shown.add(problem)
            print(f"policylens {command}: warning: {problem}", file=sys.stderr)


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
    _add_logs_dir(parser)
    parser.set_defaults(func=run_runs)


def run_runs(args: argparse.Namespace) -> int:
    from engine.runlog import RunLogError, RunReader

    try:
        with RunReader(args.logs_dir, tables=("steps",)) as reader:  # the overview reads no token file
            columns, rows = reader.runs_overview(as_rows=True)
            _warn_problems("runs", reader.problems, set())
    except RunLogError as err:
        return _fail("runs", err)
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
    _add_logs_dir(parser)
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
        return _fail("sql", err)
    shown: set[str] = set()
    _warn_problems("sql", reader.problems, shown)
    try:
        if args.query is not None:
            failed = _run_statement(reader, args.query, args.max_rows, "policylens sql: error:")
            _warn_problems("sql", reader.problems, shown)
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
            _warn_problems("sql", reader.problems, shown)
    if buffer:
        print("policylens sql: ignored an unfinished statement (no ';')", file=sys.stderr)
        failed = True
    return 2 if failed and not interactive else 0


def add_export_command(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write one run into a self-contained .duckdb file")
    _add_logs_dir(parser)
    parser.add_argument("run", help="run name (see `policylens runs`)")
    parser.add_argument("file", help="the DuckDB file to write, e.g. my-run.duckdb")
    parser.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    import duckdb

    from engine.runlog import RunLogError, RunReader

    target = Path(args.file)
    if target.is_dir():
        return _fail("export", f"{target} is a folder; give a file name such as {args.run}.duckdb")
    if not target.parent.is_dir():
        return _fail("export", f"folder {target.parent} does not exist")
    try:
        with RunReader(args.logs_dir, runs=[args.run]) as reader:
            reader.export(target, overwrite=args.overwrite)
            _, [(steps, tokens)] = reader.rows("SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM tokens)")
            _warn_problems("export", reader.problems, set())
    except RunLogError as err:
        hint = "; pass --overwrite to replace it" if target.exists() and not args.overwrite else ""
        return _fail("export", f"{err}{hint}")
    except (duckdb.Error, OSError) as err:
        return _fail("export", err)
    print(f"exported run {args.run!r} ({steps} steps, {tokens} token rows) to {target}")
    return 0


# ---------------------------------------------------------------- report


def add_report_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="write one run into a self-contained HTML file to send (no server, no network)",
        description="One HTML file with the run's config, curves, one step's groups, one rollout token by token and "
        "the step's clipping summary; it opens in any browser without Python, a server or a network.",
    )
    _add_logs_dir(parser)
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
        return _fail("report", f"no logs folder {args.logs_dir}")
    try:
        validate_run_name(args.run, args.logs_dir)
        text = build_report(args.logs_dir, args.run, args.step, args.rollout)
        size = write_report(text, args.output)
    except (ReportError, RunLogError, duckdb.Error, OSError) as err:
        return _fail("report", err)
    print(f"wrote the report of run {args.run!r} to {args.output} ({size / 1e6:.1f} MB)")
    return 0


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
        "--client.toolbarMode", "minimal",  # no "Deploy" button: this is a local tool
        # No full garbage collection after every rerun (Streamlit's default): with torch and pandas loaded it held
        # the interpreter for ~60 ms while the rerun's last messages waited to be sent. No watching of the app's
        # source files for edits: nobody edits them while looking at runs.
        "--runner.postScriptGC", "false", "--server.fileWatcherType", "none",
        "--", "--logs-dir", str(Path(logs_dir).resolve()),
    ]


def run_dashboard(args: argparse.Namespace) -> int:
    import signal
    import subprocess

    command = dashboard_command(args.logs_dir, args.host, args.port)
    print(f"PolicyLens dashboard on http://{args.host}:{args.port} (logs: {command[-1]}); Ctrl+C stops it.")
    server = subprocess.Popen(command)
    # A SIGTERM to this process must not orphan the server (it would keep the port): pass it on.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: server.terminate())
    try:
        return server.wait()
    except KeyboardInterrupt:  # the server got the same Ctrl+C from the terminal and shuts down by itself
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.terminate()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


# ---------------------------------------------------------------- demo


def add_demo_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the demo comparison in the background and serve the dashboard (the README's run command)"
    )
    _add_logs_dir(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8501)
    parser.add_argument("--fresh", action="store_true", help="delete the demo runs and train them again")
    parser.add_argument("--no-browser", action="store_true",
                        help="do not open the dashboard in a browser (it is opened only on a desktop)")
    parser.set_defaults(func=run_demo)


def has_desktop(environ=None, platform: str | None = None) -> bool:
    """Whether a browser window can be opened: macOS and Windows always, elsewhere only under X11 or Wayland (on a
    server `webbrowser` would start a text browser in the terminal instead)."""
    environ = os.environ if environ is None else environ
    platform = platform or sys.platform
    return platform in ("darwin", "win32") or bool(environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY"))


def local_url(host: str, port: int) -> str:
    """The address a browser on this machine uses for a server listening on `host` (all interfaces: loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def open_browser_when_up(url: str, timeout: float = 60.0) -> threading.Thread:
    """Open `url` in the desktop's browser as soon as the server answers there (in a background thread)."""
    import urllib.request
    import webbrowser

    def wait_then_open() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2):
                    webbrowser.open(url)
                    return
            except OSError:
                time.sleep(0.5)

    thread = threading.Thread(target=wait_then_open, daemon=True)
    thread.start()
    return thread


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
    if not args.no_browser and has_desktop():
        open_browser_when_up(local_url(args.host, args.port))
    try:
        return run_dashboard(args)
    except KeyboardInterrupt:
        return 0
    finally:
        if started:
            print("policylens: stopping the demo training after its current step")
            demo.stop_demo(logs_dir)


# ---------------------------------------------------------------- import


IMPORT_EXAMPLES = """examples:
  policylens import trl runs/qwen-grpo --run-name qwen-grpo         (TRL output_dir, log_completions=True)
  policylens import verl ckpt/rollouts --run-name verl-gsm8k --tokenizer ~/models/qwen --follow
  policylens import prime-rl outputs/ --tokenizer ~/models/qwen     (token_exports/step_<N>/rank_<R>.jsonl)
  policylens import nemo-rl logs/exp_001 --tokenizer ~/models/qwen  (train_data_step<N>.jsonl)
  policylens import slime debug/ --tokenizer ~/models/qwen          (--save-debug-rollout-data / -train-data)
"""
IMPORT_SOURCES = ("trl", "verl", "prime-rl", "nemo-rl", "slime")  # = engine.importers.SOURCES (not imported here)


def add_import_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "import", help="import the rollouts or tokens another trainer dumped into a run (again: only new steps)",
        epilog=IMPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=IMPORT_SOURCES, help="the trainer that wrote the folder")
    parser.add_argument("folder", help="TRL: the output_dir (completions/ inside); verl: trainer.rollout_data_dir; "
                        "prime-rl: the output_dir (token_exports/ inside); nemo-rl: the log_dir; slime: the folder "
                        "of the debug dumps")
    parser.add_argument("--run-name", help="the PolicyLens run to create or continue (default: the folder's name)")
    parser.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder: token texts (prime-rl, nemo-rl, "
                        "slime), or the tokens table from the text (trl, verl)")
    parser.add_argument("--follow", action="store_true", help="keep importing new files until Ctrl-C")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between looks with --follow")
    _add_logs_dir(parser)
    parser.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from engine.importers import follow, import_run, run_name_from_folder
    from engine.runlog import RunLogError

    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"policylens import: {folder} is not a folder", file=sys.stderr)
        return 2
    run = args.run_name or run_name_from_folder(folder)

    def show(report) -> None:
        for problem in report.problems:
            print(f"policylens import: {problem}", file=sys.stderr)
        if report.imported or not args.follow:
            print(f"policylens import: run {report.run}: {len(report.imported)} step(s) imported"
                  + (f" ({report.imported[0]}..{report.imported[-1]})" if report.imported else "")
                  + (f", {report.already_there} already there" if report.already_there else ""))

    try:
        if args.follow:
            follow(args.source, folder, args.logs_dir, run, args.tokenizer, interval=args.interval, on_report=show)
        else:
            show(import_run(args.source, folder, args.logs_dir, run, args.tokenizer))
    except RunLogError as err:
        print(f"policylens import: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


# ----------------------------------------------------------------


# The commands whose flags are engine.config's fields: building them imports the engine, and with it torch (about
# a second), so for any other command they are only named, and `policylens runs` or `sql` start at once.
CONFIG_COMMANDS = {
    "train": "train a policy and log every token",
    "warmstart": "build (or reuse) the cached warm start that `policylens train` with these flags uses",
}


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
        _passive_thread_waits()  # before the parser imports torch (engine.config's flags)
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # `train --nproc` starts the same command again under torchrun
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
