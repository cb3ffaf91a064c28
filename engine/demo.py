"""The demo comparison: one task, one seed, one warm-started model, trained seven ways, logging live.

`policylens demo` (the README's run command) starts it in the background when the logs folder holds no demo runs
yet, then serves the dashboard, which shows the runs filling in. The dashboard's empty state starts the same demo
with one button (`start_demo`) and follows it with `demo_progress`.

How it runs:
1. One supervisor process (`python -m engine.demo`) owns the demo; its pid is kept in `<logs>/.demo/pid`, so a
   second start while it lives is a no-op.
2. The first run builds the shared cached warm start alone, on every core (it reports its SFT progress in
   `<logs>/.demo/warmstart.json`); once it has logged its first step the other six start, and all seven train
   side by side, each in its own `policylens train` process with one thread, so all curves fill in together.
3. Runs already finished are kept; runs stopped or crashed part way are resumed (losing at most the step in
   flight); `--fresh` deletes the demo runs (and only those) and trains them again.
4. Stopping the supervisor (Ctrl-C on `policylens demo`, or SIGTERM) sends SIGINT to every training process:
   each stops after its current step and marks its run `stopped`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoRun:
    """One run of the demo comparison."""

    name: str
    algo: str
    supervision: str = "outcome"
    flags: tuple[str, ...] = ()  # more `policylens train` flags of this run


MISMATCH_DEMO_STEPS = 15

DEMO_RUNS = (
    DemoRun("demo-grpo", "grpo"),
    DemoRun("demo-grpo-process", "grpo", "process"),
    DemoRun("demo-dapo", "dapo"),
    DemoRun("demo-gspo", "gspo"),
    DemoRun("demo-aspo", "aspo"),
    DemoRun("demo-ppo", "ppo"),  # the critic GRPO removed: the Advantages page compares it with GRPO's schemes
    # GRPO sampled as an asynchronous rollout engine would: a bfloat16 copy of the policy two updates behind, so
    # the Mismatch page shows a real sampler/trainer gap next to demo-grpo's. A CPU without bf16 instructions
    # emulates them (a step costs about 2.5 times demo-grpo's), so it trains 15 steps, not 30, to keep the demo
    # within its time.
    DemoRun("demo-grpo-bf16-lag2", "grpo",
            flags=("--sampler-dtype", "bfloat16", "--sampler-lag", "2", "--steps", str(MISMATCH_DEMO_STEPS))),
)
DEMO_TASK = "linear"
DEMO_SEED = 0
# Chosen so that the seven runs finish in under 20 minutes on 2 CPU cores (18.7 measured; 40 steps took 25-30): the
# held-out curves flatten by step 20 (docs/benchmarks.md, docs/mismatch.md).
DEMO_STEPS = 30
DEMO_EVAL_EVERY = 5
WARM_START_PROGRESS = "warmstart.json"


def _demo_dir(logs_dir: Path) -> Path:
    return Path(logs_dir) / ".demo"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_supervisor(logs_dir: str | Path) -> int | None:
    """The pid of the live demo supervisor for this logs folder, or None."""
    pid_file = _demo_dir(Path(logs_dir)) / "pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def _demo_run_infos(logs_dir: Path) -> dict[str, dict]:
    """The runs-table record (`status`, `last_step`, ...) of each demo run that exists, by name (one listing)."""
    from engine.runlog import RunLogError, list_runs

    names = {run.name for run in DEMO_RUNS}
    try:
        return {info["run"]: info for info in list_runs(logs_dir) if info["run"] in names}
    except RunLogError:
        return {}


def demo_runs_present(logs_dir: str | Path) -> bool:
    return bool(_demo_run_infos(Path(logs_dir)))


def warm_start_progress(logs_dir: str | Path) -> dict | None:
    """{step, steps, loss} of the demo's warm start while or after it trains, None before (or when it was cached)."""
    try:
        progress = json.loads((_demo_dir(Path(logs_dir)) / WARM_START_PROGRESS).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return progress if isinstance(progress, dict) else None


def demo_progress(logs_dir: str | Path) -> dict:
    """Progress of the demo: the warm start's SFT steps (`warm_start`, see warm_start_progress), per run its status
    and steps done, and the runs' overall fraction done in [0, 1]."""
    logs_dir = Path(logs_dir)
    infos = _demo_run_infos(logs_dir)
    runs = []
    for run in DEMO_RUNS:
        info = infos.get(run.name, {})
        total = int((info.get("config") or {}).get("steps") or DEMO_STEPS)  # the run's own target once it exists
        done = min(int(info.get("last_step") or 0), total)
        runs.append({"run": run.name, "status": info.get("status", "waiting"), "steps_done": done, "steps": total})
    fraction = sum(r["steps_done"] for r in runs) / sum(r["steps"] for r in runs)
    return {"running": running_supervisor(logs_dir) is not None, "fraction": fraction, "runs": runs,
            "warm_start": warm_start_progress(logs_dir)}


def start_demo(logs_dir: str | Path, fresh: bool = False, train_args: tuple[str, ...] = ()) -> int:
    """Start the demo supervisor in the background (unless one is already running); returns its pid.

    `train_args` are extra `policylens train` flags for every demo run (the tests use them to train tiny runs).
    """
    logs_dir = Path(logs_dir).resolve()
    pid = running_supervisor(logs_dir)
    if pid is not None:
        return pid
    demo_dir = _demo_dir(logs_dir)
    demo_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "engine.demo", "--logs-dir", str(logs_dir)]
    if fresh:
        command.append("--fresh")
    command += ["--", *train_args]
    with open(demo_dir / "demo.log", "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    (demo_dir / "pid").write_text(str(process.pid))
    return process.pid


def stop_demo(logs_dir: str | Path, timeout: float = 60.0) -> None:
    """Ask the supervisor to stop its training processes cleanly, and wait for it."""
    pid = running_supervisor(logs_dir)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):  # reap it when it is our child: a zombie still answers kill(0)
            os.waitpid(pid, os.WNOHANG)
        if not _pid_alive(pid):
            return
        time.sleep(0.2)


def _train_command(run: DemoRun, logs_dir: Path, resume: bool, train_args: list[str]) -> list[str]:
    base = [sys.executable, "-m", "engine.cli", "train", "--logs-dir", str(logs_dir), "--no-progress"]
    if resume:  # the saved config is reused; the extra flags must agree with it
        return [*base, "--resume", run.name, *train_args]
    return [
        *base,
        "--algo", run.algo,
        "--task", DEMO_TASK,
        "--supervision", run.supervision,
        "--steps", str(DEMO_STEPS),
        "--eval-every", str(DEMO_EVAL_EVERY),
        "--seed", str(DEMO_SEED),
        "--run-name", run.name,
        *run.flags,
        *train_args,
    ]  # fmt: skip


def _has_logged_a_step(logs_dir: Path, run: DemoRun) -> bool:
    """Whether the run has logged any step (its warm start is then built and cached)."""
    return _demo_run_infos(logs_dir).get(run.name, {}).get("last_step") is not None


def _supervise(logs_dir: Path, fresh: bool, train_args: list[str]) -> int:
    """Train the demo runs: the first new run alone until it has built the shared warm start, then all side by side."""
    demo_dir = _demo_dir(logs_dir)
    demo_dir.mkdir(parents=True, exist_ok=True)
    (demo_dir / "pid").write_text(str(os.getpid()))
    if fresh:
        for run in DEMO_RUNS:
            shutil.rmtree(logs_dir / run.name, ignore_errors=True)

    children: list[subprocess.Popen] = []
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    # One thread per run (the others' runs are the parallelism); waiting OpenMP threads sleep rather than spin, so
    # the warm start's threads do not stall when another process keeps a core busy (see bench_demo.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    infos = _demo_run_infos(logs_dir)
    # (run, whether it exists): existing unfinished runs are resumed, from their last logged step (a run killed
    # before any checkpoint restarts from the warm start; engine.checkpoints.checkpoint_for_resume).
    todo = [(run, run.name in infos) for run in DEMO_RUNS if infos.get(run.name, {}).get("status") != "finished"]

    # A run with no logged step yet builds the shared warm start alone, on every core (about 1.25x faster than one
    # thread on 2 idle cores), reporting its SFT progress for the dashboard, then trains on one thread. The other
    # runs start once it has logged its first step: they find the warm start cached and all train side by side,
    # one thread each (on a tiny model one thread per process wastes the least).
    def has_logged(run: DemoRun) -> bool:
        return infos.get(run.name, {}).get("last_step") is not None

    todo.sort(key=lambda item: has_logged(item[0]))  # runs with no logged step first
    builder = todo[0][0] if todo and not has_logged(todo[0][0]) else None
    progress_file = demo_dir / WARM_START_PROGRESS
    for run, resume in todo:
        if stopping:
            break
        command = _train_command(run, logs_dir, resume, train_args)
        if run is builder:
            command += ["--warm-start-threads", "0", "--warm-start-progress", str(progress_file)]
        child = subprocess.Popen(command, env=env)
        children.append(child)
        while run is builder and not stopping and child.poll() is None and not _has_logged_a_step(logs_dir, run):
            time.sleep(0.5)
    failures = sum(child.wait() != 0 for child in children)
    (demo_dir / "pid").unlink(missing_ok=True)
    return 1 if failures and not stopping else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the demo comparison's training (normally via `policylens demo`).")
    parser.add_argument("--logs-dir", required=True)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("train_args", nargs="*", help="extra `policylens train` flags, after --")
    args = parser.parse_args(argv)
    return _supervise(Path(args.logs_dir).resolve(), args.fresh, args.train_args)


if __name__ == "__main__":
    sys.exit(main())
