"""Server time of the dashboard's queries of the `tokens` view on a run of real token ids and texts.

    python benchmarks/bench_token_queries.py --logs-dir DIR --tokenizer tokenizer.json --corpus 'texts/*.txt'
    python benchmarks/bench_token_queries.py --logs-dir DIR --repeat 15      # the run in DIR again

Writes (once, when DIR holds no run `queries`) 8 steps of `bench_bytes.py`'s with a sampler that is not the policy
(1.0M token rows and 2.0M pass rows every 4 steps, chunks of 4 steps) and the vocabulary of `--tokenizer` and
`--corpus`, then prints the median milliseconds of each query (after one warm-up call) and of an export. The script
uses only what every run-log version has (`RunWriter.log_many`, `dashboard.data`, `dashboard.token_data`), so the
same file run from an older checkout times that version on the run it writes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RUN = "queries"
STEPS = 8


def build(logs_dir: Path, tokenizer: str, corpus: str) -> None:
    import bench_bytes

    from engine.runlog import RunWriter

    vocabulary = bench_bytes.load_vocabulary(tokenizer, corpus)
    steps = [bench_bytes.step_tables(s, "separate", vocabulary, np.random.default_rng(s)) for s in range(STEPS)]
    with RunWriter.create(logs_dir, RUN, algorithm="grpo", compact_every=4) as writer:
        writer.log_many(range(STEPS), lambda s: steps[s])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logs-dir", required=True)
    parser.add_argument("--tokenizer", help="a tokenizers JSON file (needed to write the run)")
    parser.add_argument("--corpus", help="glob of the text files to encode with --tokenizer")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    logs_dir = Path(args.logs_dir)
    if not (logs_dir / RUN).exists():
        if not (args.tokenizer and args.corpus):
            parser.error(f"no run {RUN!r} in {logs_dir}: --tokenizer and --corpus write one")
        build(logs_dir, args.tokenizer, args.corpus)

    from dashboard import data, token_data
    from engine.runlog import RunReader

    reader = RunReader(logs_dir, runs=RUN)
    step = STEPS - 3
    rollouts = tuple(int(r) for r in reader.sql(
        "SELECT rollout_id FROM rollouts WHERE step = ? AND kind = 'train' ORDER BY 1", [step]).rollout_id)
    one = rollouts[3:4]
    queries = {
        "Token inspector: one rollout with its pass (reads token_id)":
            lambda: data.rollout_tokens(reader, RUN, step, one, None),
        "Algorithm weighting: a whole step's tokens": lambda: data.weighed_tokens(reader, RUN, step, rollouts),
        "Algorithm weighting: a whole step's last update": lambda: data.weighed_passes(reader, RUN, step, rollouts, -1),
        "Mismatch: a step's sampler tokens": lambda: data.sampler_tokens(reader, RUN, step),
        "Advantages: a group's critic tokens": lambda: data.critic_tokens(reader, RUN, step, rollouts[:8]),
        "Token statistics: every step": lambda: token_data.token_stats(reader, RUN, 0, STEPS - 1, 0),
        "SQL: SELECT * of one rollout": lambda: reader.sql(
            "SELECT * FROM tokens WHERE run = ? AND step = ? AND rollout_id = ? ORDER BY position",
            [RUN, step, one[0]]),
        "SQL: count per token text": lambda: reader.sql("SELECT token_text, count(*) FROM tokens GROUP BY 1"),
    }
    for name, query in queries.items():
        query()
        seconds = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            query()
            seconds.append(time.perf_counter() - started)
        print(f"{name}: {statistics.median(seconds) * 1000:.1f} ms", flush=True)
    started = time.perf_counter()
    reader.export(logs_dir.parent / f"{logs_dir.name}-export.duckdb", overwrite=True)
    print(f"export: {time.perf_counter() - started:.2f} s")
    (logs_dir.parent / f"{logs_dir.name}-export.duckdb").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
