"""How large the sampler/trainer mismatch is on a task, for each cause alone (engine.sampler).

    python benchmarks/bench_mismatch.py                          # the tiny model on linear, 4 steps per cause
    python benchmarks/bench_mismatch.py --model-size default --steps 6 --batch-size 64

One run per cause (bf16 sampler; lag 1; lag 2; top-p 0.9; top-k 20; and the defaults as a control), same seed; over
the training tokens of every step after the first `lag` ones (a lagged sampler equals the trainer until then): the
mean |old_logp - sampler_logp|, the share of tokens whose ratio pi_trainer / pi_sampler leaves [0.9, 1.1] (the band
of TRL issue 6789), and verl's chi2_token; plus the seconds per step and the sampler copy's memory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CAUSES = {
    "defaults (float32, lag 0)": {},
    "bf16 sampler": {"sampler_dtype": "bfloat16"},
    "lag 1": {"sampler_lag": 1},
    "lag 2": {"sampler_lag": 2},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 20": {"top_k": 20},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None, help="warm-start cache (default: a temporary folder)")
    args = parser.parse_args()

    from engine.config import TrainConfig
    from engine.runlog import RunReader
    from engine.train import train

    logs = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    cache = args.cache_dir or logs / ".cache"
    base = dict(task="linear", model_size=args.model_size, batch_size=args.batch_size, group_size=4, eval_every=0,
                checkpoint_every=0, steps=args.steps, **({"sft_steps": 200} if args.model_size == "tiny" else {}))
    print(f"{'cause':28} {'mean |old-sampler|':>19} {'outside [0.9,1.1]':>18} {'chi2_token':>11} {'s/step':>7}")
    for i, (name, knobs) in enumerate(CAUSES.items()):
        run = f"cause-{i}"
        train(TrainConfig(**base, **knobs), run, logs, cache_dir=cache, progress=False, num_threads=args.threads)
        first = 1 + knobs.get("sampler_lag", 0)
        with RunReader(logs) as reader:
            row = reader.sql(
                "SELECT avg(abs(old_logp - sampler_logp)) AS gap, "
                "avg(CASE WHEN exp(old_logp - sampler_logp) NOT BETWEEN 0.9 AND 1.1 THEN 1.0 ELSE 0.0 END) AS off, "
                "avg(exp(2 * least(greatest(old_logp - sampler_logp, -20), 20))) - 1 AS chi2 "
                "FROM tokens WHERE run = ? AND step >= ? AND sampler_logp IS NOT NULL", [run, first]).iloc[0]
            seconds = reader.sql("SELECT median(step_seconds) AS s FROM steps WHERE run = ? AND step >= 1",
                                 [run]).iloc[0]["s"]
        print(f"{name:28} {row.gap:19.5f} {100 * row.off:17.2f}% {row.chi2:11.5f} {seconds:7.2f}")


if __name__ == "__main__":
    main()
