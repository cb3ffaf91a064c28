"""What every importer shares: the report, a step read from a dump, file listing and line-by-line JSONL reading.

A damaged file or line costs only itself (issue 23): JSONL files are decoded and parsed line by line, a line that
is not UTF-8, not JSON or of the wrong shape is reported as `file:line` and skipped, and the other lines are read.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_local = threading.local()


def duckdb_connection():
    """This thread's in-memory DuckDB connection for reading dumps (opening one costs ~15-30 ms, three times a
    step: a quarter of reading a 1000-sample step's JSON). Whoever registers a table on it unregisters it."""
    con = getattr(_local, "con", None)
    if con is None:
        import duckdb

        con = _local.con = duckdb.connect()
    return con


SETTLE_SECONDS = 2.0
"""In follow mode the newest file is imported only once it is this old (the trainer may still be writing it)."""


@dataclass
class ImportReport:
    """What one import pass did: steps written, steps already in the run, problems (file and line)."""

    run: str
    imported: list[int] = field(default_factory=list)
    already_there: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Step:
    """One step read from a dump: its rollouts (dict of columns or Arrow table), optionally its tokens (then the
    importer does not tokenize the text) and what goes into `steps.extra`; `metrics` overrides the computed ones."""

    step: int
    rollouts: Any
    extra: dict[str, Any]
    tokens: Any = None
    metrics: dict[str, Any] | None = None


@dataclass
class ReadContext:
    """What a format reader gets: the report to add problems to, whether the newest files may still be growing
    (follow mode), the token texts of `--tokenizer` (None without it) and the last step already imported."""

    report: ImportReport
    settle: bool = False
    token_text: Any = None
    after: int | None = None  # the run's last imported step: a reader may skip reading earlier steps


def run_name_from_folder(folder: str | os.PathLike) -> str:
    """A valid run name from a folder's name (characters outside the run-name rule become '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(folder)).resolve().name).strip(".-_") or "imported-run"
    return re.sub(r"\.{2,}", ".", name)[:100].rstrip(".")


def numbered_files(folder: Path, pattern: re.Pattern, settle: bool) -> list[tuple[int, Path]]:
    """(number, path) of the entries of `folder` whose name matches `pattern` (group 1: the number), by number;
    with `settle`, without a newest entry changed less than SETTLE_SECONDS ago (still being written)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = sorted((int(m[1]), folder / name) for name in names if (m := pattern.match(name)))
    if settle and found and time.time() - newest_change(found[-1][1]) < SETTLE_SECONDS:
        found = found[:-1]
    return found


def newest_change(path: Path) -> float:
    """The mtime of a file, or of the newest file inside a folder (a step folder of several rank files)."""
    times = [path.stat().st_mtime]
    if path.is_dir():
        times += [entry.stat().st_mtime for entry in os.scandir(path)]
    return max(times)


def jsonl_lines(path: Path, report: ImportReport, shown: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each line of a JSONL file that decodes as UTF-8 and parses as a JSON object.

    Every other line (a byte that is not UTF-8, a truncated or foreign line) is reported as `file:line` and
    skipped: one damaged line costs only itself. An unreadable file is reported once."""
    shown = shown or str(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        report.problems.append(f"{shown}: unreadable ({err.strerror or err}); skipped")
        return
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            report.problems.append(f"{shown}:{number}: not UTF-8 text (byte {err.start}); line skipped")
            continue
        except ValueError as err:
            report.problems.append(f"{shown}:{number}: not a JSON object ({err}); line skipped")
            continue
        if not isinstance(entry, dict):
            report.problems.append(f"{shown}:{number}: not a JSON object; line skipped")
            continue
        yield number, entry


def as_text(value: Any) -> str:
    """A prompt or completion as text: plain strings as they are, conversations (lists of messages) as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def components_json(components: dict[str, Any]) -> str:
    """`rollouts.reward_components`: reward function name -> value, a missing or non-finite value as null."""
    return json.dumps({name: finite(value) for name, value in components.items()})


def finite(value: Any) -> float | None:
    """A finite float, else None (None, text, NaN, inf)."""
    if isinstance(value, bool):
        return float(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


StepReader = Callable[[Path, ReadContext], Iterator[Step]]
"""A format: reads a folder and yields its steps in increasing order (damaged parts reported, skipped)."""
