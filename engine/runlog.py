"""The run log: every token of every step as Parquet files, queryable with DuckDB while the run trains.

DuckDB lets one process write a database file or many processes read it, never both, so a live dashboard cannot
open the trainer's database. Instead each run is a folder of immutable Parquet files; readers hold their own
in-memory DuckDB connection with views over those files.

On-disk layout (``SCHEMA_VERSION`` 1)::

    <logs_dir>/<run>/run.json                      name, run_id, algorithm, task, model, config, status, times,
                                                   last_step, schema_version (replaced atomically, rank 0 only)
    <logs_dir>/<run>/writer-rank<R>.lock           held (flock) by the live writer of rank R: pid and host inside
    <logs_dir>/<run>/data/run=<run>/               the step data (``run=`` lets DuckDB skip other runs by path):
        step-<S>.rank<R>.s<W>/                     one finished step of one rank: <table>.parquet for each table
                                                   that has rows (steps, rollouts, tokens, token_passes, prm_steps,
                                                   ref_tokens);
                                                   W identifies the writer session (hex microseconds)
        chunk-<A>-<B>-<Q>.rank<R>/                 steps A..B of rank R merged into larger sorted files
                                                   (compaction; Q is a sequence number, the newest chunk wins)
        .tmp-* / .trash-*                          in progress / being deleted; readers never look at dot names

How the behaviour the issue asks for is obtained:

1. A step is visible all at once: its files are written into ``.tmp-...`` and the folder is renamed to
   ``step-<S>.rank<R>.s<W>`` in one ``os.rename``. Readers list folders themselves (not a DuckDB glob) and give
   DuckDB explicit file lists, so they only ever see whole steps. Killing the writer (SIGKILL included) leaves at
   most a ``.tmp-`` folder behind. Encoding happens on one writer thread at most one step behind the caller (the
   next ``log_step`` waits for it), so a kill loses at most the step being written; ``flush()``/``close()`` wait.
2. Many steps stay fast to query: after ``compact_every`` step folders the writer merges them into one chunk
   (files sorted by step, rollout, position, so row-group statistics prune a one-rollout query), and every
   ``_MERGE_FAN_IN`` chunks of one size into a bigger one: the file count grows with the log of the step count.
   Row groups have a fixed size whatever the merge path (`_FolderWriter`), so `RunWriter.log_many` can write a
   bulk import straight into its final chunks; closing a run merges its remaining step folders into one chunk;
   a reader lists a data folder again only when its mtime changed.
   A reader that lists a chunk and the folders it replaced uses the chunk. The replaced folders are deleted
   ``_DELETE_GRACE_SECONDS`` later (readdir is no snapshot; see there); a reader whose view still names a
   deleted file refreshes and retries the query (`RunReader.sql`).
3. Several processes (torchrun ranks) write disjoint folders (``.rank<R>``); only rank 0 writes ``run.json``.
4. Crash detection: the writer holds an exclusive ``flock`` on ``writer-rank<R>.lock`` for its lifetime; the kernel
   releases it when the process dies. A run whose ``run.json`` says ``running`` while nobody holds the rank-0 lock
   is shown as ``crashed``. (On another host the lock cannot be probed: a heartbeat older than
   ``STALE_AFTER_SECONDS`` counts as crashed.)
5. Resume: ``RunWriter.resume`` continues after the last complete step of its rank on disk. Steps must strictly
   increase, so a re-logged step never duplicates rows: logging a step <= ``last_step`` is an error. To restart from
   a checkpoint older than the log, pass ``truncate_after=checkpoint_step`` (or call ``discard_after`` once the
   writer's ``last_step`` is known): the log of steps after it is deleted first (a chunk that straddles it is
   rewritten and the rewrite wins by its newer sequence number).
6. Damaged or foreign files cost only themselves: every Parquet file is checked once (footer and schema) before it
   enters a view; bad files, foreign files, files where a step folder belongs, unreadable ``run.json``, folders
   that are not valid run names and runs of a newer schema version are skipped and listed in
   ``RunReader.problems``. Damage inside a file's data pages shows only when a query decodes them: the reader then
   finds the file (from DuckDB's message, or by decoding each file not yet known to be whole once), leaves it out
   and runs the query again (`RunReader._handle_file_error`). Asking for such a run by name raises `RunLogError`.
7. Read-only SQL: a reader runs reading statements only, and its DuckDB may open no file outside the runs it reads
   (external access off but for those folders, no extension installed or loaded, configuration locked);
   ``RunReader(..., unsafe=True)`` is a full DuckDB shell instead.

Logging from any training loop (the engine does the same in ``engine/train.py``)::

    from engine.runlog import RunWriter, RunReader

    with RunWriter.create("logs", "my-run", algorithm="grpo", task="arith", config={"lr": 1e-6},
                          model="tiny-gpt 2x64") as log:
        for step in range(100):
            ...  # sample a group of completions, score them, update the policy
            log.log_step(
                step,
                metrics={"reward_mean": 0.42, "loss": 0.13, "lr": 1e-6},
                rollouts={"rollout_id": [0, 1], "group_id": [0, 0], "index_in_group": [0, 1],
                          "kind": ["train", "train"], "prompt": ["2+3=", "2+3="],
                          "completion": ["5", "6"], "reward": [1.0, 0.0], "advantage": [0.7, -0.7]},
                tokens={"rollout_id": [0, 1], "position": [0, 0], "token_text": ["5", "6"],
                        "old_logp": [-0.1, -2.3], "advantage": [0.7, -0.7]},
            )  # DataFrames, pyarrow Tables or dicts of columns; missing columns are stored as NULL
    # leaving the block marks the run finished (stopped on Ctrl-C, crashed on an exception)

    reader = RunReader("logs")
    print(reader.sql("SELECT step, reward_mean FROM steps WHERE run = ? ORDER BY step", ["my-run"]))

Timestamps (``created_at``, ``updated_at``) are UTC. ``wall_time`` is seconds since the run was created.
Durability is against process death, not power loss (no fsync), which keeps logging cheap.
With several ranks, make ``rollout_id`` unique across ranks and let rank 0 log the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:  # pandas is imported only when a DataFrame is asked for: `policylens runs` starts faster
    import pandas as pd

try:  # POSIX only; elsewhere crash detection falls back to the heartbeat age
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

SCHEMA_VERSION = 1
STATUSES = ("running", "finished", "stopped", "crashed")
STALE_AFTER_SECONDS = 15 * 60
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
RUN_NAME_RULE = (
    "1 to 100 characters: letters, digits, '.', '_' or '-', starting with a letter or digit, "
    "without '..' and not ending with '.'"
)
_RUN_NAME_RE = re.compile(RUN_NAME_PATTERN)  # always used with fullmatch: `$` also matches before a final newline
_WINDOWS_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


class RunLogError(Exception):
    """A run, a file or an argument of the run log is missing, damaged, foreign or invalid."""


# ---------------------------------------------------------------- schema
# The column names and types are the contract between the trainer, the dashboard and users' SQL.
# `run` and `step` are filled in by the writer; every other column may be omitted (stored as NULL).

_F = pa.float64()
_I = pa.int64()
_S = pa.string()

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "steps": pa.schema(
        [("run", _S), ("step", _I), ("wall_time", _F), ("reward_mean", _F), ("reward_std", _F), ("accuracy", _F),
         ("heldout_accuracy", _F), ("heldout_accuracy_sampled", _F), ("entropy", _F), ("kl", _F),
         ("clip_low_frac", _F), ("clip_high_frac", _F), ("clip_dual_frac", _F), ("response_len_mean", _F),
         ("response_len_max", _F), ("truncated_frac", _F), ("groups_kept", _I), ("groups_filtered", _I),
         ("gen_batches", _I), ("loss", _F), ("grad_norm", _F), ("lr", _F), ("step_seconds", _F),
         # algorithms with a critic (PPO, engine.critic); NULL otherwise
         ("value_loss", _F), ("value_clip_frac", _F), ("explained_variance", _F), ("critic_grad_norm", _F),
         ("critic_seconds", _F), ("critic_memory_mb", _F), ("advantage_mean", _F), ("advantage_std", _F),
         # metrics outside the contract, as a JSON object, so any training loop can log its own
         ("extra", _S)]
    ),
    "rollouts": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("group_id", _I), ("index_in_group", _I), ("kind", _S),
         ("prompt_id", _I), ("prompt", _S), ("completion", _S), ("answer", _S), ("reward", _F),
         ("reward_correct", _F), ("reward_process", _F), ("reward_length", _F), ("advantage", _F),
         ("length", _I), ("truncated", pa.bool_()), ("filtered", pa.bool_()), ("filter_reason", _S),
         ("seq_ratio", pa.list_(_F)),
         # the process (rank) that sampled the rollout; one reward per reward function as a JSON object
         # {"name": value} (`reward` stays the total the trainer optimised)
         ("rank", _I), ("reward_components", _S)]
    ),
    "tokens": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("position", _I), ("token_id", _I), ("token_text", _S),
         ("old_logp", _F), ("ref_logp", _F), ("entropy", _F), ("advantage", _F), ("prm_step", _I),
         ("value", _F), ("return", _F), ("kl_reward", _F),  # the last three: critic algorithms only
         ("sampler_logp", _F),  # the sampler's (inference engine's) log-prob of the token; NULL when not logged
         ("sampler_logp_full", _F),  # the same under the sampler's full, unprocessed distribution; NULL if unknown
         ("extra", _S)]  # per-token fields outside the contract (imported runs), a JSON object
    ),
    "token_passes": pa.schema(
        [("run", _S), ("step", _I), ("pass", _I), ("rollout_id", _I), ("position", _I), ("new_logp", _F),
         ("ratio", _F), ("clip", pa.int8()), ("grad_weight", _F), ("token_loss", _F), ("kl", _F)]
    ),
    "prm_steps": pa.schema(
        [("run", _S), ("step", _I), ("rollout_id", _I), ("step_index", _I), ("first_pos", _I), ("last_pos", _I),
         ("text", _S), ("reward_raw", _F), ("reward_norm", _F)]
    ),
    # the held-out prompts' reference solutions scored by the policy (teacher-forced) at each evaluation
    "ref_tokens": pa.schema(
        [("run", _S), ("step", _I), ("prompt_id", _I), ("position", _I), ("token_id", _I), ("token_text", _S),
         ("logp", _F), ("entropy", _F), ("answer_class", _S)]
    ),
}
DATA_TABLES = tuple(TABLE_SCHEMAS)
# Columns added after files were first written with SCHEMA_VERSION 1: a file without them is still read (the
# columns read as NULL) and rewritten with them when compacted, so older runs stay visible and resumable.
_ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("value_loss", "value_clip_frac", "explained_variance", "critic_grad_norm", "critic_seconds",
              "critic_memory_mb", "advantage_mean", "advantage_std"),
    "rollouts": ("rank", "reward_components"),
    "tokens": ("value", "return", "kl_reward", "sampler_logp", "sampler_logp_full", "extra"),
}
_LEGACY_SCHEMAS: dict[str, pa.Schema] = {
    table: pa.schema([f for f in TABLE_SCHEMAS[table] if f.name not in added])
    for table, added in _ADDED_COLUMNS.items()
}
ALL_TABLES = ("runs", *DATA_TABLES)

# Files are sorted by these keys so that, inside a compacted chunk, Parquet row-group min/max statistics let
# DuckDB skip everything but the row groups of the rollout a query asks for.
_SORT_KEYS = {
    "steps": ["step"],
    "rollouts": ["step", "rollout_id"],
    "tokens": ["step", "rollout_id", "position"],
    "token_passes": ["step", "rollout_id", "pass", "position"],
    "prm_steps": ["step", "rollout_id", "step_index"],
    "ref_tokens": ["step", "prompt_id", "position"],
}
_ROW_GROUP_ROWS = 32_768
# Row groups of the per-token tables are this many times larger. DuckDB pays ~10 us per row group of a file for
# every query (checking its statistics), which at 100M token rows (6,000 row groups of 32K) cost more than
# decoding: one rollout's token passes took 60 ms in 32K-row groups, 17 ms in 128K-row groups.
_TOKEN_ROW_GROUP_FACTOR = 4
# Rows kept in row groups of their own, apart from the table's other rows: eval rollouts are a few per step, and
# following one eval prompt across a run would otherwise decompress every train completion of the run (0.85 s
# instead of ~0.03 s at 400 steps of 512 completions). Each row group then holds one kind, and its min/max
# statistics let DuckDB skip the others. Within each part the rows stay in the table's sort order.
_SEPARATE_ROW_GROUPS = {"rollouts": ("kind", "train")}

RUNS_SCHEMA = pa.schema(
    [("run", _S), ("run_id", _S), ("algorithm", _S), ("task", _S), ("created_at", pa.timestamp("us")),
     ("updated_at", pa.timestamp("us")), ("status", _S), ("config", _S), ("model", _S), ("last_step", _I)]
)

_STEP_DIR_RE = re.compile(r"^step-(\d{9})\.rank(\d+)\.s([0-9a-f]+)$")
_CHUNK_DIR_RE = re.compile(r"^chunk-(\d{9})-(\d{9})-(\d{6})\.rank(\d+)$")
_LOCK_RE = re.compile(r"^writer-rank(\d+)\.lock$")


# ---------------------------------------------------------------- names and small helpers


def validate_run_name(name: str, logs_dir: str | os.PathLike | None = None) -> str:
    """Return `name` if it is a safe run name, else raise `RunLogError` saying what is accepted.

    The pattern alone excludes '/', '\\', absolute paths, leading dots and empty names; with `logs_dir` the
    resolved folder must also lie directly inside the resolved logs folder (so a symlink cannot lead out).
    """
    if not isinstance(name, str) or not _RUN_NAME_RE.fullmatch(name) or ".." in name or name.endswith("."):
        raise RunLogError(f"invalid run name {name!r}: a run name is {RUN_NAME_RULE}")
    if name.split(".")[0].lower() in _WINDOWS_RESERVED:
        raise RunLogError(f"invalid run name {name!r}: reserved device name on Windows; a run name is {RUN_NAME_RULE}")
    if logs_dir is not None:
        root = Path(logs_dir).resolve()
        if (root / name).resolve().parent != root:
            raise RunLogError(f"invalid run name {name!r}: it resolves outside the logs folder {logs_dir}")
    return name


def _shown(path: str | os.PathLike) -> str:
    """A path for a one-line message: control characters (a newline in a folder name) written as escapes."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m[0])[1:-1], str(path))


def _not_listable(err: OSError) -> str:
    return "not a folder" if isinstance(err, NotADirectoryError) else f"cannot be listed ({err.strerror})"


def _logs_dir_error(logs_dir: Path, err: OSError) -> RunLogError:
    return RunLogError(f"{_shown(logs_dir)} is {_not_listable(err)}: the logs folder holds one folder per run")


def _run_folders(logs_dir: Path, problems: list[str]) -> list[Path]:
    """The run folders directly inside `logs_dir`, by name: the one definition of what is a run, shared by
    `list_runs` and `RunReader`. A folder that is not a run (bad name, symlink out of the logs folder, no
    run.json) is described in `problems`; dot names (in progress, caches) and plain files are passed over."""
    try:
        entries = sorted(os.scandir(logs_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise _logs_dir_error(logs_dir, err) from None
    runs = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:  # only a symlink can lead outside the logs folder; resolving every run's path on each refresh is slow
            validate_run_name(entry.name, logs_dir if entry.is_symlink() else None)
        except RunLogError as err:
            problems.append(f"{_shown(entry.path)}: not a run ({_shown(err)}) (ignored)")
            continue
        if not os.path.isfile(os.path.join(entry.path, "run.json")):
            problems.append(f"{_shown(entry.path)}: not a run folder, no run.json (ignored)")
        else:
            runs.append(Path(entry.path))
    return runs


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _iso(t: dt.datetime) -> str:
    return t.isoformat(timespec="microseconds")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _remove_tree(path: Path) -> None:
    """Delete a folder so that readers see it vanish at once: rename to a dot name first, then delete."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _check_rank(rank: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise RunLogError(f"rank must be an integer >= 0, got {rank!r}")


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def _to_arrow(table: str, data: Any, run: str, step: int) -> pa.Table | None:
    """Convert a DataFrame / pyarrow Table / dict of columns into the table's schema, in bulk."""
    if data is None:
        return None
    schema = TABLE_SCHEMAS[table]
    try:
        if type(data).__name__ == "DataFrame" and type(data).__module__.startswith("pandas"):
            arrow = pa.Table.from_pandas(data, preserve_index=False)
        elif isinstance(data, pa.Table):
            arrow = data
        elif isinstance(data, Mapping):
            arrow = pa.table({k: _column_values(v) for k, v in data.items()})
        else:
            raise RunLogError(
                f"{table}: expected a pandas DataFrame, pyarrow Table or dict of columns, got {type(data).__name__}"
            )
    except (pa.ArrowException, ValueError, TypeError) as err:  # e.g. columns of different lengths
        raise RunLogError(f"{table}: cannot convert the columns: {err}") from err
    unknown = sorted(set(arrow.column_names) - set(schema.names))
    if unknown:
        raise RunLogError(f"{table}: unknown column(s) {unknown}; the columns are {schema.names[2:]}")
    n = arrow.num_rows
    if n == 0:
        return None
    columns = []
    for field in schema:
        if field.name == "run":
            columns.append(pa.array([run] * n, _S))
        elif field.name == "step":
            columns.append(pa.array([step] * n, _I))
        elif field.name in arrow.column_names:
            col = arrow.column(field.name)
            try:
                columns.append(col.cast(field.type) if col.type != field.type else col)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise RunLogError(f"{table}.{field.name}: cannot store {col.type} as {field.type}: {err}") from err
        else:
            columns.append(pa.nulls(n, field.type))
    return pa.Table.from_arrays(columns, schema=schema).sort_by([(k, "ascending") for k in _SORT_KEYS[table]])


def _column_values(values: Any) -> Any:
    """Make torch tensors and numpy arrays acceptable to pyarrow without a Python loop."""
    if hasattr(values, "detach"):  # torch.Tensor
        values = values.detach().cpu().numpy()
    if hasattr(values, "ndim") and getattr(values, "ndim", 1) > 1:
        values = list(values)  # (B, T) -> list of rows, stored as LIST
    return values


def _steps_row(metrics: Mapping[str, Any], run: str, step: int, wall_time: float, step_seconds: float | None):
    schema = TABLE_SCHEMAS["steps"]
    known = set(schema.names) - {"run", "step", "extra"}
    row: dict[str, Any] = {"wall_time": wall_time, "step_seconds": step_seconds}
    extra = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):  # numpy / torch scalars (an array of several values fails below, clearly)
            with contextlib.suppress(ValueError, RuntimeError):
                value = value.item()
        if key in known:
            row[key] = value
        elif key not in ("run", "step"):
            extra[key] = value
    if extra:
        row["extra"] = json.dumps(extra, default=_json_default)
    return _to_arrow("steps", {k: [v] for k, v in row.items()}, run, step)


# ---------------------------------------------------------------- locks (crash detection)


def _lock_is_held(lock_path: Path) -> bool | None:
    """True if a live process holds the writer lock, False if not, None if this cannot be told from here."""
    if fcntl is None:
        return None
    try:
        info = json.loads(lock_path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if info.get("host") not in (None, socket.gethostname()):
        return None  # flock does not tell about processes on other machines
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class _WriterLock:
    """An exclusive flock on ``writer-rank<R>.lock``, held while the writer lives."""

    def __init__(self, path: Path, run: str, rank: int):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            # Readers probe the lock with a shared lock for a few microseconds: retry briefly before giving up.
            deadline = time.monotonic() + 0.5
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        holder = path.read_text().strip() or "unknown process"
                        os.close(self.fd)
                        raise RunLogError(
                            f"run {run!r} rank {rank} is being written by another process ({holder}); "
                            "stop it first or log under another name"
                        ) from None
                    time.sleep(0.02)
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())

    def release(self) -> None:
        if self.fd is not None:
            if fcntl is not None:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------- what is on disk


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One step folder or one chunk folder of one rank."""

    path: str
    rank: int
    first: int
    last: int
    seq: int  # -1 for a step folder; chunks: higher is newer

    @property
    def is_chunk(self) -> bool:
        return self.seq >= 0


def data_dir_of(run_dir: Path) -> Path:
    """Where a run's step and chunk folders live: ``<run>/data/run=<name>``. The redundant ``run=<name>`` is a
    Hive-style partition key: DuckDB reads it from the path and skips other runs' files without opening them
    (a query for one rollout over 20 runs: ~30 ms instead of ~100 ms)."""
    return run_dir / "data" / f"run={run_dir.name}"


def _scan_segments(data_dir: Path, problems: list[str] | None = None) -> list[_Segment]:
    """The folders of `data_dir` that hold live data, with superseded ones (older chunks, compacted steps) removed."""
    steps, chunks = [], []
    try:
        entries = list(os.scandir(data_dir))
    except FileNotFoundError:
        return []
    except OSError as err:  # a file where the folder belongs, or no permission
        message = f"{_shown(data_dir)}: {_not_listable(err)} (the run's steps are left out)"
        if problems is None:
            raise RunLogError(message) from None
        problems.append(message)
        return []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        is_segment = _STEP_DIR_RE.match(entry.name) or _CHUNK_DIR_RE.match(entry.name)
        if is_segment and not entry.is_dir():
            if problems is not None:
                problems.append(f"{_shown(entry.path)}: not a folder (ignored)")
            continue
        if m := _STEP_DIR_RE.match(entry.name):
            steps.append((int(m[3], 16), _Segment(entry.path, int(m[2]), int(m[1]), int(m[1]), -1)))
        elif m := _CHUNK_DIR_RE.match(entry.name):
            chunks.append(_Segment(entry.path, int(m[4]), int(m[1]), int(m[2]), int(m[3])))
        elif problems is not None:
            problems.append(f"{_shown(entry.path)}: foreign entry in a run's data folder (ignored)")
    # Newest chunk first; an older chunk overlapping an accepted one was superseded (merge or truncation).
    accepted: list[_Segment] = []
    for c in sorted(chunks, key=lambda c: -c.seq):
        if not any(a.rank == c.rank and a.first <= c.last and c.first <= a.last for a in accepted):
            accepted.append(c)
    covered = {(c.rank, s) for c in accepted for s in range(c.first, c.last + 1)}
    newest: dict[tuple[int, int], _Segment] = {}  # one folder per (rank, step); the newest session wins
    for _, s in sorted(steps, key=lambda t: t[0]):
        if (s.rank, s.first) not in covered:
            newest[(s.rank, s.first)] = s
    live = accepted + list(newest.values())
    return sorted(live, key=lambda s: (s.first, s.rank))


def _read_run_json(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunLogError(f"no run named {run_dir.name!r} in {run_dir.parent} (missing {path})") from None
    except (OSError, ValueError) as err:
        raise RunLogError(f"{path}: damaged run.json ({err})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("schema_version"), int):
        raise RunLogError(f"{path}: not a PolicyLens run.json (no schema_version)")
    if meta["schema_version"] > SCHEMA_VERSION:
        raise RunLogError(
            f"run {run_dir.name!r} was written with run-log schema version {meta['schema_version']}, newer than "
            f"this PolicyLens understands ({SCHEMA_VERSION}); upgrade PolicyLens to read it ({path})"
        )
    return meta


def _effective_status(run_dir: Path, meta: dict) -> str:
    """The stored status, except that a `running` run whose writer is gone is `crashed`."""
    status = meta.get("status", "crashed")
    if status != "running":
        return status
    held = _lock_is_held(run_dir / "writer-rank0.lock") if (run_dir / "writer-rank0.lock").exists() else None
    if held is None:  # cannot probe (other host, no lock file): judge by the heartbeat
        try:
            updated = dt.datetime.fromisoformat(meta["updated_at"])
        except (KeyError, TypeError, ValueError):
            return "crashed"
        return "running" if (_now() - updated).total_seconds() < STALE_AFTER_SECONDS else "crashed"
    return "running" if held else "crashed"


def _parse_time(value: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return None


def _run_info(run_dir: Path, meta: dict, last_step: int | None) -> dict[str, Any]:
    """One row of the `runs` table as a dict (status already corrected for dead writers)."""
    config = meta.get("config")
    return {
        "run": run_dir.name,
        "run_id": str(meta.get("run_id", "")),
        "algorithm": str(meta.get("algorithm", "")),
        "task": str(meta.get("task", "")),
        "created_at": _parse_time(meta.get("created_at")),
        "updated_at": _parse_time(meta.get("updated_at")),
        "status": _effective_status(run_dir, meta),
        "config": config if isinstance(config, dict) else {},
        "model": str(meta.get("model", "")),
        "last_step": last_step,
    }


def last_steps_by_rank(run_dir: str | os.PathLike) -> dict[int, int]:
    """The last complete logged step of each rank that logged any (a resumed data-parallel run checks that every
    rank finished the step it restarts from)."""
    last: dict[int, int] = {}
    for seg in _scan_segments(data_dir_of(Path(run_dir))):
        last[seg.rank] = max(last.get(seg.rank, seg.last), seg.last)
    return last


def list_runs(logs_dir: str | os.PathLike, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The runs under `logs_dir`, oldest first, as dicts with the columns of the `runs` table (`config` as a
    dict, `last_step` the last step on disk). Quick: reads run.json files and folder names, no Parquet.
    The same runs as `RunReader`; unreadable ones are skipped (and described in `problems` if a list is given)."""
    problems = [] if problems is None else problems
    runs = []
    for run_dir in _run_folders(Path(logs_dir), problems):
        try:
            meta = _read_run_json(run_dir)
        except RunLogError as err:
            problems.append(str(err))
            continue
        segments = _scan_segments(data_dir_of(run_dir), problems)
        last = max((s.last for s in segments), default=None)
        runs.append(_run_info(run_dir, meta, last))
    runs.sort(key=lambda r: (r["created_at"] or dt.datetime.min, r["run"]))
    return runs


# ---------------------------------------------------------------- writer


class RunWriter:
    """Appends steps to one run. One writer per (run, rank); readers never block it and it never blocks them.

    Use `RunWriter.create` for a new run and `RunWriter.resume` to continue one; both work as context managers
    (finished on normal exit, stopped on KeyboardInterrupt, crashed on any other exception).
    """

    def __init__(
        self,
        logs_dir: Path,
        name: str,
        rank: int,
        meta: dict,
        lock: _WriterLock,
        compact_every: int = 32,
        background: bool = True,
    ):
        self.logs_dir = Path(logs_dir)
        self.name = name
        self.rank = rank
        self.run_dir = self.logs_dir / name
        self.data_dir = data_dir_of(self.run_dir)
        self.meta = meta
        self.compact_every = compact_every
        self._lock = lock
        self._created_unix = float(meta.get("created_unix") or time.time())
        self._last_log_time: float | None = None
        segments = [s for s in _scan_segments(self.data_dir) if s.rank == rank]
        self.last_step: int | None = max((s.last for s in segments), default=None)
        self._closed = False
        self._meta_lock = threading.Lock()
        # Parquet encoding releases the GIL, so one writer thread overlaps it with the next training step.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"runlog-{name}") if background else None
        self._pending: Future | None = None
        self._superseded: list[tuple[float, list[Path]]] = []  # (when replaced, folders) awaiting deletion
        self._deleter: threading.Thread | None = None  # deletes them after `close`
        # Part of every step folder's name: a step logged again after `truncate_after` gets a new path, so no
        # reader can confuse it with the deleted one (DuckDB caches Parquet footers by path).
        self._session = f"{time.time_ns() // 1000:x}"

    # ---- opening

    @classmethod
    def create(
        cls,
        logs_dir: str | os.PathLike,
        name: str,
        *,
        algorithm: str = "",
        task: str = "",
        config: Mapping[str, Any] | Any = None,
        model: str = "",
        rank: int = 0,
        compact_every: int = 32,
        background: bool = True,
        wait_seconds: float = 60.0,
    ) -> RunWriter:
        """Start a new run (rank 0; error if it exists). Ranks > 0 join the run rank 0 creates (waiting for it)."""
        logs_dir = Path(logs_dir)
        validate_run_name(name, logs_dir)
        _check_rank(rank)
        run_dir = logs_dir / name
        if rank == 0:
            logs_dir.mkdir(parents=True, exist_ok=True)
            if run_dir.exists():
                raise RunLogError(f"run {name!r} already exists in {logs_dir}; pick another name or resume it")
            if dataclasses.is_dataclass(config) and not isinstance(config, type):
                config = dataclasses.asdict(config)
            now = _now()
            meta = {
                "schema_version": SCHEMA_VERSION,
                "name": name,
                "run_id": uuid.uuid4().hex,
                "algorithm": algorithm,
                "task": task,
                "model": model,
                "config": json.loads(json.dumps(dict(config or {}), default=_json_default)),
                "status": "running",
                "created_at": _iso(now),
                "updated_at": _iso(now),
                "created_unix": time.time(),
                "last_step": None,
            }
            # Build the folder under a dot name and rename it into place: a reader never sees a run without
            # run.json, and of two processes creating the same name only one rename succeeds.
            tmp = logs_dir / f".tmp-create-{name}-{uuid.uuid4().hex[:8]}"
            (tmp / "data" / f"run={name}").mkdir(parents=True)  # = data_dir_of(run_dir) once renamed
            _write_json_atomic(tmp / "run.json", meta)
            lock = _WriterLock(tmp / "writer-rank0.lock", name, rank)
            try:
                os.rename(tmp, run_dir)
            except OSError:
                lock.release()
                shutil.rmtree(tmp, ignore_errors=True)
                raise RunLogError(
                    f"run {name!r} already exists in {logs_dir}; pick another name or resume it"
                ) from None
            lock.path = run_dir / lock.path.name
            return cls(logs_dir, name, rank, meta, lock, compact_every, background)
        deadline = time.monotonic() + wait_seconds
        while not (run_dir / "run.json").exists():
            if time.monotonic() > deadline:
                raise RunLogError(f"rank {rank}: run {name!r} was not created by rank 0 within {wait_seconds:.0f} s")
            time.sleep(0.05)
        return cls.resume(logs_dir, name, rank=rank, compact_every=compact_every, background=background)

    @classmethod
    def resume(
        cls,
        logs_dir: str | os.PathLike,
        name: str,
        *,
        rank: int = 0,
        truncate_after: int | None = None,
        compact_every: int = 32,
        background: bool = True,
    ) -> RunWriter:
        """Continue a run after its last complete step (`last_step`), e.g. after a crash.

        `truncate_after=N` first deletes this rank's logged steps > N (restarting from a checkpoint taken at N),
        so the steps logged again replace them instead of duplicating rows.
        """
        logs_dir = Path(logs_dir)
        validate_run_name(name, logs_dir)
        _check_rank(rank)
        run_dir = logs_dir / name
        meta = _read_run_json(run_dir)
        lock = _WriterLock(run_dir / f"writer-rank{rank}.lock", name, rank)
        try:
            data_dir = data_dir_of(run_dir)
            data_dir.mkdir(parents=True, exist_ok=True)
            live = {s.path for s in _scan_segments(data_dir)}
            for entry in os.scandir(data_dir):  # leftovers of a killed writer of this rank
                if entry.name.startswith((".tmp-", ".trash-")) and f".rank{rank}-" in entry.name:
                    shutil.rmtree(entry.path, ignore_errors=True)
                elif (m := _STEP_DIR_RE.match(entry.name) or _CHUNK_DIR_RE.match(entry.name)) and (
                    int(m[2] if m.re is _STEP_DIR_RE else m[4]) == rank and entry.path not in live
                ):
                    _remove_tree(Path(entry.path))  # replaced by a chunk before the crash, not yet deleted
            writer = cls(logs_dir, name, rank, meta, lock, compact_every, background)
            if truncate_after is not None:
                writer.discard_after(truncate_after)
        except BaseException:
            lock.release()
            raise
        if rank == 0:
            writer._update_meta(status="running", last_step=writer.last_step)
        return writer

    def discard_after(self, step: int) -> None:
        """Delete this rank's logged steps > `step` (-1: every step), to log them again from a checkpoint taken at
        `step`; a no-op when nothing was logged after it."""
        self.flush()
        if self.last_step is None or self.last_step <= step:
            return
        _truncate(self.data_dir, self.rank, step, self.name)
        self.last_step = max((s.last for s in _scan_segments(self.data_dir) if s.rank == self.rank), default=None)
        if self.rank == 0:
            self._update_meta(last_step=self.last_step)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("stopped")
        else:
            self.close("crashed")

    # ---- logging

    def log_step(
        self,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        rollouts: Any = None,
        tokens: Any = None,
        token_passes: Any = None,
        prm_steps: Any = None,
        ref_tokens: Any = None,
        *,
        wall_time: float | None = None,
    ) -> None:
        """Write one step (all tables at once, visible to readers atomically). Steps must strictly increase.

        `metrics` fills one `steps` row (contract names as columns, any other key into the JSON `extra` column);
        `step_seconds` defaults to the time since the previous `log_step`. Rank 0 always writes a `steps` row.
        The tables are converted (and checked) here; encoding and writing happen on the writer thread while the
        caller goes on training (`background=False` writes before returning). Call `flush()` to wait.
        """
        if self._closed:
            raise RunLogError(f"run {self.name!r}: log_step after close")
        step = int(step)
        if step < 0:
            raise RunLogError(f"run {self.name!r}: step must be >= 0, got {step}")
        if self.last_step is not None and step <= self.last_step:
            raise RunLogError(
                f"run {self.name!r} rank {self.rank}: step {step} is not after the last logged step {self.last_step}; "
                f"to log steps again from a checkpoint, open the writer with RunWriter.resume(..., "
                f"truncate_after=<checkpoint step>) or call discard_after(<checkpoint step>) first"
            )
        now = time.time()
        if metrics is not None or self.rank == 0:
            metrics = dict(metrics or {})
            if metrics.get("step_seconds") is None and self._last_log_time is not None:
                metrics["step_seconds"] = now - self._last_log_time
        tables = self._step_tables(step, metrics, rollouts, tokens, token_passes, prm_steps, ref_tokens,
                                    wall_time=wall_time, now=now)
        self.last_step = step
        self._last_log_time = now
        self._submit(self._write_step, step, tables)

    def _step_tables(self, step: int, metrics: Mapping[str, Any] | None, rollouts: Any = None, tokens: Any = None,
                     token_passes: Any = None, prm_steps: Any = None, ref_tokens: Any = None, *,
                     wall_time: float | None, now: float) -> dict:
        """One step's tables in the run-log schema (checked and sorted; `steps` only if there are metrics)."""
        tables = {
            "rollouts": _to_arrow("rollouts", rollouts, self.name, step),
            "tokens": _to_arrow("tokens", tokens, self.name, step),
            "token_passes": _to_arrow("token_passes", token_passes, self.name, step),
            "prm_steps": _to_arrow("prm_steps", prm_steps, self.name, step),
            "ref_tokens": _to_arrow("ref_tokens", ref_tokens, self.name, step),
        }
        if metrics is not None:
            metrics = dict(metrics)
            step_seconds = metrics.pop("step_seconds", None)
            wall = wall_time if wall_time is not None else metrics.pop("wall_time", now - self._created_unix)
            tables["steps"] = _steps_row(metrics, self.name, step, wall, step_seconds)
        return tables

    def log_many(self, steps: Sequence[int], tables_of: Callable[[int], Mapping[str, Any]]) -> None:
        """Log many steps at once (bulk import: a run converted from another logger, a benchmark's big run).

        `tables_of(step)` returns the keyword arguments of `log_step` for that step. Each step goes straight into
        the folder where compaction would finally put it: the files are the same as `log_step` for each step
        followed by every merge (`_final_segments`; row groups do not depend on how rows arrived, see
        `_FolderWriter`), but every row is encoded once instead of once per merge level. Not for a live run: steps
        appear chunk by chunk."""
        if self._closed:
            raise RunLogError(f"run {self.name!r}: log_many after close")
        steps = [int(s) for s in steps]
        previous = self.last_step
        for s in steps:
            if s < 0 or (previous is not None and s <= previous):
                raise RunLogError(f"run {self.name!r}: log_many steps must be >= 0 and strictly increasing after "
                                  f"the last logged step {self.last_step}, got {s} after {previous}")
            previous = s
        self.flush()
        mine = [s for s in _scan_segments(self.data_dir) if s.rank == self.rank]
        plan = _final_segments([(s.first, s.last, s.seq) for s in mine], steps, self.compact_every,
                               _next_seq(self.data_dir))
        by_step = iter(steps)
        for first, last, seq in plan:
            if seq < 0:
                folder = _FolderWriter(self.data_dir, self.rank, f"step-{first:09d}")
                final = self.data_dir / f"step-{first:09d}.rank{self.rank}.s{self._session}"
            else:
                folder = _FolderWriter(self.data_dir, self.rank, f"chunk-{first:09d}")
                final = self.data_dir / f"chunk-{first:09d}-{last:09d}-{seq:06d}.rank{self.rank}"
            try:
                absorbed = sorted((s for s in mine if s.first <= last and first <= s.last), key=lambda s: s.first)
                _copy_rows(absorbed, folder)  # segments logged before that this chunk replaces
                for step in by_step:
                    kwargs = dict(tables_of(step))
                    if self.rank == 0:
                        kwargs.setdefault("metrics", {})
                    tables = self._step_tables(step, kwargs.pop("metrics", None), wall_time=kwargs.pop(
                        "wall_time", None), now=time.time(), **kwargs)
                    for table, arrow in tables.items():
                        if arrow is not None:
                            folder.add(table, arrow)
                    if step == last:
                        break
                folder.commit(final)
            except BaseException:
                folder.abort()
                raise
            if absorbed:
                self._superseded.append((time.monotonic(), [Path(s.path) for s in absorbed]))
            self.last_step = last
            if self.rank == 0:
                self._update_meta(last_step=last)

    def flush(self) -> None:
        """Wait until every step passed to `log_step` is on disk (raises if writing one failed)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as err:
                raise RunLogError(f"run {self.name!r}: writing a step failed: {err}") from err

    def set_status(self, status: str) -> None:
        """Record the run's status (only rank 0 writes run.json; other ranks ignore this)."""
        if status not in STATUSES:
            raise RunLogError(f"status must be one of {STATUSES}, got {status!r}")
        self.flush()
        if self.rank == 0:
            self._update_meta(status=status)

    def close(self, status: str = "finished") -> None:
        """Write what is pending, merge the remaining step folders (unless `status` is crashed), record `status`
        and release the writer lock. Safe to call twice.

        The folders a recent merge replaced are deleted by a thread once `_DELETE_GRACE_SECONDS` have passed
        (see `_merge`), so closing does not wait for it; the process exits after that thread."""
        if self._closed:
            return
        try:
            self.flush()
            if status != "crashed" and self.compact_every > 0:
                self._compact_tail()
            self.set_status(status)
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._lock.release()
            if self._superseded:  # not a daemon: exiting waits for it (a kill leaves them to the next resume)
                self._deleter = threading.Thread(target=self._delete_superseded, kwargs={"wait": True},
                                                 name=f"runlog-delete-{self.name}")
                self._deleter.start()

    # ---- internals

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` on the writer thread, at most one step behind: the caller waits for the previous step."""
        self.flush()
        if self._executor is None:
            fn(*args)
        else:
            self._pending = self._executor.submit(fn, *args)

    def _write_step(self, step: int, tables: dict[str, pa.Table | None]) -> None:
        final = self.data_dir / f"step-{step:09d}.rank{self.rank}.s{self._session}"
        folder = _FolderWriter(self.data_dir, self.rank, f"step-{step:09d}")
        try:
            for table, arrow in tables.items():
                if arrow is not None:
                    folder.add(table, arrow)
            folder.commit(final)  # the commit point: the whole step appears at once
        except BaseException:
            folder.abort()
            raise
        if self.rank == 0:
            self._update_meta(last_step=step)
        if self.compact_every > 0:
            self._maybe_compact()
        self._delete_superseded()

    def _update_meta(self, **changes: Any) -> None:
        with self._meta_lock:
            self.meta.update(changes)
            self.meta["updated_at"] = _iso(_now())
            _write_json_atomic(self.run_dir / "run.json", self.meta)

    def _delete_superseded(self, wait: bool = False) -> None:
        """Delete folders replaced by a chunk at least `_DELETE_GRACE_SECONDS` ago (all of them if `wait`)."""
        while self._superseded:
            age = time.monotonic() - self._superseded[0][0]
            if age < _DELETE_GRACE_SECONDS:
                if not wait:
                    return
                time.sleep(_DELETE_GRACE_SECONDS - age)
            for path in self._superseded.pop(0)[1]:
                _remove_tree(path)

    def _compact_tail(self) -> None:
        """Merge this rank's remaining step folders into one chunk when the run closes: a finished run is then
        read from a few files instead of up to `compact_every` more (listing 200 finished runs of 40 steps
        opens 400 steps files instead of 1,800). Resuming later merges the way it always does."""
        steps = [s for s in _scan_segments(self.data_dir) if s.rank == self.rank and not s.is_chunk]
        if len(steps) > 1:
            _merge(self.data_dir, steps, self.rank, _next_seq(self.data_dir))
            self._superseded.append((time.monotonic(), [Path(s.path) for s in steps]))

    def _maybe_compact(self) -> None:
        """Merge this rank's step folders into a chunk once there are `compact_every` of them, and every
        `_MERGE_FAN_IN` chunks of one size into one larger chunk, so the number of files (what a query pays
        for) grows with the logarithm of the number of steps (the rule: `_next_merge`)."""
        while True:
            segments = [s for s in _scan_segments(self.data_dir) if s.rank == self.rank]
            picked = _next_merge([(s.first, s.last, s.seq) for s in segments], self.compact_every)
            if picked is None:
                return
            group = [s for s in segments if (s.first, s.last, s.seq) in picked]
            _merge(self.data_dir, group, self.rank, _next_seq(self.data_dir))
            self._superseded.append((time.monotonic(), [Path(s.path) for s in group]))


def _next_merge(segments: Sequence[tuple[int, int, int]], compact_every: int) -> list[tuple[int, int, int]] | None:
    """Which of one rank's live segments (first, last, seq; seq < 0 for a step folder) to merge next, or None:
    all step folders once there are `compact_every` of them, else `_MERGE_FAN_IN` chunks of one level (a
    level-k chunk spans at least compact_every * FAN_IN**k steps, less than FAN_IN times that)."""
    if compact_every <= 0:
        return None
    steps = [s for s in segments if s[2] < 0]
    if len(steps) >= compact_every:
        return steps
    by_level: dict[int, list[tuple[int, int, int]]] = {}
    for c in (s for s in segments if s[2] >= 0):
        level, size = 0, compact_every * _MERGE_FAN_IN
        while c[1] - c[0] + 1 >= size:
            level, size = level + 1, size * _MERGE_FAN_IN
        by_level.setdefault(level, []).append(c)
    full = [group for group in by_level.values() if len(group) >= _MERGE_FAN_IN]
    return full[0] if full else None


def _final_segments(existing: Sequence[tuple[int, int, int]], steps: Sequence[int], compact_every: int,
                    next_seq: int) -> list[tuple[int, int, int]]:
    """The segments (first, last, seq) holding `steps` after logging them one by one with `log_step` on top of
    `existing`, merging after each (`_next_merge`): the plan `RunWriter.log_many` writes directly. Segments of
    `existing` that a merge absorbs are absorbed into the returned one."""
    live = list(existing)
    for step in steps:
        live.append((step, step, -1))
        while (picked := _next_merge(live, compact_every)) is not None:
            live = [s for s in live if s not in picked]
            live.append((min(p[0] for p in picked), max(p[1] for p in picked), next_seq))
            next_seq += 1
    new = [s for s in live if s not in existing]
    return sorted(new, key=lambda s: s[0])


_MERGE_FAN_IN = 8
# A reader lists a data folder with readdir, which is not a snapshot: an entry added or removed during the
# listing may or may not be returned. Deleting the folders a chunk replaces only this long after the chunk
# appeared means no listing can both miss the new chunk and miss the old folders.
_DELETE_GRACE_SECONDS = 1.0
# Strings and small integer keys repeat a lot; floats (log-probs, ratios) almost never do, and trying a
# dictionary for them first costs time and bytes.
_DICTIONARY_COLUMNS = ["run", "step", "kind", "filter_reason", "token_text", "pass", "clip", "prompt", "answer",
                       "answer_class"]
_DELTA_COLUMNS = ["rollout_id", "position", "token_id", "group_id", "index_in_group", "prompt_id", "length",
                  "step_index", "first_pos", "last_pos", "prm_step"]


def _column_options(schema: pa.Schema) -> dict[str, Any]:
    """Encodings per column: dictionary for repeating strings and small keys; BYTE_STREAM_SPLIT for floats
    (their bytes grouped by significance, which zstd compresses ~7% better: log-probs share exponents);
    DELTA_BINARY_PACKED for the sorted or small integers (rollout_id, position: ~0.05 bytes a row instead of
    ~1.3). The logical types, and so the values read back, are unchanged."""
    names = set(schema.names)
    encodings = {f.name: "BYTE_STREAM_SPLIT" for f in schema if pa.types.is_floating(f.type)}
    encodings.update({c: "DELTA_BINARY_PACKED" for c in _DELTA_COLUMNS if c in names})
    return {"use_dictionary": [c for c in _DICTIONARY_COLUMNS if c in names], "column_encoding": encodings}


def _row_group_rows(table: str) -> int:
    """Rows per row group of a table's files (see `_TOKEN_ROW_GROUP_FACTOR`); rollouts keep smaller groups,
    their completions make a row hundreds of bytes, and a merge buffers one group per table."""
    return _ROW_GROUP_ROWS * (_TOKEN_ROW_GROUP_FACTOR if table in ("tokens", "token_passes") else 1)


class _FolderWriter:
    """Writes one step or chunk folder under a ``.tmp-`` name: one Parquet file per table, sorted as given,
    in row groups of exactly `_row_group_rows` rows (the last of each part of `_SEPARATE_ROW_GROUPS` shorter)
    whatever the sizes of the pieces added,
    so a folder's files depend only on its rows: a chunk merged from steps, or from chunks, or written
    directly by `RunWriter.log_many` is the same file. Memory: at most one row group per table buffered."""

    def __init__(self, data_dir: Path, rank: int, label: str):
        self.tmp = data_dir / f".tmp-{label}.rank{rank}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._pending: dict[str, pa.Table] = {}

    def add(self, table: str, arrow: pa.Table) -> None:
        if table in _SEPARATE_ROW_GROUPS:  # e.g. eval rollouts in row groups of their own, see there
            column, value = _SEPARATE_ROW_GROUPS[table]
            matches = pc.fill_null(pc.equal(arrow[column], value), False)
            self._add(table, arrow.filter(matches))
            self._add(f"{table}+", arrow.filter(pc.invert(matches)))
        else:
            self._add(table, arrow)

    def _add(self, bucket: str, arrow: pa.Table) -> None:
        pending = self._pending.get(bucket)
        pending = arrow if pending is None else pa.concat_tables([pending, arrow])
        size = _row_group_rows(bucket.rstrip("+"))
        while pending.num_rows >= size:
            self._write(bucket.rstrip("+"), pending.slice(0, size))
            pending = pending.slice(size)
        self._pending[bucket] = pending

    def _write(self, table: str, rows: pa.Table) -> None:
        writer = self._writers.get(table)
        if writer is None:
            schema = TABLE_SCHEMAS[table]
            writer = self._writers[table] = pq.ParquetWriter(
                self.tmp / f"{table}.parquet", schema, compression="zstd", **_column_options(schema))
        writer.write_table(rows, row_group_size=_row_group_rows(table))

    def commit(self, final: Path) -> None:
        """Close the files and rename the folder into place (the moment readers see it)."""
        for bucket, rest in self._pending.items():
            if rest.num_rows:
                self._write(bucket.rstrip("+"), rest)
        for writer in self._writers.values():
            writer.close()
        os.rename(self.tmp, final)

    def abort(self) -> None:
        for writer in self._writers.values():
            with contextlib.suppress(Exception):
                writer.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _next_seq(data_dir: Path) -> int:
    return 1 + max((int(m[3]) for e in os.scandir(data_dir) if (m := _CHUNK_DIR_RE.match(e.name))), default=-1)


def _merge(data_dir: Path, segments: Sequence[_Segment], rank: int, seq: int, keep_up_to: int | None = None) -> None:
    """Write the rows of `segments` (optionally only steps <= keep_up_to) as one chunk; the caller deletes
    `segments` later (see `_DELETE_GRACE_SECONDS`).

    Streams row groups through a `_FolderWriter` so memory stays bounded by a few row groups, whatever the size.
    """
    segments = sorted(segments, key=lambda s: s.first)
    first = segments[0].first
    last = max(s.last for s in segments) if keep_up_to is None else keep_up_to
    folder = _FolderWriter(data_dir, rank, f"chunk-{first:09d}")
    try:
        _copy_rows(segments, folder, keep_up_to)
        folder.commit(data_dir / f"chunk-{first:09d}-{last:09d}-{seq:06d}.rank{rank}")
    except BaseException:
        folder.abort()
        raise


def _copy_rows(segments: Sequence[_Segment], folder: _FolderWriter, keep_up_to: int | None = None) -> None:
    """Append the rows of `segments` (in step order) to `folder`, a row group at a time."""
    for table in DATA_TABLES:
        # Segments are in step order and each file is sorted by the table's keys, so appending keeps the
        # chunk sorted: no re-sort needed.
        for part in (Path(s.path) / f"{table}.parquet" for s in segments):
            if not part.exists():
                continue
            source = pq.ParquetFile(part)
            for i in range(source.num_row_groups):
                piece = _with_added_columns(source.read_row_group(i), table)
                if keep_up_to is not None:
                    piece = piece.filter(pc.less_equal(piece["step"], keep_up_to))
                folder.add(table, piece)


def _with_added_columns(piece: pa.Table, table: str) -> pa.Table:
    """A row group of a file written before `_ADDED_COLUMNS`, in the current schema (new columns NULL)."""
    schema = TABLE_SCHEMAS[table]
    if piece.schema.names == schema.names:
        return piece
    n = piece.num_rows
    columns = [piece.column(f.name) if f.name in piece.column_names else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _truncate(data_dir: Path, rank: int, keep_up_to: int, name: str) -> None:
    """Delete rank `rank`'s logged steps > keep_up_to (see `RunWriter.resume`)."""
    segments = [s for s in _scan_segments(data_dir) if s.rank == rank]
    # Step folders first: they may be covered by a chunk and would otherwise reappear once the chunk goes.
    for entry in os.scandir(data_dir):
        m = _STEP_DIR_RE.match(entry.name)
        if m and int(m[2]) == rank and int(m[1]) > keep_up_to:
            _remove_tree(Path(entry.path))
    seq = _next_seq(data_dir)
    for s in segments:
        if s.is_chunk and s.first > keep_up_to:
            _remove_tree(Path(s.path))
        elif s.is_chunk and s.last > keep_up_to:
            _merge(data_dir, [s], rank, seq, keep_up_to=keep_up_to)
            _remove_tree(Path(s.path))  # at resume, before logging goes on: a reader's listing may be off briefly
            seq += 1


# ---------------------------------------------------------------- reader


_DUCKDB_TYPES = {
    pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN",
    pa.int8(): "TINYINT", pa.list_(pa.float64()): "DOUBLE[]", pa.timestamp("us"): "TIMESTAMP",
}


def _duckdb_type(arrow_type: pa.DataType) -> str:
    return _DUCKDB_TYPES[arrow_type]


def _check_file(path: str, table: str) -> str | None:
    """Cheap validation (footer + schema) before a file enters a view, so one bad file cannot break every query.

    None: valid; `_LEGACY`: valid, written before `_ADDED_COLUMNS`; any other string: what is wrong."""
    try:
        schema = pq.read_schema(path)
    except FileNotFoundError:
        return None  # vanished: the view rebuild notices
    except Exception as err:  # pyarrow raises several types for garbage
        return f"damaged or not a Parquet file ({type(err).__name__}: {err})"
    schema = schema.remove_metadata()
    if schema.equals(TABLE_SCHEMAS[table]):
        return None
    if table in _LEGACY_SCHEMAS and _is_legacy(schema, table):
        return _LEGACY
    return f"not a {table} file of this schema (columns {schema.names})"


def _is_legacy(schema: pa.Schema, table: str) -> bool:
    """Written before some of `_ADDED_COLUMNS`: every older column, then some of the added ones, in schema order."""
    remaining = iter(TABLE_SCHEMAS[table])
    return (set(_LEGACY_SCHEMAS[table].names) <= set(schema.names)
            and all(any(field.equals(current) for current in remaining) for field in schema))


_LEGACY = "legacy"
"""`_check_file`'s answer for a valid file written before `_ADDED_COLUMNS` (readable, new columns NULL)."""


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


def _columns_ddl(schema: pa.Schema) -> str:
    return ", ".join(f'"{f.name}" {_duckdb_type(f.type)}' for f in schema)


def _parquet_source(table: str, paths: list[str], legacy: bool, empty: str) -> str:
    """SQL reading `table`'s columns from these files (explicit columns: a `key=value` folder above the logs
    folder would otherwise add a column). `legacy`: some files predate `_ADDED_COLUMNS`; a by-name union with
    `empty`, a table of the current schema and no rows, reads those columns of theirs as NULL."""
    listing = ", ".join(_sql_str(p) for p in paths)
    columns = ", ".join(f'"{name}"' for name in TABLE_SCHEMAS[table].names)
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
    Thread-safe: calls are serialised by a lock.
    """

    def __init__(self, logs_dir: str | os.PathLike, runs: str | Iterable[str] | None = None, unsafe: bool = False,
                 memory_limit: str | None = None, tables: Iterable[str] | None = None):
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
        self.problems: list[str] = []
        self._lock = threading.RLock()
        self._segments: dict[str, tuple[list, list[str]]] = {}  # folder -> ([(table, path)], problems)
        self._seen_segments: set[str] = set()
        self._quarantined: dict[str, str] = {}
        self._verified: set[str] = set()  # files every page of which was decoded once (see `_find_damaged`)
        self._legacy_files: set[str] = set()  # valid files without `_ADDED_COLUMNS` (see `_create_view`)
        self._meta_cache: dict[str, tuple[int, int, dict]] = {}
        self._listings: dict[str, tuple[tuple[int, int], list[_Segment], list[str]]] = {}  # see `_segments_of`
        if self.logs_dir.exists() and not self.logs_dir.is_dir():
            raise _logs_dir_error(self.logs_dir, NotADirectoryError())
        if self.only is not None:
            for name in self.only:  # fail early and clearly for a run asked for by name
                _read_run_json(self.logs_dir / name)
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
        for table, schema in {**TABLE_SCHEMAS, "runs": RUNS_SCHEMA}.items():
            con.execute(f"CREATE OR REPLACE TABLE _runlog.empty_{table} ({_columns_ddl(schema)})")

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

    def rows(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> tuple[list[str], list]:
        """Like `sql` but returns (column names, list of row tuples), without pandas."""
        return self._run(query, params, lambda result: ([d[0] for d in result.description], result.fetchall()))

    def runs_overview(self, as_rows: bool = False) -> pd.DataFrame | tuple[list[str], list]:
        """Every run, oldest first: run, status, algorithm, task, model, last_step, steps_logged and the latest
        held-out accuracy with its step (heldout_accuracy, heldout_step), created_at, updated_at, config."""
        return self.rows(_RUNS_OVERVIEW_SQL) if as_rows else self.sql(_RUNS_OVERVIEW_SQL)

    def _run(self, query: str, params: Any, fetch: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        with self._lock:
            writes = self._check_statements(query)
            self.refresh()
            for attempt in range(4):
                try:
                    return fetch(self._con.execute(query, params))
                except duckdb.PermissionException as err:
                    if self.unsafe:
                        raise
                    raise RunLogError(f"{str(err).splitlines()[0]}: {_READ_ONLY_RULE}") from err
                except duckdb.Error as err:
                    if attempt == 3 or not self._handle_file_error(err):
                        raise
                finally:
                    if writes:  # unsafe mode: a statement may have dropped or replaced a table: rebuild them all
                        self._create_internal_tables(self._con)
                        self._views, self._runs_rows = {}, None
                        self.refresh()
            raise AssertionError("unreachable")

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
        files: dict[str, list[str]] = {t: [] for t in DATA_TABLES}
        runs_rows = []
        self._seen_segments = set()
        for run_dir in self._run_dirs(problems):
            try:
                meta = self._meta(run_dir)
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
            info = _run_info(run_dir, meta, last)
            info["config"] = json.dumps(info["config"])
            runs_rows.append(tuple(info[name] for name in RUNS_SCHEMA.names))
        problems.extend(f"{_shown(path)}: {msg} (skipped)" for path, msg in self._quarantined.items())
        for gone in self._segments.keys() - self._seen_segments:  # compacted away: forget
            del self._segments[gone]
        return problems, files, runs_rows

    def _segments_of(self, data_dir: Path, problems: list[str]) -> list[_Segment]:
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
        segments = _scan_segments(data_dir, found)
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
        return _run_folders(self.logs_dir, problems)

    def _meta(self, run_dir: Path) -> dict:
        path = run_dir / "run.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            raise RunLogError(f"no run named {run_dir.name!r} in {run_dir.parent} (missing {path})") from None
        key = str(path)
        cached = self._meta_cache.get(key)
        if cached and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        meta = _read_run_json(run_dir)
        self._meta_cache[key] = (st.st_size, st.st_mtime_ns, meta)
        return meta

    def _collect(self, seg: _Segment, files: dict[str, list[str]], problems: list[str]) -> bool:
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
                entries, cached = [], ([], [f"{_shown(seg.path)}: {_not_listable(err)} (skipped)"])
            found, notes = [], []
            for entry in entries:
                table = entry.name[: -len(".parquet")] if entry.name.endswith(".parquet") else None
                if table not in TABLE_SCHEMAS:
                    notes.append(f"{_shown(entry.path)}: foreign file in a step folder (ignored)")
                elif table not in self.tables:
                    continue
                elif (problem := _check_file(entry.path, table)) not in (None, _LEGACY):
                    notes.append(f"{_shown(entry.path)}: {problem} (skipped)")
                else:
                    found.append((table, entry.path))
                    if problem == _LEGACY:
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
        self._con.execute(f"CREATE OR REPLACE VIEW {table} AS {source}")
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
            try:
                self._con.execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?)", [path]).fetchall()
            except duckdb.Error as file_err:
                if not self._connection_usable():
                    self._con = self._connect()
                if not os.path.exists(path):  # compacted away meanwhile: the refresh after this drops it
                    found = True
                    continue
                self._quarantine(path, f"damaged data pages (DuckDB: {str(file_err).splitlines()[0] or error})")
                found = True
            else:
                self._verified.add(path)
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
                        for table in DATA_TABLES:
                            out.execute(f"CREATE TABLE {table} ({_columns_ddl(TABLE_SCHEMAS[table])})")
                            if paths := self._views[table]:
                                out.execute(f"CREATE TEMP TABLE empty_{table} AS FROM {table} LIMIT 0")
                                legacy = not self._legacy_files.isdisjoint(paths)
                                out.execute(f"INSERT INTO {table} "
                                            f"{_parquet_source(table, paths, legacy, f'empty_{table}')}")
                        out.execute(f"CREATE TABLE runs ({_columns_ddl(RUNS_SCHEMA)})")
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
