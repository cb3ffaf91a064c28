"""Train the comparison runs of docs/mismatch.md and docs/algorithms.md, then tabulate and plot them.

    python benchmarks/compare_runs.py --logs-dir runs-logs                     # train (or continue) both groups
    python benchmarks/compare_runs.py --logs-dir runs-logs --from-logs         # only the tables and the figures
    python benchmarks/compare_runs.py --logs-dir runs-logs --group entropy --steps 150

Two groups of runs on the default task and model, same seed, same step count:
- `mismatch`: GRPO sampling with a bf16 sampler whose weights lag 2 updates, without correction and with token TIS,
  a sequence-level IcePop mask and verl's seq_mean_k3 rejection (each at its documented default threshold);
- `entropy`: GRPO, Clip-Cov and KL-Cov (their presets).

Runs are trained with `policylens train`, one torch thread each, at most `--parallel` at a time, in chunks of
`--chunk` steps taken round robin (each chunk resumes the run from its checkpoint, which continues it exactly), so
that every run of a group reaches the same step even if the training is stopped early; running the script again
continues where it stopped (a checkpoint keeps a lagging sampler's window of stale weights, so a resumed run samples
as the uninterrupted one would). Each chunk prints its
CPU seconds per step (the process's own user + system time, startup and evaluations included, which a busy machine
inflates far less than the wall time) next to the load average.

The report compares the runs of a group at the last evaluated step they all reached: a markdown table on stdout
(or `--markdown FILE`) and the curves as a PNG (`--out-dir`, default docs/), drawn with the dashboard's own curve
figure and exported by kaleido as in scripts/plot_curves.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STALE_BF16 = ["--sampler-dtype", "bfloat16", "--sampler-lag", "2"]
GROUPS: dict[str, list[tuple[str, str, list[str]]]] = {  # group -> (run name, label, train flags)
    "mismatch": [
        ("mm-none", "no correction", ["--algo", "grpo", *STALE_BF16]),
        ("mm-tis", "token TIS (u = 2)", ["--algo", "grpo", *STALE_BF16, "--rollout-is", "token"]),
        # verl's sequence-level IS with a lower_upper threshold: IcePop's mask on the sequence ratio, verl's preset
        ("mm-seqmask", "sequence mask (IcePop 0.5_5.0)",
         ["--algo", "grpo", *STALE_BF16, "--rollout-is", "sequence", "--rollout-is-threshold", "0.5_5.0"]),
        ("mm-rs", "rejection seq_mean_k3 (0.01)", ["--algo", "grpo", *STALE_BF16, "--rollout-rs", "seq_mean_k3"]),
    ],
    "entropy": [
        ("ent-grpo", "GRPO", ["--algo", "grpo"]),
        ("ent-clip-cov", "Clip-Cov", ["--algo", "clip_cov"]),
        ("ent-kl-cov", "KL-Cov", ["--algo", "kl_cov"]),
    ],
}
SPAN = 10  # steps averaged at the start and at the end of a run for the tables' "early -> late" cells
FIGURES = {"mismatch": "mismatch_runs.png", "entropy": "entropy_runs.png"}
CURVES = {
    "mismatch": [("heldout_accuracy", "held-out accuracy (greedy)"),
                 ("heldout_accuracy_sampled", "held-out accuracy (sampled)"),
                 ("mismatch_out_of_band", "tokens with ratio outside [0.9, 1.1]"),
                 ("mismatch_chi2_token", "chi-square per token (verl chi2_token)")],
    "entropy": [("heldout_accuracy", "held-out accuracy (greedy)"),
                ("heldout_accuracy_sampled", "held-out accuracy (sampled)"),
                ("entropy", "mean token entropy (nats)"),
                ("kl", "KL to the reference (k3)")],
}


# ---------------------------------------------------------------------------------------------------------------
# training


def last_step(logs_dir: Path, run: str) -> int:
    """The newest step a run has logged, -1 if it has none (or does not exist)."""
    from engine.runlog import RunReader

    if not (logs_dir / run / "run.json").is_file():
        return -1
    with RunReader(logs_dir) as reader:
        value = reader.sql("SELECT max(step) AS s FROM steps WHERE run = ?", [run]).iloc[0]["s"]
    return -1 if value is None or value != value else int(value)


def chunk_command(logs_dir: Path, run: str, flags: list[str], done: int, upto: int, threads: int) -> list[str]:
    """`policylens train` for steps done+1..upto of a run: a new run when nothing is logged, else a resume."""
    base = [sys.executable, "-m", "engine.cli", "train", "--logs-dir", str(logs_dir), "--steps", str(upto),
            "--threads", str(threads), "--no-progress"]
    return base + (["--resume", run] if done >= 0 else ["--run-name", run, "--seed", "0", *flags])


def train_round_robin(logs_dir: Path, runs: list[tuple[str, str, list[str]]], steps: int, chunk: int,
                      parallel: int, threads: int) -> None:
    """Bring every run to `steps`, `chunk` steps at a time, the least advanced run first, `parallel` at once."""
    done = {run: last_step(logs_dir, run) for run, _, _ in runs}
    flags = {run: f for run, _, f in runs}
    running: dict[int, tuple[str, int, float, subprocess.Popen]] = {}  # pid -> (run, upto, start, process)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    while True:
        busy = {run for run, *_ in running.values()}
        waiting = sorted((done[run], i, run) for i, (run, _, _) in enumerate(runs)
                         if done[run] < steps and run not in busy)
        while waiting and len(running) < parallel:
            _, _, run = waiting.pop(0)
            upto = min(steps, (max(done[run], 0) // chunk + 1) * chunk)
            cmd = chunk_command(logs_dir, run, flags[run], done[run], upto, threads)
            with open(logs_dir / f"{run}.train.log", "a") as log:  # the child keeps its own handle
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[proc.pid] = (run, upto, time.time(), proc)
        if not running:
            return
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        run, upto, start, _ = running.pop(pid)
        before, done[run] = done[run], last_step(logs_dir, run)
        advanced = done[run] - max(before, 0)
        cpu = usage.ru_utime + usage.ru_stime
        load = os.getloadavg()[0]
        per_step = f"{cpu / advanced:.2f} CPU s/step" if advanced > 0 else "no step"
        print(f"{run}: steps {before} -> {done[run]} (exit {os.waitstatus_to_exitcode(status)}), "
              f"{time.time() - start:.0f} s wall, {cpu:.0f} CPU s, {per_step}, load average {load:.1f}", flush=True)
        if done[run] < upto:
            raise SystemExit(f"{run} stopped at step {done[run]} before {upto}: see {logs_dir / run}.train.log")


# ---------------------------------------------------------------------------------------------------------------
# report


def group_steps(reader, runs: list[tuple[str, str, list[str]]]):
    """Every step of the group's runs, `run` replaced by its label, the mismatch_* keys of `extra` as columns."""
    import pandas as pd

    frames = []
    for run, label, _ in runs:
        frame = reader.sql("SELECT * FROM steps WHERE run = ? ORDER BY step", [run])
        extra = pd.DataFrame([json.loads(x) if isinstance(x, str) else {} for x in frame["extra"]],
                             index=frame.index)
        frames.append(pd.concat([frame.drop(columns=["extra"]), extra], axis=1).assign(run=label))
    return pd.concat(frames, ignore_index=True)


def compared_runs(runs, steps) -> tuple[list, int]:
    """The runs evaluated after their warm start, and the last evaluated step all of them reached."""
    last = steps[steps["heldout_accuracy"].notna()].groupby("run")["step"].max()  # by label
    kept = [run for run in runs if last.get(run[1], 0) > 0]
    return kept, min((int(last[label]) for _, label, _ in kept), default=0)


def early_late(frame, column: str, first: int) -> str:
    """Mean of a per-step metric over its first SPAN logged steps from `first` on, then over its last SPAN."""
    values = frame[frame["step"] >= first].dropna(subset=[column]) if column in frame else frame.iloc[0:0]
    if values.empty:
        return "-"
    return f"{values[column].head(SPAN).mean():.4g} -> {values[column].tail(SPAN).mean():.4g}"


def accuracy_cells(frame, upto: int) -> list[str]:
    """Greedy held-out accuracy at the warm start -> at `upto` (best), and the sampled one."""
    evaluated = frame[frame["heldout_accuracy"].notna() & (frame["step"] <= upto)].set_index("step")
    start, end = evaluated.loc[0], evaluated.loc[upto]
    return [f"{start.heldout_accuracy:.1%} -> {end.heldout_accuracy:.1%} ({evaluated.heldout_accuracy.max():.1%})",
            f"{start.heldout_accuracy_sampled:.1%} -> {end.heldout_accuracy_sampled:.1%}"]


def dropped_share(reader, run: str, upto: int) -> str:
    """Share of the loss tokens (all passes) that a correction took out of the loss or weighed 0."""
    row = reader.sql("SELECT avg(CASE WHEN rejected <> 0 THEN 1.0 ELSE 0.0 END) AS share FROM token_passes "
                     "WHERE run = ? AND step <= ? AND rejected IS NOT NULL", [run, upto]).iloc[0]
    return "-" if row["share"] != row["share"] else f"{row['share']:.2%}"


def cov_selected(reader, run: str, upto: int) -> str:
    """Token-passes the covariance rule of Clip-Cov / KL-Cov selected (clip code 4), per step and as a share."""
    row = reader.sql("SELECT sum(CASE WHEN clip = 4 THEN 1 ELSE 0 END) AS n, count(*) AS total, "
                     "count(DISTINCT step) AS steps FROM token_passes WHERE run = ? AND step <= ?",
                     [run, upto]).iloc[0]
    return "-" if not row["total"] else f"{row['n'] / row['steps']:.1f} ({row['n'] / row['total']:.3%})"


def mismatch_table(reader, runs, steps, upto: int) -> list[str]:
    lag = 2  # a sampler lagging 2 updates equals the trainer's weights until step 3
    lines = [f"| run | held-out greedy: warm start -> step {upto} (best) | sampled | outside [0.9, 1.1] | "
             "mean abs log-ratio | chi2_token | tokens dropped or weighed 0 | IS weight mean / ESS |",
             "|---|---|---|---|---|---|---|---|"]
    for run, label, _ in runs:
        frame = steps[(steps["run"] == label) & (steps["step"] <= upto)]
        weights = (f"{frame['mismatch_is_weight_mean'].mean():.4f} / {frame['mismatch_is_weight_ess'].mean():.4f}"
                   if "mismatch_is_weight_mean" in frame and frame["mismatch_is_weight_mean"].notna().any() else "-")
        lines.append("| " + " | ".join([label, *accuracy_cells(frame, upto),
                                         *(early_late(frame, "mismatch_" + m, lag + 1)
                                           for m in ("out_of_band", "mean_abs_log_ratio", "chi2_token")),
                                         dropped_share(reader, run, upto), weights]) + " |")
    return lines


def entropy_table(reader, runs, steps, upto: int) -> list[str]:
    lines = [f"| run | held-out greedy: warm start -> step {upto} (best) | sampled | "
             f"entropy: steps 1-{SPAN} -> last {SPAN} | lowest step entropy | KL to reference, last {SPAN} | "
             "token-passes the cov rule selected per step |",
             "|---|---|---|---|---|---|---|"]
    for run, label, _ in runs:
        frame = steps[(steps["run"] == label) & (steps["step"] <= upto)]
        lines.append("| " + " | ".join([label, *accuracy_cells(frame, upto), early_late(frame, "entropy", 1),
                                         f"{frame['entropy'].min():.4f}", f"{frame['kl'].tail(SPAN).mean():.4g}",
                                         cov_selected(reader, run, upto)])
                     + " |")
    return lines


def curves_png(steps, group: str, upto: int, path: Path) -> None:
    """The group's curves up to `upto`, with the dashboard's metric_curves figure, as a PNG."""
    from dashboard.charts import metric_curves
    from scripts.plot_curves import export_png

    width, height = 1100, 700
    figure = metric_curves(steps[steps["step"] <= upto], CURVES[group])
    title = {"mismatch": "GRPO with a bf16 sampler lagging 2 updates: corrections compared (x: training step)",
             "entropy": "GRPO, Clip-Cov and KL-Cov on the default task (x: training step)"}[group]
    figure.update_layout(title={"text": title, "x": 0.5, "xanchor": "center", "y": 0.98}, width=width,
                         height=height, margin={"t": 110, "b": 60}, template="plotly_white")
    export_png(figure, path, width, height)


def report(logs_dir: Path, groups: list[str], out_dir: Path | None) -> list[str]:
    from engine.runlog import RunReader

    lines = []
    with RunReader(logs_dir) as reader:
        for group in groups:
            runs, steps = GROUPS[group], group_steps(reader, GROUPS[group])
            kept, upto = compared_runs(runs, steps)
            lines += [f"### {group}: {len(kept)} of {len(runs)} runs compared at step {upto}", ""]
            if missing := [run[1] for run in runs if run not in kept]:
                lines += [f"Not evaluated after the warm start yet: {', '.join(missing)}.", ""]
            if not kept:
                continue
            steps = steps[steps["run"].isin([label for _, label, _ in kept])]
            table = mismatch_table(reader, kept, steps, upto) if group == "mismatch" else entropy_table(
                reader, kept, steps, upto)
            lines += [*table, ""]
            if out_dir is not None:
                curves_png(steps, group, upto, out_dir / FIGURES[group])
                lines += [f"(curves: {out_dir / FIGURES[group]})", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs-dir", default="logs")
    ap.add_argument("--group", choices=[*GROUPS, "all"], default="all")
    ap.add_argument("--steps", type=int, default=150, help="steps of every run (default: 10 quiet CPU minutes)")
    ap.add_argument("--chunk", type=int, default=10, help="steps per training process, taken round robin")
    ap.add_argument("--parallel", type=int, default=2, help="training processes at a time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    ap.add_argument("--from-logs", action="store_true", help="train nothing: report on the runs already logged")
    ap.add_argument("--out-dir", default=str(ROOT / "docs"), help="where the PNG curves go")
    ap.add_argument("--no-png", action="store_true", help="only the tables")
    ap.add_argument("--markdown", help="also write the tables to this file")
    args = ap.parse_args(argv)

    logs_dir = Path(args.logs_dir)
    groups = list(GROUPS) if args.group == "all" else [args.group]
    if not args.from_logs:
        logs_dir.mkdir(parents=True, exist_ok=True)
        train_round_robin(logs_dir, [run for g in groups for run in GROUPS[g]], args.steps, args.chunk,
                          args.parallel, args.threads)
    lines = report(logs_dir, groups, None if args.no_png else Path(args.out_dir))
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
