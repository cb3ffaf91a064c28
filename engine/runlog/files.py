"""The Parquet files of a step or chunk folder: encodings, row-group sizes, and the folder writer.

A folder's files depend only on its rows (not on how they arrived: one step, a merge of steps or chunks, a bulk
import), so compaction and `RunWriter.log_many` produce the same bytes (`FolderWriter`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
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
# Rows kept in row groups of their own, apart from the table's other rows: eval rollouts are a few per step, and
# following one eval prompt across a run would otherwise decompress every train completion of the run (0.85 s
# instead of ~0.03 s at 400 steps of 512 completions). Each row group then holds one kind, and its min/max
# statistics let DuckDB skip the others. Within each part the rows stay in the table's sort order.
_SEPARATE_ROW_GROUPS = {"rollouts": ("kind", "train")}
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
    in row groups of exactly `row_group_rows` rows (the last of each part of `_SEPARATE_ROW_GROUPS` shorter)
    whatever the sizes of the pieces added,
    so a folder's files depend only on its rows: a chunk merged from steps, or from chunks, or written
    directly by `RunWriter.log_many` is the same file. Memory: at most one row group per table buffered."""

    def __init__(self, data_dir: Path, rank: int, label: str):
        self.tmp = data_dir / f".tmp-{label}.rank{rank}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self._pending: dict[str, pa.Table] = {}
        self._texts = pa.array([], pa.string())  # the token_vocab texts added so far

    def add(self, table: str, arrow: pa.Table) -> None:
        if table == VOCABULARY_TABLE:  # each text once, in the first step that has it (a run's pairs never
            # disagree, see engine.runlog.derived.TokenVocabulary)
            arrow = arrow.filter(pc.invert(pc.is_in(arrow["token_text"], value_set=self._texts)))
            self._texts = pa.concat_arrays([self._texts, arrow["token_text"].combine_chunks()])
            self._add(table, arrow)
        elif table in _SEPARATE_ROW_GROUPS:  # e.g. eval rollouts in row groups of their own, see there
            column, value = _SEPARATE_ROW_GROUPS[table]
            matches = pc.fill_null(pc.equal(arrow[column], value), False)
            self._add(table, arrow.filter(matches))
            self._add(f"{table}+", arrow.filter(pc.invert(matches)))
        else:
            self._add(table, arrow)

    def add_tables(self, tables: dict[str, pa.Table | None]) -> None:
        """Add every table of one step (None: the step has no rows of that table)."""
        for table, arrow in tables.items():
            if arrow is not None:
                self.add(table, arrow)

    def _add(self, bucket: str, arrow: pa.Table) -> None:
        pending = self._pending.get(bucket)
        pending = arrow if pending is None else pa.concat_tables([pending, arrow])
        size = row_group_rows(bucket.rstrip("+"))
        while pending.num_rows >= size:
            self._write(bucket.rstrip("+"), pending.slice(0, size))
            pending = pending.slice(size)
        # A slice keeps the whole table it was cut from alive: copy the few rows left so a step's other rows
        # are freed (a stream of steps into one chunk would otherwise hold one more step in memory).
        self._pending[bucket] = pending.take(pa.array(range(pending.num_rows), pa.int64())) if arrow.num_rows > size \
            else pending

    def _write(self, table: str, rows: pa.Table) -> None:
        writer = self._writers.get(table)
        if writer is None:
            schema = FILE_SCHEMAS[table]
            writer = self._writers[table] = pq.ParquetWriter(
                self.tmp / f"{table}.parquet", schema, compression="zstd", **column_options(table))
        writer.write_table(rows, row_group_size=row_group_rows(table))

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


def write_folder(data_dir: Path, rank: int, label: str, final: Path, fill) -> None:
    """Write a folder with `fill(folder_writer)` and rename it to `final`; nothing is left behind on error."""
    folder = FolderWriter(data_dir, rank, label)
    try:
        fill(folder)
        folder.commit(final)  # the commit point: the whole folder appears at once
    except BaseException:
        folder.abort()
        raise
