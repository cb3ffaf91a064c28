"""The Parquet files of a step or chunk folder: encodings, row-group sizes, and the folder writer.

A folder's files depend only on its rows (not on how they arrived: one step, a merge of steps or chunks, a bulk
import), so compaction and `RunWriter.log_many` produce the same bytes (`FolderWriter`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.runlog.schema import FILE_SCHEMAS, VOCABULARY_TABLE

_ROW_GROUP_ROWS = 32_768
# Row groups of the per-token tables are this many times larger. DuckDB pays ~10 us per row group of a file for
# every query (checking its statistics), which at 100M token rows (6,000 row groups of 32K) cost more than
# decoding: one rollout's token passes took 60 ms in 32K-row groups, 17 ms in 128K-row groups.
_TOKEN_ROW_GROUP_FACTOR = 4
# Tables whose rows are kept in parts, one per value of these columns, each part in row groups of its own: a row
# group then holds one value, and its min/max statistics let DuckDB skip the others.
# - rollouts by kind: eval rollouts are a few per step, and following one eval prompt across a run would otherwise
#   decompress every train completion of the run (0.85 s instead of ~0.03 s at 400 steps of 512 completions).
# - token_summary by kind and bucket: a query reads one kind at one bucket; the rows without a position split (the
#   Token statistics page's default) are under 1% of a run's summary, and with every kind and bucket of a step in
#   the same row groups each query decompressed the whole summary (100M token rows: the page's four queries of a
#   step range 0.48 s, 0.11 s by parts; split by 8 positions 0.87 -> 0.58 s; docs/benchmarks.md).
# The parts follow each other in the file in the order of their values, each in the table's sort order (the order
# the rows came in), so the file depends only on its rows.
_PARTS = {"rollouts": ("kind",), "token_summary": ("kind", "bucket")}
# Strings and small integer keys repeat a lot; floats (log-probs, ratios) almost never do, and trying a
# dictionary for them first costs time and bytes.
# token_id too: a row group holds a few thousand distinct tokens of a vocabulary of 10^5, so dictionary indices take
# ~12 bits where deltas of unsorted ids take ~18 (Zipf-distributed ids: 1.3 vs 2.0 bytes a row).
# The summary's counts too: most are 1 or a few (a text at a position bucket), and a dictionary of them wrote a long
# step's summary 27% faster and 17% smaller than plain int64.
_DICTIONARY_COLUMNS = ["run", "step", "kind", "filter_reason", "token_text", "token_id", "pass", "clip", "rejected",
                       "prompt", "answer", "answer_class", "entropy_decile", "bucket", "rows", "advantage_rows",
                       "entropy_rows", "kl_rows", "cov_rows"]
_DELTA_COLUMNS = ["rollout_id", "position", "group_id", "index_in_group", "prompt_id", "length",
                  "step_index", "first_pos", "last_pos", "prm_step"]


def column_options(table: str) -> dict[str, Any]:
    """Encodings per column: dictionary for repeating strings and small keys; BYTE_STREAM_SPLIT for floats
    (their bytes grouped by significance, which zstd compresses ~7% better: log-probs share exponents);
    DELTA_BINARY_PACKED for the sorted or small integers (rollout_id, position: ~0.05 bytes a row instead of
    ~1.3). The logical types, and so the values read back, are unchanged."""
    schema = FILE_SCHEMAS[table]
    names = set(schema.names)
    encodings = {f.name: "BYTE_STREAM_SPLIT" for f in schema if pa.types.is_floating(f.type)}
    encodings.update({c: "DELTA_BINARY_PACKED" for c in _DELTA_COLUMNS if c in names})
    dictionary = [c for c in _DICTIONARY_COLUMNS if c in names]
    if table == VOCABULARY_TABLE:  # distinct texts, sorted ids
        dictionary, encodings["token_id"] = ["run", "step"], "DELTA_BINARY_PACKED"
    return {"use_dictionary": dictionary, "column_encoding": encodings}


def row_group_rows(table: str) -> int:
    """Rows per row group of a table's files (see `_TOKEN_ROW_GROUP_FACTOR`); rollouts keep smaller groups,
    their completions make a row hundreds of bytes, and a merge buffers one group per table."""
    return _ROW_GROUP_ROWS * (_TOKEN_ROW_GROUP_FACTOR if table in ("tokens", "token_passes") else 1)


class FolderWriter:
    """Writes one step or chunk folder under a ``.tmp-`` name: one Parquet file per table, sorted as given,
    in row groups of exactly `row_group_rows` rows (the last of each part of `_PARTS` shorter) whatever the sizes
    of the pieces added, so a folder's files depend only on its rows: a chunk merged from steps, or from chunks, or
    written directly by `RunWriter.log_many` is the same file. Memory: at most one row group per table buffered,
    and per part of a table with parts, whose rows wait (`_Part`) until `commit` writes the parts in order."""

    def __init__(self, data_dir: Path, rank: int, label: str):
        self.tmp = data_dir / f".tmp-{label}.rank{rank}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._pending: dict[str, pa.Table] = {}
        self._parts: dict[tuple[str, tuple], _Part] = {}
        self._texts = pa.array([], pa.string())  # the token_vocab texts added so far

    def add(self, table: str, arrow: pa.Table) -> None:
        if table == VOCABULARY_TABLE:  # each text once, in the first step that has it (a run's pairs never
            # disagree, see engine.runlog.derived.TokenVocabulary)
            arrow = arrow.filter(pc.invert(pc.is_in(arrow["token_text"], value_set=self._texts)))
            self._texts = pa.concat_arrays([self._texts, arrow["token_text"].combine_chunks()])
            self._add(table, arrow)
        elif table in _PARTS:
            for key, rows in _parts_of(arrow, _PARTS[table]):
                if (table, key) not in self._parts:
                    self._parts[table, key] = _Part(self.tmp / f".{table}-part{len(self._parts)}.arrow", table)
                self._parts[table, key].add(rows)
        else:
            self._add(table, arrow)

    def add_tables(self, tables: dict[str, pa.Table | None]) -> None:
        """Add every table of one step (None: the step has no rows of that table)."""
        for table, arrow in tables.items():
            if arrow is not None:
                self.add(table, arrow)

    def _add(self, table: str, arrow: pa.Table) -> None:
        pending = self._pending.get(table)
        pending = arrow if pending is None else pa.concat_tables([pending, arrow])
        size = row_group_rows(table)
        while pending.num_rows >= size:
            self._write(table, pending.slice(0, size))
            pending = pending.slice(size)
        # A slice keeps the whole table it was cut from alive: copy the few rows left so a step's other rows
        # are freed (a stream of steps into one chunk would otherwise hold one more step in memory).
        self._pending[table] = pending.take(pa.array(range(pending.num_rows), pa.int64())) if arrow.num_rows > size \
            else pending

    def _write_rest(self, table: str) -> None:
        rest = self._pending.pop(table, None)
        if rest is not None and rest.num_rows:
            self._write(table, rest)

    def _write(self, table: str, rows: pa.Table) -> None:
        writer = self._writers.get(table)
        if writer is None:
            schema = FILE_SCHEMAS[table]
            writer = self._writers[table] = pq.ParquetWriter(
                self.tmp / f"{table}.parquet", schema, compression="zstd", **column_options(table))
        writer.write_table(rows, row_group_size=row_group_rows(table))

    def commit(self, final: Path) -> None:
        """Write the parts, close the files and rename the folder into place (the moment readers see it)."""
        for table, key in sorted(self._parts, key=lambda part: (part[0], _in_order(part[1]))):
            for rows in self._parts.pop((table, key)).pieces():
                self._add(table, rows)
            self._write_rest(table)  # the part's last row group: the next part starts a new one
        for table in list(self._pending):
            self._write_rest(table)
        for writer in self._writers.values():
            writer.close()
        os.rename(self.tmp, final)

    def abort(self) -> None:
        for writer in [*self._writers.values(), *(part.file for part in self._parts.values() if part.file)]:
            with contextlib.suppress(Exception):
                writer.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _Part:
    """The rows of one part of a table with parts (`_PARTS`), in the order added, until `FolderWriter.commit`: held
    in memory up to a row group's worth, then moved to an lz4 Arrow file in the folder being written (a step's few
    rows never touch a file: that cost a step's `log_step` a third more time)."""

    def __init__(self, path: Path, table: str):
        self.path, self.table = path, table
        self.held: list[pa.Table] = []
        self.held_rows = 0
        self.file: pa.ipc.RecordBatchFileWriter | None = None

    def add(self, rows: pa.Table) -> None:
        self.held.append(rows)
        self.held_rows += rows.num_rows
        if self.held_rows >= row_group_rows(self.table):
            if self.file is None:
                self.file = pa.ipc.new_file(str(self.path), FILE_SCHEMAS[self.table],
                                            options=pa.ipc.IpcWriteOptions(compression="lz4"))
            for piece in self.held:
                self.file.write_table(piece)
            self.held, self.held_rows = [], 0

    def pieces(self) -> Iterator[pa.Table]:
        """The part's rows, in the order added, a piece at a time (its file removed once read)."""
        if self.file is not None:
            self.file.close()
            with pa.memory_map(str(self.path)) as source:
                stored = pa.ipc.open_file(source)
                for i in range(stored.num_record_batches):
                    yield pa.Table.from_batches([stored.get_batch(i)])
            self.path.unlink()
        yield from self.held


def _parts_of(rows: pa.Table, columns: tuple[str, ...]) -> list[tuple[tuple, pa.Table]]:
    """(value of `columns` as a tuple, None for NULL; its rows in the order they came) for each value, in no order."""
    if rows.num_rows == 0:
        return []
    keys = rows.select(list(columns)).group_by(list(columns)).aggregate([]).to_pylist()
    parts = []
    for key in keys:
        matches = None
        for column in columns:
            value = key[column]
            match = pc.is_null(rows[column]) if value is None else pc.fill_null(pc.equal(rows[column], value), False)
            matches = match if matches is None else pc.and_(matches, match)
        parts.append((tuple(key[c] for c in columns), rows.filter(matches)))
    return parts


def _in_order(key: tuple) -> tuple:
    """A part's place in its file: by its values, NULL first."""
    return tuple((value is not None, value) for value in key)


def write_folder(data_dir: Path, rank: int, label: str, final: Path, fill) -> None:
    """Write a folder with `fill(folder_writer)` and rename it to `final`; nothing is left behind on error."""
    folder = FolderWriter(data_dir, rank, label)
    try:
        fill(folder)
        folder.commit(final)  # the commit point: the whole folder appears at once
    except BaseException:
        folder.abort()
        raise
