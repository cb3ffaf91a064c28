"""Where a run lives on disk: run names, paths, the step and chunk folders, writer locks, and run.json.

Everything that knows a path or a folder name of the run log is here (see the package docstring for the layout).
`RunInfo` is run.json: the one place it is read (`RunInfo.read`) and written (`RunInfo.write`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:  # POSIX only; elsewhere crash detection falls back to the heartbeat age
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

SCHEMA_VERSION = 1  # of the whole layout: run.json, folder names and the tables' files
STATUSES = ("running", "finished", "stopped", "crashed")
STALE_AFTER_SECONDS = 15 * 60
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
RUN_NAME_RULE = (
    "1 to 100 characters: letters, digits, '.', '_' or '-', starting with a letter or digit, "
    "without '..' and not ending with '.'"
)
_RUN_NAME_RE = re.compile(RUN_NAME_PATTERN)  # always used with fullmatch: `$` also matches before a final newline
_WINDOWS_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
RUN_JSON = "run.json"
# The engine's TrainConfig names the algorithm `algo`; run.json stores it once, as `algorithm` (see `RunInfo`).
CONFIG_ALGORITHM_KEY = "algo"

STEP_DIR_RE = re.compile(r"^step-(\d{9})\.rank(\d+)\.s([0-9a-f]+)$")
CHUNK_DIR_RE = re.compile(r"^chunk-(\d{9})-(\d{9})-(\d{6})\.rank(\d+)$")


class RunLogError(Exception):
    """A run, a file or an argument of the run log is missing, damaged, foreign or invalid."""


# ---------------------------------------------------------------- names


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


def check_rank(rank: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise RunLogError(f"rank must be an integer >= 0, got {rank!r}")


def shown(path: str | os.PathLike) -> str:
    """A path for a one-line message: control characters (a newline in a folder name) written as escapes."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m[0])[1:-1], str(path))


def not_listable(err: OSError) -> str:
    return "not a folder" if isinstance(err, NotADirectoryError) else f"cannot be listed ({err.strerror})"


def logs_dir_error(logs_dir: Path, err: OSError) -> RunLogError:
    return RunLogError(f"{shown(logs_dir)} is {not_listable(err)}: the logs folder holds one folder per run")


# ---------------------------------------------------------------- paths


def data_dir_of(run_dir: Path) -> Path:
    """Where a run's step and chunk folders live: ``<run>/data/run=<name>``. The redundant ``run=<name>`` is a
    Hive-style partition key: DuckDB reads it from the path and skips other runs' files without opening them
    (a query for one rollout over 20 runs: ~30 ms instead of ~100 ms)."""
    return run_dir / "data" / f"run={run_dir.name}"


def lock_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"writer-rank{rank}.lock"


def step_dir(data_dir: Path, step: int, rank: int, session: str) -> Path:
    """A step folder; `session` names the writer session (a step logged again after truncation gets a new path,
    so no reader can confuse it with the deleted one: DuckDB caches Parquet footers by path)."""
    return data_dir / f"step-{step:09d}.rank{rank}.s{session}"


def chunk_dir(data_dir: Path, first: int, last: int, seq: int, rank: int) -> Path:
    return data_dir / f"chunk-{first:09d}-{last:09d}-{seq:06d}.rank{rank}"


def rank_of_segment_name(name: str) -> int | None:
    """The rank of a step or chunk folder's name, None for any other name."""
    if m := STEP_DIR_RE.match(name):
        return int(m[2])
    if m := CHUNK_DIR_RE.match(name):
        return int(m[4])
    return None


def run_folders(logs_dir: Path, problems: list[str]) -> list[Path]:
    """The run folders directly inside `logs_dir`, by name: the one definition of what is a run, shared by
    `list_runs` and `RunReader`. A folder that is not a run (bad name, symlink out of the logs folder, no
    run.json) is described in `problems`; dot names (in progress, caches) and plain files are passed over."""
    try:
        entries = sorted(os.scandir(logs_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise logs_dir_error(logs_dir, err) from None
    runs = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:  # only a symlink can lead outside the logs folder; resolving every run's path on each refresh is slow
            validate_run_name(entry.name, logs_dir if entry.is_symlink() else None)
        except RunLogError as err:
            problems.append(f"{shown(entry.path)}: not a run ({shown(err)}) (ignored)")
            continue
        if not os.path.isfile(os.path.join(entry.path, RUN_JSON)):
            problems.append(f"{shown(entry.path)}: not a run folder, no run.json (ignored)")
        else:
            runs.append(Path(entry.path))
    return runs


def remove_tree(path: Path) -> None:
    """Delete a folder so that readers see it vanish at once: rename to a dot name first, then delete."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def json_default(value: Any) -> Any:
    """`json.dumps`'s fallback for what loggers hand in: dataclasses, numpy / torch scalars, else the text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


# ---------------------------------------------------------------- what is on disk


@dataclasses.dataclass(frozen=True)
class Segment:
    """One step folder or one chunk folder of one rank."""

    path: str
    rank: int
    first: int
    last: int
    seq: int  # -1 for a step folder; chunks: higher is newer

    @property
    def is_chunk(self) -> bool:
        return self.seq >= 0


def scan_segments(data_dir: Path, problems: list[str] | None = None) -> list[Segment]:
    """The folders of `data_dir` that hold live data, with superseded ones (older chunks, compacted steps) removed."""
    steps, chunks = [], []
    try:
        entries = list(os.scandir(data_dir))
    except FileNotFoundError:
        return []
    except OSError as err:  # a file where the folder belongs, or no permission
        message = f"{shown(data_dir)}: {not_listable(err)} (the run's steps are left out)"
        if problems is None:
            raise RunLogError(message) from None
        problems.append(message)
        return []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        is_segment = STEP_DIR_RE.match(entry.name) or CHUNK_DIR_RE.match(entry.name)
        if is_segment and not entry.is_dir():
            if problems is not None:
                problems.append(f"{shown(entry.path)}: not a folder (ignored)")
            continue
        if m := STEP_DIR_RE.match(entry.name):
            steps.append((int(m[3], 16), Segment(entry.path, int(m[2]), int(m[1]), int(m[1]), -1)))
        elif m := CHUNK_DIR_RE.match(entry.name):
            chunks.append(Segment(entry.path, int(m[4]), int(m[1]), int(m[2]), int(m[3])))
        elif problems is not None:
            problems.append(f"{shown(entry.path)}: foreign entry in a run's data folder (ignored)")
    # Newest chunk first; an older chunk overlapping an accepted one was superseded (merge or truncation).
    accepted: list[Segment] = []
    for c in sorted(chunks, key=lambda c: -c.seq):
        if not any(a.rank == c.rank and a.first <= c.last and c.first <= a.last for a in accepted):
            accepted.append(c)
    covered = {(c.rank, s) for c in accepted for s in range(c.first, c.last + 1)}
    newest: dict[tuple[int, int], Segment] = {}  # one folder per (rank, step); the newest session wins
    for _, s in sorted(steps, key=lambda t: t[0]):
        if (s.rank, s.first) not in covered:
            newest[(s.rank, s.first)] = s
    live = accepted + list(newest.values())
    return sorted(live, key=lambda s: (s.first, s.rank))


def next_seq(data_dir: Path) -> int:
    """The sequence number of the next chunk of `data_dir` (the newest chunk wins an overlap)."""
    return 1 + max((int(m[3]) for e in os.scandir(data_dir) if (m := CHUNK_DIR_RE.match(e.name))), default=-1)


def last_steps_by_rank(run_dir: str | os.PathLike) -> dict[int, int]:
    """The last complete logged step of each rank that logged any (a resumed data-parallel run checks that every
    rank finished the step it restarts from)."""
    last: dict[int, int] = {}
    for seg in scan_segments(data_dir_of(Path(run_dir))):
        last[seg.rank] = max(last.get(seg.rank, seg.last), seg.last)
    return last


# ---------------------------------------------------------------- locks (crash detection)


def lock_is_held(path: Path) -> bool | None:
    """True if a live process holds the writer lock, False if not, None if this cannot be told from here."""
    if fcntl is None:
        return None
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if info.get("host") not in (None, socket.gethostname()):
        return None  # flock does not tell about processes on other machines
    try:
        fd = os.open(path, os.O_RDONLY)
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


class WriterLock:
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


# ---------------------------------------------------------------- run.json


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _iso(t: dt.datetime) -> str:
    return t.isoformat(timespec="microseconds")


def _parse_time(value: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass
class RunInfo:
    """A run's run.json: what the run is (name, algorithm, task, model, config) and how it stands (status, times,
    last step). Rank 0's writer replaces the file atomically on every change.

    The algorithm is stored once, as `algorithm`: the engine's TrainConfig field of the same fact
    (`CONFIG_ALGORITHM_KEY`) is left out of `config` (`train_config` puts it back). run.json files written before
    that hold both; they are read the same way.
    """

    name: str
    run_id: str = ""
    algorithm: str = ""
    task: str = ""
    model: str = ""
    config: dict = dataclasses.field(default_factory=dict)
    status: str = "running"
    created_at: str = ""  # ISO, UTC
    updated_at: str = ""  # ISO, UTC: the heartbeat of a writer on another host (see `effective_status`)
    created_unix: float | None = None  # wall_time's origin
    last_step: int | None = None
    schema_version: int = SCHEMA_VERSION
    other: dict = dataclasses.field(default_factory=dict)  # keys this release does not know, written back as read

    @classmethod
    def new(cls, name: str, *, algorithm: str = "", task: str = "", model: str = "",
            config: Mapping[str, Any] | Any = None) -> RunInfo:
        """A new run's info (running, created now); `config` a mapping or a dataclass, stored as JSON values."""
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.asdict(config)
        config = json.loads(json.dumps(dict(config or {}), default=json_default))
        now = _iso(utc_now())
        return cls(name=name, run_id=uuid.uuid4().hex, algorithm=algorithm, task=task, model=model,
                   config=_without_algorithm(config, algorithm), created_at=now, updated_at=now,
                   created_unix=time.time())

    @classmethod
    def read(cls, run_dir: Path) -> RunInfo:
        """The run.json of `run_dir`; `RunLogError` if it is missing, damaged, not ours, or of a newer schema."""
        path = run_dir / RUN_JSON
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
        return cls.from_json(meta, run_dir.name)

    @classmethod
    def from_json(cls, meta: Mapping[str, Any], name: str) -> RunInfo:
        """From run.json's object, tolerant of odd values (a run.json edited by hand still lists)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"other"}
        config = meta.get("config")
        config = dict(config) if isinstance(config, Mapping) else {}
        algorithm = meta.get("algorithm") or config.get(CONFIG_ALGORITHM_KEY) or ""
        last_step = meta.get("last_step")
        created_unix = meta.get("created_unix")
        return cls(
            name=name, run_id=str(meta.get("run_id", "")), algorithm=str(algorithm), task=str(meta.get("task", "")),
            model=str(meta.get("model", "")), config=_without_algorithm(config, str(algorithm)),
            status=str(meta.get("status", "crashed")), created_at=str(meta.get("created_at", "")),
            updated_at=str(meta.get("updated_at", "")),
            created_unix=float(created_unix) if isinstance(created_unix, int | float) else None,
            last_step=last_step if isinstance(last_step, int) else None,
            schema_version=int(meta["schema_version"]),
            other={k: v for k, v in meta.items() if k not in known},
        )

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "other"}
        return {**self.other, **fields}

    def write(self, run_dir: Path) -> None:
        """Replace `run_dir`'s run.json (atomically: a reader sees the old file or the new one)."""
        write_json_atomic(run_dir / RUN_JSON, self.to_json())

    def touch(self, **changes: Any) -> None:
        """Apply `changes` (status, last_step) and stamp `updated_at` (the caller writes the file)."""
        for key, value in changes.items():
            setattr(self, key, value)
        self.updated_at = _iso(utc_now())

    def train_config(self) -> dict[str, Any]:
        """The config with the algorithm under the engine's TrainConfig key: what `TrainConfig.from_dict` takes
        to resume the run."""
        return {CONFIG_ALGORITHM_KEY: self.algorithm, **self.config} if self.algorithm else dict(self.config)

    def effective_status(self, run_dir: Path) -> str:
        """The stored status, except that a `running` run whose writer is gone is `crashed`."""
        if self.status != "running":
            return self.status
        lock = lock_path(run_dir, 0)
        held = lock_is_held(lock) if lock.exists() else None
        if held is None:  # cannot probe (other host, no lock file): judge by the heartbeat
            updated = _parse_time(self.updated_at)
            if updated is None:
                return "crashed"
            return "running" if (utc_now() - updated).total_seconds() < STALE_AFTER_SECONDS else "crashed"
        return "running" if held else "crashed"

    def runs_row(self, run_dir: Path, last_step: int | None) -> dict[str, Any]:
        """One row of the `runs` table as a dict (status corrected for dead writers, `config` a dict)."""
        return {
            "run": run_dir.name, "run_id": self.run_id, "algorithm": self.algorithm, "task": self.task,
            "created_at": _parse_time(self.created_at), "updated_at": _parse_time(self.updated_at),
            "status": self.effective_status(run_dir), "config": self.config, "model": self.model,
            "last_step": last_step,
        }


def _without_algorithm(config: dict, algorithm: str) -> dict:
    """`config` without the engine's copy of the algorithm when it says the same as `algorithm`."""
    if algorithm and config.get(CONFIG_ALGORITHM_KEY) == algorithm:
        return {k: v for k, v in config.items() if k != CONFIG_ALGORITHM_KEY}
    return config


def list_runs(logs_dir: str | os.PathLike, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The runs under `logs_dir`, oldest first, as dicts with the columns of the `runs` table (`config` as a
    dict, `last_step` the last step on disk). Quick: reads run.json files and folder names, no Parquet.
    The same runs as `RunReader`; unreadable ones are skipped (and described in `problems` if a list is given)."""
    problems = [] if problems is None else problems
    runs = []
    for run_dir in run_folders(Path(logs_dir), problems):
        try:
            info = RunInfo.read(run_dir)
        except RunLogError as err:
            problems.append(str(err))
            continue
        segments = scan_segments(data_dir_of(run_dir), problems)
        last = max((s.last for s in segments), default=None)
        runs.append(info.runs_row(run_dir, last))
    runs.sort(key=lambda r: (r["created_at"] or dt.datetime.min, r["run"]))
    return runs
