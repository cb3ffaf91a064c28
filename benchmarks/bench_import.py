"""Import speed of a generated per-token dump: token rows per second and peak memory (issue 21).

    python benchmarks/bench_import.py                                   # prime-rl, 10k samples x 1k tokens, 10 steps
    python benchmarks/bench_import.py --samples 1000 --steps 1 --repeat 3
    python benchmarks/bench_import.py --format nemo-rl --export dumps/nemo-10k   # write once, reuse on later runs
    python benchmarks/bench_import.py --format slime --samples 1000 --steps 1
    python benchmarks/bench_import.py --ids uniform --export dumps/prime-10k-uniform

Writes a dump of N samples x T tokens (a quarter of them prompt, one prompt per 8 samples) in the format of
prime-rl's TokenExporter (`token_exports/step_<N>/rank_<R>.jsonl`, commit 289562d2), NeMo-RL's
`train_data_step<N>.jsonl` (commit 7ea279ab) or slime's debug rollout + train dumps (torch.save, format_version 2,
commit d92cb5de), see engine/importers/, with random values and token ids drawn by Zipf's law (`--ids uniform`:
the worst case, every id alike; see `token_draw`). Then imports it `--repeat` times, each time in a
fresh process into a fresh logs folder, without --tokenizer, and reports the median: token rows written per second
of wall time and per second of CPU time of the import (all threads; the machine may be shared: the load average
is printed with them; the process's total, interpreter start and imports included, is printed too), and
the process's peak RSS (ru_maxrss of the child, interpreter and libraries included). A step's samples are read
and written together, so memory follows the step size, not the number of steps. `--pythonpath DIR` imports the
`engine` of another checkout (to compare two versions on the same dump). Target (issue 21): >= 1M rows/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks beside this one
from bench_dashboard import REAL_VOCABULARY, zipf_tokens

FORMATS = ("prime-rl", "nemo-rl", "slime")


def token_draw(rng: random.Random, ids: str):
    """`draw(k)`: k token ids. "zipf": by Zipf's law over a real vocabulary, as the dashboard benchmark draws them
    (bench_dashboard.zipf_tokens), so a step of 750k tokens holds ~90k distinct ids, most of them rare; "uniform":
    every id of the first 50,000 alike, the worst case for anything kept per token text (a step's token texts x
    position buckets nearly all distinct)."""
    if ids == "uniform":
        return lambda k: [rng.randrange(50_000) for _ in range(k)]
    import numpy as np

    numbers = np.random.default_rng(rng.randrange(2**32))
    return lambda k: zipf_tokens(numbers, REAL_VOCABULARY, k)[0].tolist()


def _sequences(samples: int, tokens: int, steps: int, ids: str, seed: int = 0):
    """(step, index in step, token ids, prompt length, sampler and trainer log-probs, entropies) of every generated
    sample."""
    rng = random.Random(seed)
    draw = token_draw(rng, ids)
    per_step, prompt = samples // steps, tokens // 4
    floats = [round(rng.uniform(-3, 0), 6) for _ in range(4096)]  # log-probs; their negatives: entropies
    prompt_ids: list[int] = []
    for step in range(1, steps + 1):
        for i in range(per_step):
            if i % 8 == 0:  # groups of 8 samples share a prompt
                prompt_ids = draw(prompt)
            off = rng.randrange(2048)
            yield (step, i, prompt_ids + draw(tokens - prompt), prompt,
                   floats[off:off + tokens], floats[off + 1:off + 1 + tokens],
                   [-x for x in floats[off + 2:off + 2 + tokens]])


def write_prime_rl(root: Path, samples: int, tokens: int, steps: int, ids: str, ranks: int = 2) -> None:
    files: dict[int, object] = {}

    def finish_step() -> None:  # every rank's file written: the step is STABLE
        for f in files.values():
            f.close()
            (Path(f.name).parent / "STABLE").touch()

    for step, i, seq, prompt, sampler, trainer, entropy in _sequences(samples, tokens, steps, ids):
        if i == 0:
            finish_step()
            folder = root / "token_exports" / f"step_{step}"
            folder.mkdir(parents=True)
            files = {r: open(folder / f"rank_{r}.jsonl", "w") for r in range(ranks)}  # noqa: SIM115
        log_ratio = [t - s for t, s in zip(trainer, sampler, strict=True)]
        record = {"schema_version": 1, "step": step, "rank": i % ranks, "micro_step": 0, "micro_sequence_idx": i,
                  "export_sequence_idx": i // ranks, "env_name": "bench", "token_ids": seq,
                  "position_ids": list(range(tokens)), "loss_mask": [False] * prompt + [True] * (tokens - prompt),
                  "advantages": [0.5] * tokens, "inference_logprobs": sampler, "trainer_logprobs": trainer,
                  "entropy": entropy, "log_importance_ratio": log_ratio,
                  "importance_ratio": [math.exp(x) for x in log_ratio],
                  "mismatch_kl": [math.exp(x) - x - 1 for x in log_ratio], "is_masked": [False] * tokens,
                  "is_masked_high": [False] * tokens, "is_masked_low": [False] * tokens, "rl_weights": [1.0] * tokens}
        files[i % ranks].write(json.dumps(record, separators=(",", ":")) + "\n")
    finish_step()


def write_nemo_rl(root: Path, samples: int, tokens: int, steps: int, ids: str) -> None:
    root.mkdir(parents=True)
    f = None
    for step, i, seq, prompt, sampler, trainer, _ in _sequences(samples, tokens, steps, ids):
        if i == 0:
            if f is not None:
                f.close()
            f = open(root / f"train_data_step{step}.jsonl", "w")  # noqa: SIM115
        record = {"content": [["prompt text", "completion text"]], "rewards": [float(i % 2)],
                  "input_lengths": [tokens], "token_ids": [seq],
                  "token_loss_mask": [[0] * prompt + [1] * (tokens - prompt)],
                  "sample_loss_mask": [1.0], "advantages": [[0.5] * tokens], "generation_logprobs": [sampler],
                  "prev_logprobs": [trainer], "idx": i}
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
    if f is not None:
        f.close()


def write_slime(root: Path, samples: int, tokens: int, steps: int, ids: str) -> None:
    import torch

    root.mkdir(parents=True)
    rollout: list[dict] = []
    train: list[dict] = []

    def save(step: int) -> None:
        torch.save({"rollout_id": step, "samples": rollout}, root / f"rollout_{step}.pt")
        torch.save({"format_version": 2, "rollout_id": step, "rank": 0, "samples": train, "dp_shards": [],
                    "raw_reward": [s["reward"] for s in rollout]}, root / f"train_{step}_0.pt")
        rollout.clear()
        train.clear()

    last = None
    for step, i, seq, prompt, sampler, trainer, entropy in _sequences(samples, tokens, steps, ids):
        if last is not None and step != last:
            save(last)
        last, r = step, tokens - prompt
        rollout.append({"group_index": i // 8, "index": i, "prompt": "prompt text", "tokens": seq,
                        "response": "response text", "response_length": r, "reward": float(i % 2),
                        "loss_mask": [1] * r, "rollout_log_probs": sampler[prompt:], "status": "completed",
                        "remove_sample": False})
        as_tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
        train.append({"rollout_position": i, "sample_index": i, "data_parallel_rank": 0,
                      "tokens": torch.tensor(seq), "response_lengths": r,
                      "loss_masks": torch.ones(r, dtype=torch.int64),
                      "log_probs": as_tensor(trainer[prompt:]), "entropy": as_tensor(entropy[prompt:]),
                      "advantages": torch.full((r,), 0.5, dtype=torch.float64), "rewards": float(i % 2) - 0.5})
    if last is not None:
        save(last)


OPTIONS_FILE = "bench-options.json"
"""Written beside a generated dump: the options it was written with (a reused dump must match them)."""
WRITERS = {"prime-rl": write_prime_rl, "nemo-rl": write_nemo_rl, "slime": write_slime}


def child(source: str, export: Path, logs: Path) -> None:
    """One timed import (in its own process, so its peak RSS is its own): prints seconds and rows as JSON."""
    from engine.importers import Importer
    from engine.runlog import RunReader

    t0, cpu0 = time.perf_counter(), time.process_time()
    importer = Importer(source, export, logs, "bench")
    report = importer.poll()
    polled = time.perf_counter() - t0
    importer.close()  # nothing left to merge: the steps went straight into their final chunks (log_stream)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0  # CPU time of every thread
    with RunReader(logs) as reader:  # what was written, counted after the clock stopped
        rows = int(reader.sql("SELECT count(*) FROM tokens WHERE run = 'bench'").iloc[0, 0])
    print(json.dumps({"seconds": seconds, "cpu": cpu, "polled": polled, "rows": rows, "steps": len(report.imported),
                      "problems": report.problems}))


def timed_import(source: str, export: Path, work: Path, pythonpath: str) -> dict:
    logs = work / f"logs-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    with open(work / "child.out", "w+") as out:
        process = subprocess.Popen([sys.executable, __file__, "--child", source, str(export), str(logs)],
                                   stdout=out, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        out.seek(0)
        text = out.read()
    shutil.rmtree(logs, ignore_errors=True)
    if status != 0:
        raise SystemExit(f"the import failed (status {status}): {text}")
    result = json.loads(text.strip().splitlines()[-1])
    return {**result, "process_cpu": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=FORMATS, default="prime-rl")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=1_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ids", choices=("zipf", "uniform"), default="zipf",
                        help="how token ids are drawn (see token_draw): zipf, as a text's; uniform, the worst case")
    parser.add_argument("--export", type=Path, help="where the dump is written (reused if it exists and was written "
                                                    "with the same options; default: a temporary folder, deleted "
                                                    "afterwards)")
    parser.add_argument("--pythonpath", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout whose engine is imported (default: this one)")
    parser.add_argument("--child", nargs=3, metavar=("SOURCE", "EXPORT", "LOGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-import-"))
    export = args.export or work / "export"
    try:
        written_with = {"format": args.format, "samples": args.samples, "tokens": args.tokens, "steps": args.steps,
                        "ids": args.ids}
        if not export.exists():
            t0 = time.perf_counter()
            WRITERS[args.format](export, args.samples, args.tokens, args.steps, args.ids)
            (export / OPTIONS_FILE).write_text(json.dumps(written_with))
            print(f"wrote {args.format} dump: {args.samples} samples x {args.tokens} tokens in {args.steps} steps, "
                  f"{args.ids} token ids ({time.perf_counter() - t0:.0f} s)")
        elif not (export / OPTIONS_FILE).exists() or json.loads((export / OPTIONS_FILE).read_text()) != written_with:
            raise SystemExit(f"--export {export} holds a dump written with other options than {written_with} "
                             f"(see its {OPTIONS_FILE}); name another folder")
        size = sum(p.stat().st_size for p in export.rglob("*") if p.is_file())  # symlinked folders not counted
        runs = []
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            runs.append({**timed_import(args.format, export, work, args.pythonpath), "load": load})
            r = runs[-1]
            print(f"  {r['rows']:,} token rows, {r['steps']} steps in {r['seconds']:.2f} s "
                  f"(closing {r['seconds'] - r['polled']:.2f} s), cpu {r['cpu']:.2f} s (process "
                  f"{r['process_cpu']:.2f} s), peak RSS {r['peak_mb']:.0f} MB, load {load:.1f}", flush=True)
        rows = runs[0]["rows"]
        wall = statistics.median(r["seconds"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        starts = ", ".join(f"{r['load']:.1f}" for r in runs)
        print(f"{args.format} {args.samples} x {args.tokens}, {args.ids} ids ({size / 1e9:.2f} GB, {rows:,} completion "
              "token rows): "
              f"median {rows / wall / 1e6:.3f} M rows/s wall ({wall:.2f} s), {rows / cpu / 1e6:.3f} M rows per CPU-s "
              f"({cpu:.2f} s CPU, {size / cpu / 1e6:.0f} MB of dump per CPU-s); peak RSS median "
              f"{statistics.median(r['peak_mb'] for r in runs):.0f} MB; load average {os.getloadavg()[0]:.1f} "
              f"(at the runs' starts {starts}), {os.cpu_count()} cores")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
