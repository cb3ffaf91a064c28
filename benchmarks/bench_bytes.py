"""Bytes per token row and token-pass row on disk, per column, and the CPU time of writing them.

    python benchmarks/bench_bytes.py                            # 4 steps of bench_dashboard's (1.0M token rows,
                                                                # 2.0M pass rows), each sampler kind, 3 repeats
    python benchmarks/bench_bytes.py --sampler policy --repeat 5
    python benchmarks/bench_bytes.py --tokenizer tokenizer.json --corpus 'texts/*.txt'   # a real vocabulary

The steps are `bench_dashboard.synthetic_step`'s (random float32 log-probs, entropies, ratios: their mantissas
are what is left to store), with the sampler columns of one kind of run:
- policy: the policy sampled at top-p 1 (the engine's default): sampler_logp = sampler_logp_full = old_logp;
- separate: another engine sampled (vLLM, another precision) at top-p 1: sampler_logp_full = sampler_logp;
- truncating: another engine with top-p truncation: all three differ (bench_dashboard's run).
With `--tokenizer` (a tokenizers JSON file) the token ids are consecutive tokens of `--corpus` encoded by it and
the texts its decoding of each id; without it, bench_dashboard's 19-token vocabulary. Each repeat writes the
run with `RunWriter.log_many` into a fresh folder (removed after) and reports the process's CPU seconds of the
write per million token rows; the medians are printed last.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SAMPLERS = ("policy", "separate", "truncating")


def load_vocabulary(tokenizer_path: str, corpus: str, max_tokens: int = 4_000_000) -> tuple[np.ndarray, np.ndarray]:
    """(stream, texts): up to `max_tokens` token ids of the corpus files in name order, and each id's text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    ids: list[int] = []
    for path in sorted(glob.glob(corpus, recursive=True)):
        ids.extend(tokenizer.encode(Path(path).read_text(errors="replace")).ids)
        if len(ids) >= max_tokens:
            break
    texts = np.array([tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())], dtype=object)
    return np.array(ids[:max_tokens], dtype=np.int64), texts


def step_tables(step: int, sampler: str, vocabulary, rng) -> dict:
    """One bench_dashboard step with `sampler`'s columns and, given one, the vocabulary's ids and texts."""
    import bench_dashboard

    tables = bench_dashboard.synthetic_step(step, bench_dashboard.short_shape(64, 8, 650), 2, rng)
    tokens = tables["tokens"]
    if sampler == "policy":
        tokens["sampler_logp"] = tokens["sampler_logp_full"] = tokens["old_logp"]
    elif sampler == "separate":
        tokens["sampler_logp_full"] = tokens["sampler_logp"]
    if vocabulary is not None:
        stream, texts = vocabulary
        n = len(tokens["token_id"])
        start = int(rng.integers(0, len(stream) - n))  # consecutive tokens of real text
        tokens["token_id"] = stream[start:start + n]
        tokens["token_text"] = texts[tokens["token_id"]]
    return tables


def write_once(logs_dir: Path, steps: list[dict]) -> float:
    """CPU seconds of this process to write the steps (log_many into one chunk, then close: all on disk)."""
    from engine.runlog import RunWriter

    started = time.process_time()
    with RunWriter.create(logs_dir, "bytes", algorithm="grpo", compact_every=len(steps)) as writer:
        writer.log_many(range(len(steps)), lambda s: steps[s])
    return time.process_time() - started


def column_bytes(logs_dir: Path, table: str) -> tuple[int, float, dict[str, float]]:
    """Rows, file bytes per row, and compressed bytes per row of each column (Parquet metadata) of a table."""
    rows, size, columns = 0, 0, {}
    for path in logs_dir.rglob(f"{table}.parquet"):
        meta = pq.ParquetFile(path).metadata
        rows, size = rows + meta.num_rows, size + path.stat().st_size
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                column = meta.row_group(g).column(c)
                name = column.path_in_schema.split(".")[0]
                columns[name] = columns.get(name, 0) + column.total_compressed_size
    return rows, size / rows if rows else 0.0, {name: b / rows for name, b in columns.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sampler", choices=SAMPLERS, action="append", help="default: each")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizer", help="a tokenizers JSON file (tokenizer.json)")
    parser.add_argument("--corpus", help="glob of the text files to encode with --tokenizer")
    args = parser.parse_args(argv)
    if bool(args.tokenizer) != bool(args.corpus):
        parser.error("--tokenizer and --corpus go together")
    vocabulary = load_vocabulary(args.tokenizer, args.corpus) if args.tokenizer else None
    cpu: dict[str, list[float]] = {}
    for sampler in args.sampler or SAMPLERS:
        steps = [step_tables(s, sampler, vocabulary, np.random.default_rng(s)) for s in range(args.steps)]
        token_rows = sum(len(s["tokens"]["token_id"]) for s in steps)
        for repeat in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="bench-bytes-") as tmp:
                seconds = write_once(Path(tmp), steps)
                cpu.setdefault(sampler, []).append(seconds / token_rows * 1e6)
                if repeat == 0:
                    for table in ("tokens", "token_passes"):
                        rows, per_row, columns = column_bytes(Path(tmp), table)
                        if table == "tokens":  # the token ids the rows leave out are in the run's vocabulary
                            vocabulary_rows, vocabulary_bytes, _ = column_bytes(Path(tmp), "token_vocab")
                            columns["token_vocab"] = vocabulary_rows * vocabulary_bytes / rows
                            per_row += columns["token_vocab"]
                        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(columns.items(), key=lambda kv: -kv[1])
                                          if v >= 0.01)
                        print(f"{sampler}: {table}: {rows:,} rows, {per_row:.2f} B/row ({shown})", flush=True)
            print(f"{sampler}: write {cpu[sampler][-1]:.2f} CPU s per million token rows", flush=True)
    for sampler, values in cpu.items():
        print(f"{sampler}: median {statistics.median(values):.2f} CPU s per million token rows "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
