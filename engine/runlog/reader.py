"""`RunReader`: read-only SQL over the runs of a logs folder, while they are written.

An in-memory DuckDB connection with views over the runs' Parquet files (listed by the reader itself, so it only
ever sees whole steps); damaged or foreign files are left out and described in `problems`. The SQL sandbox: reading
statements only, and DuckDB may open no file outside the runs read (see `RunReader`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from engine.runlog.derived import STORED, TOKEN_PASSES_SQL, TOKEN_ROWS, tokens_sql
from engine.runlog.layout import (
    CHUNK_DIR_RE,
    STEP_DIR_RE,
    RunInfo,
    RunLogError,
    Segment,
    data_dir_of,
    logs_dir_error,
    not_listable,
    run_folders,
    scan_segments,
    shown,
    validate_run_name,
)
from engine.runlog.repair import LEGACY, check_file, damaged_pages
from engine.runlog.schema import (
    DATA_TABLES,
    FILE_SCHEMAS,
    RUNS_SCHEMA,
    STORED_TABLES,
    TABLE_SCHEMAS,
    VOCABULARY_TABLE,
    columns_ddl,
    view_schema,
)

if TYPE_CHECKING:  # pandas is imported only when a DataFrame is asked for: `policylens runs` starts faster
    import pandas as pd

def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[tuple]) -> None:
    """Insert rows of the runs table, many per statement (`executemany` prepares one statement per row: 0.1 s
    for 200 runs)."""
    marks = "(" + ", ".join("?" * len(RUNS_SCHEMA)) + ")"
    for start in range(0, len(rows), 256):
        batch = rows[start:start + 256]
        con.execute(f"INSERT INTO {table} VALUES {', '.join([marks] * len(batch))}",
                    [value for row in batch for value in row])


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _view_sql(table: str, files: Callable[[str], str]) -> str:
    """SQL of a table's view over `files(table)`, the SQL names of its stored rows: the stored rows as they are,
    but for `tokens` and `token_passes`, which derive the values the writer left out (engine.runlog.derived):
    `token_passes` from the token rows, `tokens` from `token_vocab` too."""
    if table == "token_passes":
        return TOKEN_PASSES_SQL.format(passes=files("token_passes"), tokens=files("tokens"))
    if table == "tokens":
        return tokens_sql(files("tokens"), TABLE_SCHEMAS["tokens"].names, files(VOCABULARY_TABLE))
    return f"SELECT * FROM {files(table)}"


def _parquet_source(table: str, paths: list[str], legacy: bool, empty: str) -> str:
    """SQL reading `table`'s columns from these files (explicit columns: a `key=value` folder above the logs
    folder would otherwise add a column). `legacy`: some files predate `ADDED_COLUMNS`; a by-name union with
    `empty`, a table of the current schema and no rows, reads those columns of theirs as NULL."""
    listing = ", ".join(_sql_str(p) for p in paths)
    # float32 columns read as DOUBLE (`view_schema`), whichever type a file has
    columns = ", ".join(f'CAST("{f.name}" AS DOUBLE) AS "{f.name}"' if pa.types.is_float32(f.type) else f'"{f.name}"'
                        for f in FILE_SCHEMAS[table])
    files = f"read_parquet([{listing}], hive_partitioning = true, hive_types = {{'run': 'VARCHAR'}}"
    if not legacy:
        return f"SELECT {columns} FROM {files})"
    return (f"SELECT {columns} FROM (SELECT * FROM {empty} UNION ALL BY NAME "
            f"SELECT * FROM {files}, union_by_name = true))")


# What a query of the reader may be: reading statements only (DESCRIBE, SHOW, SUMMARIZE and WITH are SELECTs to
# DuckDB). EXPLAIN is let through only around a SELECT, since EXPLAIN ANALYZE runs the statement it explains.
_READ_ONLY_RULE = (
    "the run log is read-only here: only SELECT (with WITH, DESCRIBE, SHOW, SUMMARIZE) and EXPLAIN SELECT are run, "
    "and only the run log's files can be read; `policylens sql --unsafe` (RunReader(..., unsafe=True)) gives a "
    "full DuckDB shell"
)
_EXPLAIN_RE = re.compile(r"\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?", re.IGNORECASE)

# Errors a query makes by itself (its text, its names, being interrupted): no file is to blame for them.
_QUERY_ERRORS = (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                 duckdb.PermissionException, duckdb.InterruptException, duckdb.ConversionException,
                 duckdb.TypeMismatchException)

# The run-log's own SQL for the runs list (`policylens runs`, the dashboard's Runs table): every run with its
# number of logged steps and its latest held-out accuracy (the last step that evaluated, not the last step).
_RUNS_OVERVIEW_SQL = """
    SELECT r.run, r.status, r.algorithm, r.task, r.model, r.last_step, coalesce(s.steps_logged, 0) AS steps_logged,
           s.heldout_accuracy, s.heldout_step, r.created_at, r.updated_at, r.config
    FROM runs r
    LEFT JOIN (
        SELECT run, count(*) AS steps_logged,
               arg_max(heldout_accuracy, step) FILTER (WHERE heldout_accuracy IS NOT NULL) AS heldout_accuracy,
               max(step) FILTER (WHERE heldout_accuracy IS NOT NULL) AS heldout_step
        FROM steps GROUP BY run
    ) s USING (run)
    ORDER BY r.created_at, r.run
"""


# How long a data folder must have been unchanged before its listing is reused (see `RunReader._segments_of`).
_LISTING_SETTLE_SECONDS = 2.0


class RunReader:
    """Read-only SQL over runs: an in-memory DuckDB connection with the views runs, steps, rollouts, tokens,
    token_passes, prm_steps and ref_tokens over the Parquet files of all runs (or only of `runs`).

    Never blocks a writer (it only probes a writer's lock for a few microseconds to tell a crashed run from a
    running one). The views are a snapshot of the files at the last `refresh()`;
    `sql()` refreshes first (cheap when nothing changed), so it always sees every finished step.
    Files or runs that cannot be read are left out and described in `problems`.

    Queries only read: `sql` and `rows` refuse any statement but SELECT / EXPLAIN SELECT, and DuckDB itself may
    open no file outside the runs read (its external access is off except for those folders, extensions are
    neither installed nor loaded, and that configuration is locked). `unsafe=True` lifts all of it (a full
    DuckDB shell; the tables are restored by the next query if a statement dropped or replaced them).
    `tables` limits the files checked and read to some tables (the others are empty): opening is then cheaper.
    Thread-safe: calls are serialised by a lock. `gives_way`: whether the calling thread's queries give way to the
    others' (work done ahead of a user, such as the dashboard's guesses): a query of such a thread is interrupted
    (it raises duckdb.InterruptException) when another thread asks for the reader, which then does not wait for it.
    """

    def __init__(self, logs_dir: str | os.PathLike, runs: str | Iterable[str] | None = None, unsafe: bool = False,
                 memory_limit: str | None = None, tables: Iterable[str] | None = None,
                 gives_way: Callable[[], bool] | None = None):
        # Absolute, so that the folders DuckDB may read and the paths in the views are written the same way.
        self.logs_dir = Path(os.path.abspath(logs_dir))
        if isinstance(runs, str):
            runs = [runs]
        self.only = None if runs is None else [validate_run_name(r, self.logs_dir) for r in runs]
        self.unsafe = unsafe
        self.memory_limit = memory_limit  # DuckDB's, e.g. "1GB" (a long-lived server); default 80% of the RAM
        # Only these tables' files are checked and read; the other views stay empty (`policylens runs` needs the
        # steps only: 0.2 s instead of 1.3 s to open 200 runs).
        self.tables = DATA_TABLES if tables is None else tuple(tables)
        if unknown := sorted(set(self.tables) - set(DATA_TABLES)):
            raise RunLogError(f"unknown table(s) {unknown}; the tables are {list(DATA_TABLES)}")
        if "token_passes" in self.tables and "tokens" not in self.tables:
            self.tables += ("tokens",)  # the token rows complete the stored passes (see `_view_sql`)
        if "tokens" in self.tables:
            self.tables += (VOCABULARY_TABLE,)  # and the run's vocabulary the token rows (see `_view_sql`)
        self.problems: list[str] = []
        self._lock = threading.RLock()
        self._gives_way = gives_way
        self._interruptible = threading.Lock()  # guards `_giving_way` and its query's interruption
        self._giving_way = False  # the query running now is one of a thread that gives way
        self._segments: dict[str, tuple[list, list[str]]] = {}  # folder -> ([(table, path)], problems)
        self._seen_segments: set[str] = set()
        self._quarantined: dict[str, str] = {}
        self._verified: set[str] = set()  # files every page of which was decoded once (see `_find_damaged`)
        self._legacy_files: set[str] = set()  # valid files without `ADDED_COLUMNS` (see `_create_view`)
        self._meta_cache: dict[str, tuple[int, int, RunInfo]] = {}
        self._listings: dict[str, tuple[tuple[int, int], list[Segment], list[str]]] = {}  # see `_segments_of`
        if self.logs_dir.exists() and not self.logs_dir.is_dir():
            raise logs_dir_error(self.logs_dir, NotADirectoryError())
        if self.only is not None:
            for name in self.only:  # fail early and clearly for a run asked for by name
                RunInfo.read(self.logs_dir / name)
        self._con = self._connect()
        self.refresh()

    def _connect(self) -> duckdb.DuckDBPyConnection:
        con = duckdb.connect(":memory:")
        # Our files are immutable under a given name, so caching their footers is safe and saves a read per file.
        con.execute("SET parquet_metadata_cache = true")
        # DuckDB's own cache of file blocks duplicates the operating system's page cache for local files and
        # made a long-lived reader's resident memory grow with every step looked at (1.8 GB at 100M token rows).
        con.execute("SET enable_external_file_cache = false")
        if self.memory_limit is not None:
            con.execute("SET memory_limit = ?", [self.memory_limit])
        if not self.unsafe:
            roots = [self.logs_dir] if self.only is None else [self.logs_dir / name for name in self.only]
            con.execute("SET allowed_directories = ?", [[os.path.join(root, "") for root in roots]])
            con.execute("SET autoinstall_known_extensions = false")
            con.execute("SET autoload_known_extensions = false")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
        self._views: dict[str, list[str]] = {}
        self._runs_rows: list | None = None
        self._create_internal_tables(con)
        return con

    @staticmethod
    def _create_internal_tables(con: duckdb.DuckDBPyConnection) -> None:
        # Plain SQL tables, not registered Python objects: registering makes DuckDB import pandas (1 s).
        con.execute("CREATE SCHEMA IF NOT EXISTS _runlog")  # out of the way of users' SHOW TABLES
        for table, schema in {**FILE_SCHEMAS, "runs": RUNS_SCHEMA}.items():  # the stored rows' columns
            con.execute(f"CREATE OR REPLACE TABLE _runlog.empty_{table} ({columns_ddl(view_schema(schema))})")
        for table in FILE_SCHEMAS:  # until `_create_view`: a view may read another table's stored rows
            con.execute(f"CREATE OR REPLACE VIEW {STORED.format(table)} AS SELECT * FROM _runlog.empty_{table}")

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._con.close()

    def connection(self) -> duckdb.DuckDBPyConnection:
        """The connection with the views, refreshed now. Call `refresh()` again later to see new steps.
        (Statements run on it directly are not checked; its file access is limited all the same.)"""
        with self._lock:
            self.refresh()
            return self._con

    def sql(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pd.DataFrame:
        """Run a query on fresh views and return a DataFrame (retried if compaction removed a file meanwhile,
        or without a file found damaged by it)."""
        return self._run(query, params, lambda result: result.df())

    def arrow(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pa.Table:
        """Like `sql` but returns an Arrow table: text columns arrive without a Python object per value (a step's
        0.75M token texts: 0.05 s to a DataFrame through Arrow, 0.2 s through DuckDB's own conversion)."""
        return self._run(query, params, lambda result: result.to_arrow_table(), relation=True)

    def rows(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> tuple[list[str], list]:
        """Like `sql` but returns (column names, list of row tuples), without pandas."""
        return self._run(query, params, lambda result: ([d[0] for d in result.description], result.fetchall()))

    def runs_overview(self, as_rows: bool = False) -> pd.DataFrame | tuple[list[str], list]:
        """Every run, oldest first: run, status, algorithm, task, model, last_step, steps_logged and the latest
        held-out accuracy with its step (heldout_accuracy, heldout_step), created_at, updated_at, config."""
        return self.rows(_RUNS_OVERVIEW_SQL) if as_rows else self.sql(_RUNS_OVERVIEW_SQL)

    def _run(self, query: str, params: Any, fetch: Callable[[Any], Any], relation: bool = False) -> Any:
        """`fetch` of the query's result: its connection after `execute`, or, with `relation` (a query that only
        reads), its relation (`DuckDBPyConnection.sql`), whose Arrow output is not copied once more."""
        gives_way = self._gives_way is not None and self._gives_way()
        if not self._lock.acquire(blocking=False):
            if not gives_way:
                with self._interruptible:
                    if self._giving_way:  # a query that gives way holds the lock: stop it
                        self._con.interrupt()
            self._lock.acquire()
        try:
            writes = self._check_statements(query)
            self.refresh()
            for attempt in range(4):
                try:
                    with self._interruptible:
                        self._giving_way = gives_way
                    try:
                        if relation and not writes:
                            return fetch(self._con.sql(query, params=params))
                        return fetch(self._con.execute(query, params))
                    finally:
                        with self._interruptible:
                            self._giving_way = False
                except duckdb.PermissionException as err:
                    if self.unsafe:
                        raise
                    raise RunLogError(f"{str(err).splitlines()[0]}: {_READ_ONLY_RULE}") from err
                except duckdb.InterruptException:
                    raise  # no file to blame: the query gave way, or its caller stopped it
                except duckdb.Error as err:
                    if attempt == 3 or not self._handle_file_error(err):
                        raise
                finally:
                    if writes:  # unsafe mode: a statement may have dropped or replaced a table: rebuild them all
                        self._create_internal_tables(self._con)
                        self._views, self._runs_rows = {}, None
                        self.refresh()
            raise AssertionError("unreachable")
        finally:
            self._lock.release()

    def _check_statements(self, query: str) -> bool:
        """Refuse anything but reading statements (see `_READ_ONLY_RULE`); in unsafe mode, say if it may write."""
        try:
            statements = self._con.extract_statements(query)
        except duckdb.Error:
            return False  # not parsed: running it reports the syntax error
        kinds = [s.type for s in statements]
        if self.unsafe:
            return any(kind != duckdb.StatementType.SELECT for kind in kinds)
        for statement in statements:
            if statement.type == duckdb.StatementType.SELECT:
                continue
            explain = _EXPLAIN_RE.match(statement.query) if statement.type == duckdb.StatementType.EXPLAIN else None
            if explain:
                try:
                    inner = self._con.extract_statements(statement.query[explain.end():])
                except duckdb.Error:
                    inner = []
                if inner and all(s.type == duckdb.StatementType.SELECT for s in inner):
                    continue
            raise RunLogError(f"{statement.type.name} statement refused: {_READ_ONLY_RULE}")
        return False

    def steps_without(self, table: str, run: str, sources: Iterable[str]) -> list[tuple[int, int]]:
        """The step ranges (first, last) of `run` held in a folder (a step's or a chunk's) that has a file of one
        of the `sources` tables but no readable file of `table`: the steps a query of `table` alone would miss
        (folders written before `table` existed, a damaged file of it left out). Sorted and merged over ranks."""
        with self._lock:
            self.refresh()
            having = {os.path.dirname(path) for path in self._views.get(table, [])}
            ranges = []
            for path in (p for source in sources for p in self._views.get(source, [])):
                folder = os.path.dirname(path)
                if folder in having or os.path.basename(os.path.dirname(folder)) != f"run={run}":
                    continue
                if step := STEP_DIR_RE.match(os.path.basename(folder)):
                    ranges.append((int(step[1]), int(step[1])))
                elif chunk := CHUNK_DIR_RE.match(os.path.basename(folder)):
                    ranges.append((int(chunk[1]), int(chunk[2])))
        merged: list[tuple[int, int]] = []
        for first, last in sorted(ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        return merged

    def run_names(self) -> list[str]:
        with self._lock:
            return [row[0] for row in (self._runs_rows or [])]

    # ---- building the views

    def refresh(self) -> bool:
        """Rescan the logs folder; rebuild views whose file lists changed. Returns True if anything changed."""
        with self._lock:
            for attempt in range(5):
                scan = self._scan()
                if scan is None and attempt < 4:  # a folder vanished under the listing (compaction): look again
                    continue
                problems, files, runs_rows = scan or self._scan(final=True)
                try:
                    return self._apply(problems, files, runs_rows)
                except duckdb.IOException:
                    if attempt == 4:
                        raise
            raise AssertionError("unreachable")

    def _scan(self, final: bool = False):
        """(problems, files per table, runs rows), or None if the data changed during the listing."""
        problems: list[str] = []
        files: dict[str, list[str]] = {t: [] for t in STORED_TABLES}
        runs_rows = []
        self._seen_segments = set()
        for run_dir in self._run_dirs(problems):
            try:
                info = self._info(run_dir)
            except RunLogError as err:
                if self.only is not None:
                    raise
                problems.append(str(err))
                continue
            segments = self._segments_of(data_dir_of(run_dir), problems)
            for seg in segments:
                if not self._collect(seg, files, problems) and not final:
                    return None
            last = max((s.last for s in segments), default=None)
            row = info.runs_row(run_dir, last)
            row["config"] = json.dumps(row["config"])
            runs_rows.append(tuple(row[name] for name in RUNS_SCHEMA.names))
        problems.extend(f"{shown(path)}: {msg} (skipped)" for path, msg in self._quarantined.items())
        for gone in self._segments.keys() - self._seen_segments:  # compacted away: forget
            del self._segments[gone]
        return problems, files, runs_rows

    def _segments_of(self, data_dir: Path, problems: list[str]) -> list[Segment]:
        """`_scan_segments`, listed again only when the folder changed: adding, renaming or removing a step or
        chunk folder changes the data folder's mtime, so the live view's poll costs one stat per run, not a
        listing. The mtime's resolution is coarse (a clock tick), so two changes close together could leave it
        the same: a listing is reused only if the folder had not changed for `_LISTING_SETTLE_SECONDS` when
        it was taken."""
        try:
            st = os.stat(data_dir)
        except OSError:
            st = None
        key = None if st is None else (st.st_ino, st.st_mtime_ns)
        cached = self._listings.get(str(data_dir))
        if key is not None and cached is not None and cached[0] == key:
            problems.extend(cached[2])
            return cached[1]
        found: list[str] = []
        segments = scan_segments(data_dir, found)
        problems.extend(found)
        if key is not None and time.time() - st.st_mtime > _LISTING_SETTLE_SECONDS:
            self._listings[str(data_dir)] = (key, segments, found)
        return segments

    def _apply(self, problems: list[str], files: dict[str, list[str]], runs_rows: list[tuple]) -> bool:
        self.problems = problems
        changed = False
        for table, paths in files.items():
            if self._views.get(table) != paths:
                self._create_view(table, paths)
                changed = True
        if runs_rows != self._runs_rows:
            self._con.execute("CREATE OR REPLACE TABLE _runlog.runs AS SELECT * FROM _runlog.empty_runs")
            _insert_rows(self._con, "_runlog.runs", runs_rows)
            self._con.execute("CREATE OR REPLACE VIEW runs AS SELECT * FROM _runlog.runs")
            self._runs_rows = runs_rows
            changed = True
        return changed

    def _run_dirs(self, problems: list[str]) -> list[Path]:
        if self.only is not None:
            return [self.logs_dir / name for name in self.only]
        return run_folders(self.logs_dir, problems)

    def _info(self, run_dir: Path) -> RunInfo:
        path = run_dir / "run.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            raise RunLogError(f"no run named {run_dir.name!r} in {run_dir.parent} (missing {path})") from None
        key = str(path)
        cached = self._meta_cache.get(key)
        if cached and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        info = RunInfo.read(run_dir)
        self._meta_cache[key] = (st.st_size, st.st_mtime_ns, info)
        return info

    def _collect(self, seg: Segment, files: dict[str, list[str]], problems: list[str]) -> bool:
        """Add the segment's valid files to `files`; False if the segment vanished since the listing.

        A segment folder never changes once renamed into place, so its listing and file checks are done once
        (a file damaged later, or damaged inside its pages, is caught when a query fails on it, see
        `_handle_file_error`)."""
        key = seg.path
        cached = self._segments.get(key)
        if cached is None:
            try:
                entries = list(os.scandir(seg.path))
            except FileNotFoundError:  # deleted since the listing (compaction, truncation): the caller rescans
                return False
            except OSError as err:  # replaced by a file since the listing, or no permission
                entries, cached = [], ([], [f"{shown(seg.path)}: {not_listable(err)} (skipped)"])
            found, notes = [], []
            for entry in entries:
                table = entry.name[: -len(".parquet")] if entry.name.endswith(".parquet") else None
                if table not in TABLE_SCHEMAS:
                    notes.append(f"{shown(entry.path)}: foreign file in a step folder (ignored)")
                elif table not in self.tables:
                    continue
                elif (problem := check_file(entry.path, table)) not in (None, LEGACY):
                    notes.append(f"{shown(entry.path)}: {problem} (skipped)")
                else:
                    found.append((table, entry.path))
                    if problem == LEGACY:
                        self._legacy_files.add(entry.path)
            cached = self._segments[key] = cached or (found, notes)
        self._seen_segments.add(key)
        for table, path in cached[0]:
            if path not in self._quarantined:
                files[table].append(path)
        problems.extend(cached[1])
        return True

    def _create_view(self, table: str, paths: list[str]) -> None:
        # No files (an empty run, no process-supervision steps): the right columns, no rows.
        empty = f"_runlog.empty_{table}"
        source = (_parquet_source(table, paths, not self._legacy_files.isdisjoint(paths), empty) if paths
                  else f"SELECT * FROM {empty}")
        self._con.execute(f"CREATE OR REPLACE VIEW {STORED.format(table)} AS {source}")
        if table in DATA_TABLES:  # not token_vocab, storage only: the `tokens` view reads it
            self._con.execute(f"CREATE OR REPLACE VIEW {table} AS {_view_sql(table, STORED.format)}")
        if table == "tokens":
            rows = tokens_sql(STORED.format(table), TABLE_SCHEMAS[table].names, None)
            self._con.execute(f"CREATE OR REPLACE VIEW {TOKEN_ROWS} AS {rows}")
        self._views[table] = paths

    def _handle_file_error(self, err: duckdb.Error) -> bool:
        """After a failed query: if a file we listed vanished or is damaged, fix the views and say retry.

        DuckDB names the file in most errors; not for every kind of damage to the data pages (a corrupt page
        header gives "don't know what type"). Then every file not yet known to be whole is read in full once,
        here, so the damaged one is found, named in `problems` and left out, whatever query met it."""
        if not self._connection_usable():
            self._con = self._connect()  # a fatal error invalidated the database; the views are rebuilt
            self.refresh()
            return True
        message = str(err)
        listed = {path: table for table, paths in self._views.items() for path in paths}
        for path in listed:
            if path in message:
                if os.path.exists(path):
                    self._quarantine(path, f"damaged ({message.splitlines()[0]})")
                else:
                    self._views[listed[path]] = []  # vanished (compaction): force a rebuild
                self.refresh()
                return True
        if any(not os.path.exists(p) for p in listed):
            self._views = {}
            self.refresh()
            return True
        if isinstance(err, _QUERY_ERRORS):
            return False
        damaged = self._find_damaged(listed, message.splitlines()[0] if message else type(err).__name__)
        if damaged:
            self.refresh()
        return damaged

    def _find_damaged(self, listed: dict[str, str], error: str) -> bool:
        """Decode every page of each listed file not yet verified; quarantine the ones that fail."""
        found = False
        self._verified &= listed.keys()  # forget files compacted away
        for path in listed:
            if path in self._verified:
                continue
            problem = damaged_pages(self._con, path)
            if problem is None:
                self._verified.add(path)
                continue
            if not self._connection_usable():
                self._con = self._connect()
            found = True
            if os.path.exists(path):  # else compacted away meanwhile: the refresh after this drops it
                self._quarantine(path, f"damaged data pages (DuckDB: {problem or error})")
        return found

    def _quarantine(self, path: str, reason: str) -> None:
        self._quarantined[path] = reason
        for table, paths in self._views.items():
            if path in paths:
                self._views[table] = []  # force a rebuild without it

    def _connection_usable(self) -> bool:
        try:
            self._con.execute("SELECT 1").fetchall()
        except duckdb.Error:
            return False
        return True

    # ---- export

    def export(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write every table of this reader's runs into one self-contained DuckDB file (real tables, no views).

        All tables come from one snapshot of the files (a live run's later steps are not half included). The file
        is built under a temporary name and renamed into place, so an existing file is never left half written.
        It is written by a separate connection running only this method's statements: the reader's own
        connection may open nothing outside the runs.
        """
        path = Path(path)
        if path.exists() and not overwrite:
            raise RunLogError(f"{path} already exists (left untouched)")
        with self._lock:
            for attempt in range(4):
                self.refresh()
                tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
                try:
                    with duckdb.connect(str(tmp)) as out:
                        for table in STORED_TABLES:
                            if table in DATA_TABLES:  # not token_vocab: its ids are in the exported tokens
                                out.execute(f"CREATE TABLE {table} "
                                            f"({columns_ddl(view_schema(TABLE_SCHEMAS[table]))})")
                            out.execute(f"CREATE TEMP TABLE empty_{table} "
                                        f"({columns_ddl(view_schema(FILE_SCHEMAS[table]))})")
                            paths = self._views[table]
                            legacy = not self._legacy_files.isdisjoint(paths)
                            source = (_parquet_source(table, paths, legacy, f"empty_{table}") if paths
                                      else f"FROM empty_{table}")
                            out.execute(f"CREATE TEMP VIEW {table}_files AS {source}")
                        for table in DATA_TABLES:  # after every table's files: token_passes reads the
                            # tokens', tokens the vocabulary's
                            out.execute(f"INSERT INTO {table} {_view_sql(table, lambda t: f'{t}_files')}")
                        out.execute(f"CREATE TABLE runs ({columns_ddl(RUNS_SCHEMA)})")
                        _insert_rows(out, "runs", self._runs_rows or [])
                    os.replace(tmp, path)
                    return path
                except duckdb.Error as err:
                    if attempt == 3 or not self._handle_file_error(err):  # a file vanished or is damaged: again
                        raise
                finally:
                    for leftover in (tmp, Path(f"{tmp}.wal")):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(leftover)
        raise AssertionError("unreachable")
