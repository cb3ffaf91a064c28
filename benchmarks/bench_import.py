"""Import speed of a generated prime-rl token export: token rows per second and peak memory.

    python benchmarks/bench_import.py                       # 10k samples x 1k tokens, 10 steps (issue 21)
    python benchmarks/bench_import.py --samples 2000 --steps 2

Writes `token_exports/step_<N>/rank_<R>.jsonl` in the format of prime-rl's TokenExporter (commit 289562d2;
see engine/importers/prime_rl.py) with random values, then times `policylens import prime-rl` of it (without
--tokenizer) into a fresh logs folder. Peak memory is the process's max RSS after the import minus before it
(ru_maxrss), so it shows what the import adds: it depends on the step size, not on the number of steps.
Target (issue 21): >= 1M token rows per second.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path


def write_export(root: Path, samples: int, tokens: int, steps: int, ranks: int = 2, seed: int = 0) -> int:
    rng = random.Random(seed)
    per_step = samples // steps
    prompt = tokens // 4
    floats = [round(rng.uniform(-3, 0), 6) for _ in range(4096)]
    for step in range(1, steps + 1):
        folder = root / "token_exports" / f"step_{step}"
        folder.mkdir(parents=True)
        files = [open(folder / f"rank_{r}.jsonl", "w") for r in range(ranks)]  # noqa: SIM115
        for i in range(per_step):
            ids = [rng.randrange(50_000) for _ in range(prompt)] if i % 8 == 0 else ids  # noqa: F821
            seq = ids + [rng.randrange(50_000) for _ in range(tokens - prompt)]
            off = rng.randrange(2048)
            sampler, trainer = floats[off:off + tokens], floats[off + 1:off + 1 + tokens]
            log_ratio = [t - s for t, s in zip(trainer, sampler, strict=True)]
            record = {"schema_version": 1, "step": step, "rank": i % ranks, "micro_step": 0, "micro_sequence_idx": i,
                      "export_sequence_idx": i // ranks, "env_name": "bench", "token_ids": seq,
                      "position_ids": list(range(tokens)), "loss_mask": [False] * prompt + [True] * (tokens - prompt),
                      "advantages": [0.5] * tokens, "inference_logprobs": sampler, "trainer_logprobs": trainer,
                      "entropy": floats[off + 2:off + 2 + tokens], "log_importance_ratio": log_ratio,
                      "importance_ratio": [math.exp(x) for x in log_ratio],
                      "mismatch_kl": [math.exp(x) - x - 1 for x in log_ratio], "is_masked": [False] * tokens,
                      "is_masked_high": [False] * tokens, "is_masked_low": [False] * tokens,
                      "rl_weights": [1.0] * tokens}
            files[i % ranks].write(json.dumps(record, separators=(",", ":")) + "\n")
        for f in files:
            f.close()
        (folder / "STABLE").touch()
    return per_step * steps * (tokens - prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=1_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from engine.importers import Importer

    work = Path(tempfile.mkdtemp(prefix="bench-import-"))
    try:
        t0 = time.perf_counter()
        rows = write_export(work / "export", args.samples, args.tokens, args.steps)
        size = sum(p.stat().st_size for p in (work / "export").rglob("*.jsonl"))
        print(f"wrote {args.samples} samples x {args.tokens} tokens in {args.steps} steps: {size / 1e9:.2f} GB of "
              f"JSONL, {rows:,} completion token rows ({time.perf_counter() - t0:.1f} s)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        importer = Importer("prime-rl", work / "export", work / "logs", "bench")
        report = importer.poll()
        polled = time.perf_counter() - t0
        importer.close()  # merges the step folders into one chunk (RunWriter's compaction)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"imported {len(report.imported)} steps in {seconds:.2f} s ({polled:.2f} s reading and writing the "
              f"steps, {seconds - polled:.2f} s closing the run): {rows / seconds / 1e6:.3f} M token rows/s "
              f"({size / seconds / 1e6:.0f} MB/s of JSON); peak RSS {peak / 1024:.0f} MB "
              f"(+{(peak - before) / 1024:.0f} MB during the import)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
