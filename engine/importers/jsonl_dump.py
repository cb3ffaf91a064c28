"""Reading a JSONL dump file into a samples table with DuckDB's columnar JSON reader, one damaged line costing only
itself.

The fast path reads the whole file with `read_json` (typed columns, no Python per token). If DuckDB refuses the
file (a byte that is not UTF-8, a truncated line, a value of the wrong type) or a sample's per-token lists do not
have its token count, the file is read again line by line in Python (`jsonl_lines`): each bad line is reported as
`file:line` and left out, and the good lines go through the same SQL from a temporary file.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow as pa

from engine.importers.base import ReadContext, duckdb_connection, jsonl_lines
from engine.importers.token_dumps import samples_select, valid_lengths_sql

LINE_BYTES = 16 << 20
"""The longest JSON line read first (DuckDB's default, about 100k tokens of a dozen per-token lists). A larger
limit costs every file: DuckDB reads in buffers of that size, so 1 GB halved the speed of a 62 MB file and kept it
on one thread (0.30 s instead of 0.15 s of CPU, 0.08 s on two threads)."""
MAX_LINE_BYTES = 1 << 30
"""The longest JSON line read: a file with a line above `LINE_BYTES` is read again with this limit."""


def read_samples(path: Path, shown: str, json_columns: dict[str, str], expressions: dict[str, str],
                 line_problem: Callable[[dict], str | None], ctx: ReadContext) -> pa.Table | None:
    """The samples of one JSONL file (`expressions`: samples column -> SQL over `json_columns`), or None when it
    has none; problems (file, line) go to the report."""
    con = duckdb_connection()
    try:
        table = _query(con, str(path), json_columns, expressions)
        if _all_valid(con, table):
            return table if table.num_rows else None
    except duckdb.Error:
        pass
    return _line_by_line(con, path, shown, json_columns, expressions, line_problem, ctx)


def _query(con, path: str, json_columns: dict[str, str], expressions: dict[str, str]) -> pa.Table:
    try:
        return _query_lines_up_to(LINE_BYTES, con, path, json_columns, expressions)
    except duckdb.InvalidInputException as err:
        if "maximum_object_size" not in str(err):
            raise
        return _query_lines_up_to(MAX_LINE_BYTES, con, path, json_columns, expressions)


def _query_lines_up_to(line_bytes: int, con, path: str, json_columns: dict[str, str],
                       expressions: dict[str, str]) -> pa.Table:
    columns = "{" + ", ".join(f"'{k}': '{v}'" for k, v in json_columns.items()) + "}"
    source = f"read_json(?, format = 'newline_delimited', columns = {columns}, maximum_object_size = {line_bytes})"
    return con.sql(f"SELECT {samples_select(expressions)} FROM {source}", params=[path]).to_arrow_table()


def _all_valid(con, table: pa.Table) -> bool:
    """Every sample has token ids, a loss mask and per-token lists as long as its token ids."""
    list_names = [f.name for f in table.schema if pa.types.is_list(f.type) and f.name not in ("token_ids", "loss_mask")]
    con.register("checked", table)
    try:
        bad = con.execute(f"SELECT count(*) FROM checked WHERE NOT coalesce({valid_lengths_sql(list_names)}, false)"
                          ).fetchall()[0][0]
    finally:
        con.unregister("checked")
    return bad == 0


def _line_by_line(con, path: Path, shown: str, json_columns, expressions, line_problem,
                  ctx: ReadContext) -> pa.Table | None:
    good = []
    for number, entry in jsonl_lines(path, ctx.report, shown):
        problem = line_problem(entry)
        if problem is not None:
            ctx.report.problems.append(f"{shown}:{number}: {problem}; line skipped")
        else:
            good.append(json.dumps(entry))
    if not good:
        return None
    with tempfile.TemporaryDirectory() as folder:
        clean = Path(folder) / "good-lines.jsonl"
        clean.write_text("\n".join(good) + "\n", encoding="utf-8")
        try:
            table = _query(con, str(clean), json_columns, expressions)
        except duckdb.Error as err:
            ctx.report.problems.append(f"{shown}: not readable as this dump format ({err}); skipped")
            return None
    return table if _all_valid(con, table) else None


# ---------------------------------------------------------------- checks of one line, for the slow path


def is_list_of(value, kind: str, depth: int = 1) -> bool:
    """`value` is a list (nested `depth` deep) of `kind` ('int', 'float' or null, 'bool')."""
    if not isinstance(value, list):
        return False
    if depth > 1:
        return all(is_list_of(v, kind, depth - 1) for v in value)
    check = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
             "float": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
             "bool": lambda v: isinstance(v, bool) or v is None}[kind]
    return all(check(v) for v in value)


def list_fields_problem(entry: dict, kinds: dict[str, str], tokens_key: str, depth: int = 1) -> str | None:
    """What is wrong with a line's per-token lists (types, lengths against `tokens_key`), or None."""
    if not is_list_of(entry.get(tokens_key), "int", depth):
        return f"{tokens_key} is not a list of token ids"
    n = len(_innermost(entry[tokens_key], depth))
    for key, kind in kinds.items():
        value = entry.get(key)
        if value is None:
            continue
        if not is_list_of(value, kind, depth):
            return f"{key} is not a list of {kind} values"
        if len(_innermost(value, depth)) != n:
            return f"{key} has {len(_innermost(value, depth))} values for {n} tokens"
    return None


def _innermost(value: list, depth: int) -> list:
    for _ in range(depth - 1):
        value = value[0] if value else []
    return value
