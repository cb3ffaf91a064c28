"""Log Cui et al.'s covariance per token and pass, or derive it in the data layer? Bytes per row against query time.

    python benchmarks/bench_token_drivers.py                 # 20 steps x 512 completions: 5M tokens, 10M token x
                                                             # pass rows (bench_dashboard's synthetic run)
    python benchmarks/bench_token_drivers.py --steps 40      # 20M token x pass rows

The run is bench_dashboard.py's (written once into `--logs-dir`, reused). Measured:
- bytes per `token_passes` row as logged, and what a stored covariance column would add: the covariance of every
  row computed once and written with the run log's own Parquet settings (zstd, BYTE_STREAM_SPLIT, its row groups);
- query time, median of `--repeat`, of the Token statistics page's two queries over the whole run
  (`data.covariance_drivers`, `data.covariance_per_step`), and of one aggregate over every loss token x pass row
  with the covariance derived (window means per pass) against the same aggregate without the window (reading
  the same columns): the difference is all that storing the column could save.
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

    from dashboard import data
    from engine.runlog.files import column_options, row_group_rows

    frame = reader.sql(f"SELECT covariance FROM ({data._COVARIANCE}) ORDER BY step, token_key, \"pass\"",
                       {"run": run, "first": 0, "last": last})
    table = pa.table({"covariance": frame["covariance"].to_numpy(dtype="float64")})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "covariance.parquet")
        pq.write_table(table, path, compression="zstd", row_group_size=row_group_rows("token_passes"),
                       **column_options(table.schema))
        return table.num_rows, os.path.getsize(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default=str(ROOT / "bench_logs"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from bench_dashboard import ensure_run

    from dashboard import data

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
    windowed = f"SELECT sum(covariance) AS s, count(*) AS n FROM ({data._COVARIANCE})"
    plain = f"SELECT sum(advantage * new_logp) AS s, count(*) AS n FROM ({data._LOSS_TOKEN_PASSES})"
    timings = {
        "covariance_drivers (page table)": lambda: data.covariance_drivers(reader, run, 0, last, 0),
        "covariance_per_step (page chart)": lambda: data.covariance_per_step(reader, run, 0, last),
        "aggregate, covariance derived": lambda: reader.sql(windowed, params),
        "aggregate, same columns, no window": lambda: reader.sql(plain, params),
    }
    for name, fn in timings.items():
        print(f"  {name}: {median_seconds(fn, args.repeat):.2f} s (median of {args.repeat})")
    print(f"load average {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f} (1 / 5 min), {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
