"""Keeping a run's files in shape: compaction (merging step folders into chunks), truncation (deleting the steps
after a checkpoint), and telling damaged or foreign files apart from ours.

Compaction: after `compact_every` step folders of a rank the writer merges them into one chunk (files sorted by
step, rollout, position, so row-group statistics prune a one-rollout query), and every `MERGE_FAN_IN` chunks of one
size into a bigger one: the file count grows with the log of the step count (`next_merge`). A reader that lists a
chunk and the folders it replaced uses the chunk (`layout.scan_segments`); the replaced folders are deleted
`DELETE_GRACE_SECONDS` later.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.runlog.derived import stored_passes
from engine.runlog.files import FolderWriter, write_folder
from engine.runlog.layout import STEP_DIR_RE, Segment, chunk_dir, next_seq, remove_tree, scan_segments
from engine.runlog.schema import FILE_SCHEMAS, STORED_TABLES, older_schema_missing, with_added_columns
from engine.runlog.summary import step_summary

SUMMARY_TABLE = "token_summary"

MERGE_FAN_IN = 8
# A reader lists a data folder with readdir, which is not a snapshot: an entry added or removed during the
# listing may or may not be returned. Deleting the folders a chunk replaces only this long after the chunk
# appeared means no listing can both miss the new chunk and miss the old folders.
DELETE_GRACE_SECONDS = 1.0


# ---------------------------------------------------------------- compaction


def next_merge(segments: Sequence[tuple[int, int, int]], compact_every: int) -> list[tuple[int, int, int]] | None:
    """Which of one rank's live segments (first, last, seq; seq < 0 for a step folder) to merge next, or None:
    all step folders once there are `compact_every` of them, else `MERGE_FAN_IN` chunks of one level (a
    level-k chunk spans at least compact_every * FAN_IN**k steps, less than FAN_IN times that)."""
    if compact_every <= 0:
        return None
    steps = [s for s in segments if s[2] < 0]
    if len(steps) >= compact_every:
        return steps
    by_level: dict[int, list[tuple[int, int, int]]] = {}
    for c in (s for s in segments if s[2] >= 0):
        level, size = 0, compact_every * MERGE_FAN_IN
        while c[1] - c[0] + 1 >= size:
            level, size = level + 1, size * MERGE_FAN_IN
        by_level.setdefault(level, []).append(c)
    full = [group for group in by_level.values() if len(group) >= MERGE_FAN_IN]
    return full[0] if full else None


def final_segments(existing: Sequence[tuple[int, int, int]], steps: Sequence[int], compact_every: int,
                   next_seq: int) -> list[tuple[int, int, int]]:
    """The segments (first, last, seq) holding `steps` after logging them one by one with `log_step` on top of
    `existing`, merging after each (`next_merge`): the plan `RunWriter.log_many` writes directly. Segments of
    `existing` that a merge absorbs are absorbed into the returned one."""
    live = list(existing)
    for step in steps:
        live.append((step, step, -1))
        while (picked := next_merge(live, compact_every)) is not None:
            live = [s for s in live if s not in picked]
            live.append((min(p[0] for p in picked), max(p[1] for p in picked), next_seq))
            next_seq += 1
    new = [s for s in live if s not in existing]
    return sorted(new, key=lambda s: s[0])


def merge(data_dir: Path, segments: Sequence[Segment], rank: int, seq: int, keep_up_to: int | None = None) -> None:
    """Write the rows of `segments` (optionally only steps <= keep_up_to) as one chunk; the caller deletes
    `segments` later (see `DELETE_GRACE_SECONDS`).

    Streams row groups through a `FolderWriter` so memory stays bounded by a few row groups, whatever the size.
    """
    segments = sorted(segments, key=lambda s: s.first)
    first = segments[0].first
    last = max(s.last for s in segments) if keep_up_to is None else keep_up_to
    write_folder(data_dir, rank, f"chunk-{first:09d}", chunk_dir(data_dir, first, last, seq, rank),
                 lambda folder: copy_rows(segments, folder, keep_up_to))


def copy_rows(segments: Sequence[Segment], folder: FolderWriter, keep_up_to: int | None = None) -> None:
    """Append the rows of `segments` (in step order) to `folder`, a row group at a time, in the current schema."""
    for table in STORED_TABLES:
        # Segments are in step order and each file is sorted by the table's keys, so appending keeps the
        # chunk sorted: no re-sort needed.
        for part in (Path(s.path) / f"{table}.parquet" for s in segments):
            if table == SUMMARY_TABLE and not part.exists():
                summarise_folder(part.parent, folder, keep_up_to)  # a folder logged before the summary
                continue
            if not part.exists():
                continue
            source = pq.ParquetFile(part)
            for i in range(source.num_row_groups):
                piece = with_added_columns(source.read_row_group(i), table)
                if keep_up_to is not None:
                    piece = piece.filter(pc.less_equal(piece["step"], keep_up_to))
                folder.add(table, piece)


def summarise_folder(path: Path, folder: FolderWriter, keep_up_to: int | None = None) -> None:
    """Add to `folder` the `token_summary` rows of the steps of the folder `path` (written before the writer
    wrote them), step by step from its rollouts, tokens and passes, so that a merged chunk summarises all its
    steps. Memory: one step's rows."""
    sources = {table: path / f"{table}.parquet" for table in ("rollouts", "tokens", "token_passes")}
    if not (sources["tokens"].exists() or sources["token_passes"].exists()):
        return
    steps = sorted({s for p in sources.values() if p.exists()
                    for s in pq.read_table(p, columns=["step"])["step"].unique().to_pylist()})
    for step in steps if keep_up_to is None else [s for s in steps if s <= keep_up_to]:
        rows = {table: with_added_columns(pq.read_table(p, filters=[("step", "=", step)]), table)
                if p.exists() else None for table, p in sources.items()}
        rows = {table: t if t is not None and t.num_rows else None for table, t in rows.items()}
        passes = stored_passes(rows["tokens"], rows["token_passes"])
        summary = step_summary(rows["rollouts"], rows["tokens"], passes)
        if summary is not None:
            folder.add(SUMMARY_TABLE, summary)


# ---------------------------------------------------------------- truncation


def truncate(data_dir: Path, rank: int, keep_up_to: int) -> None:
    """Delete rank `rank`'s logged steps > keep_up_to (see `RunWriter.resume`): a chunk that straddles it is
    rewritten, and the rewrite wins by its newer sequence number."""
    segments = [s for s in scan_segments(data_dir) if s.rank == rank]
    # Step folders first: they may be covered by a chunk and would otherwise reappear once the chunk goes.
    for entry in os.scandir(data_dir):
        m = STEP_DIR_RE.match(entry.name)
        if m and int(m[2]) == rank and int(m[1]) > keep_up_to:
            remove_tree(Path(entry.path))
    seq = next_seq(data_dir)
    for s in segments:
        if s.is_chunk and s.first > keep_up_to:
            remove_tree(Path(s.path))
        elif s.is_chunk and s.last > keep_up_to:
            merge(data_dir, [s], rank, seq, keep_up_to=keep_up_to)
            remove_tree(Path(s.path))  # at resume, before logging goes on: a reader's listing may be off briefly
            seq += 1


# ---------------------------------------------------------------- damaged and foreign files

LEGACY = "legacy"
"""`check_file`'s answer for a valid file written before some `ADDED_COLUMNS` (readable, new columns NULL)."""


def check_file(path: str, table: str) -> str | None:
    """Cheap validation (footer + schema) before a file enters a view, so one bad file cannot break every query.

    None: valid; `LEGACY`: valid, written before some `ADDED_COLUMNS`; any other string: what is wrong."""
    try:
        schema = pq.read_schema(path)
    except FileNotFoundError:
        return None  # vanished: the view rebuild notices
    except Exception as err:  # pyarrow raises several types for garbage
        return f"damaged or not a Parquet file ({type(err).__name__}: {err})"
    schema = schema.remove_metadata()
    if schema.equals(FILE_SCHEMAS[table]):
        return None
    if older_schema_missing(table, schema) is not None:
        return LEGACY
    return f"not a {table} file of this schema (columns {schema.names})"


def damaged_pages(con: duckdb.DuckDBPyConnection, path: str) -> str | None:
    """Decode every page of one file (what a footer check cannot see): None if it decodes, else DuckDB's first
    error line (possibly empty)."""
    try:
        con.execute("SELECT max(hash(COLUMNS(*))) FROM read_parquet(?)", [path]).fetchall()
    except duckdb.Error as err:
        return (str(err).splitlines() or [""])[0]
    return None
