"""Log Cui et al.'s covariance per token and pass, or derive it in the data layer? Bytes per row against query time.

    python benchmarks/bench_token_drivers.py                 # 20 steps x 512 completions: 5M tokens, 10M token x
                                                             # pass rows (bench_dashboard's synthetic run)
    python benchmarks/bench_token_drivers.py --steps 40      # 20M token x pass rows

The run is bench_dashboard.py's (written once into `--logs-dir`, reused). Measured:
- bytes per `token_passes` row as logged, and what a stored covariance column would add: the covariance of every
  row computed once and written with the run log's own Parquet settings (zstd, BYTE_STREAM_SPLIT, its row groups);
- query time, median of `--repeat`, over the whole run: the Token statistics page's two queries
  (`token_data.covariance_drivers`, `token_data.covariance_per_step`), next to its existing per-token-text table
  (`token_data.token_stats`) for scale; the summed covariance per step, pass and token text
  as they derive it (pass means, then one aggregation: `token_data._covariance_sums`), as a window over each pass and a
  product per row would, and as reading a stored column would (emulated: the same aggregation of one product per
  row, no means; the same columns read). The last is all that storing the column could save.
The per-token KL contribution needs no column: `token_passes.kl` is logged, its share is a sum over it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def per_row_covariance() -> str:
    """Every loss token x pass row with its covariance, the pass's means taken by a window."""
    from dashboard import token_data

    return f"""SELECT *, (advantage - avg(advantage) OVER pass_rows) * (new_logp - avg(new_logp) OVER pass_rows)
                      AS covariance
               FROM ({token_data._LOSS_TOKEN_PASSES}) WINDOW pass_rows AS (PARTITION BY step, "pass")"""


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def stored_column_bytes(reader, run: str, last: int) -> tuple[int, int]:
    """(rows, bytes) of the run's covariance column written as the run log writes a float column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.runlog.files import row_group_rows

    frame = reader.sql(f"SELECT covariance FROM ({per_row_covariance()}) ORDER BY step, rollout_id, \"pass\", position",
                       {"run": run, "first": 0, "last": last})
    table = pa.table({"covariance": frame["covariance"].to_numpy(dtype="float64")})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "covariance.parquet")
        pq.write_table(table, path, compression="zstd", row_group_size=row_group_rows("token_passes"),
                       use_dictionary=False, column_encoding={"covariance": "BYTE_STREAM_SPLIT"})  # a float column's
        return table.num_rows, os.path.getsize(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "bench_logs"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from bench_dashboard import ensure_run

    from dashboard import data, token_data

    run = ensure_run(args.logs_dir, args.steps, 64, 8, 650)
    reader = data.open_reader(args.logs_dir)
    last = args.steps - 1
    files = list((Path(args.logs_dir) / run).glob("data/**/token_passes.parquet"))
    logged_rows = int(reader.sql("SELECT count(*) AS n FROM token_passes WHERE run = ?", [run])["n"][0])
    logged_bytes = sum(f.stat().st_size for f in files)
    rows, column_bytes = stored_column_bytes(reader, run, last)
    print(f"{run}: {logged_rows:,} token_passes rows, {logged_bytes / logged_rows:.2f} bytes a row as logged; "
          f"a stored covariance column: {column_bytes / rows:.2f} bytes a row more "
          f"(+{column_bytes / logged_bytes:.0%}) for its {rows:,} loss rows")

    params = {"run": run, "first": 0, "last": last}
    by_text = 'GROUP BY step, "pass", token_text'
    row_by_row = token_data._Split("true", "false", 0)  # what this benchmark compares: the tokens, not a summary
    derived = (f'SELECT step, "pass", token_text, covariance_sum '
               f'FROM ({token_data._covariance_sums(row_by_row, "token_text", "token_text")})')
    windowed = f'SELECT step, "pass", token_text, sum(covariance) FROM ({per_row_covariance()}) {by_text}'
    loss_passes = token_data._LOSS_TOKEN_PASSES
    stored = f'SELECT step, "pass", token_text, sum(advantage * new_logp) FROM ({loss_passes}) {by_text}'
    timings = {
        "token_stats (the page's table per token text, for scale)":
            lambda: token_data.token_stats(reader, run, 0, last, 0),
        "covariance_drivers (page tables)": lambda: token_data.covariance_drivers(reader, run, 0, last, 0),
        "covariance_per_step (page chart)": lambda: token_data.covariance_per_step(reader, run, 0, last),
        "covariance per step, pass, text: pass means, one aggregation": lambda: reader.sql(derived, params),
        "the same by a window and a product per row": lambda: reader.sql(windowed, params),
        "the same from a stored column (emulated)": lambda: reader.sql(stored, params),
    }
    for name, fn in timings.items():
        print(f"  {name}: {median_seconds(fn, args.repeat):.2f} s (median of {args.repeat})")
    print(f"load average {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f} (1 / 5 min), {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
