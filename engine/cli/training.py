"""`policylens train` (one process, or N under torchrun) and `policylens warmstart`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from engine.cli.common import CONFIG_COMMANDS, add_logs_dir, fail

TRAIN_EXAMPLES = """examples:
  policylens train --algo dapo --task linear --steps 200 --run-name dapo-linear
  policylens train --algo grpo --supervision process --run-name grpo-prm
  policylens train --config my.json --eps-high 0.3 --run-name custom     (file, then flags)
  policylens train --resume dapo-linear --steps 300                      (continue, same step numbering)
  policylens train --nproc 2 --algo dapo --run-name dapo-2               (2 data-parallel processes, torchrun)
  torchrun --nproc_per_node 2 -m engine.cli train --algo dapo --run-name dapo-2              (the same, by hand)
"""

# Fields that may change when a run is resumed; the rest of the saved config is the run's identity.
RESUME_OVERRIDABLE = ("steps", "eval_every", "checkpoint_every", "device", "log_tokens")


def add_train_command(subparsers) -> None:
    from engine.config import add_config_arguments

    parser = subparsers.add_parser(
        "train", help=CONFIG_COMMANDS["train"], epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a tiny policy with GRPO, DAPO, GSPO, ASPO ... and log every token of every step. "
        "Every config field is a flag; unset flags come from --config, then the algorithm preset.",
    )
    add_logs_dir(parser)
    parser.add_argument("--run-name", help="name of the new run (default: <algo>-<task>-<date>-<time>)")
    parser.add_argument("--config", metavar="FILE", help="JSON config file (field: value); flags override it")
    parser.add_argument("--resume", metavar="NAME", help="continue the run NAME from its last checkpoint")
    parser.add_argument("--cache-dir", help="where warm-started models are cached (default: <logs-dir>/.cache)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the model is tiny, and on a busy 2-core machine two "
                        "threads run far slower than one; 0 = torch's choice)")
    parser.add_argument("--warm-start-threads", type=int, default=None,
                        help="torch CPU threads while the warm start trains, when it is not cached yet (default: "
                        "--threads; 0: one per core, at most 4)")
    parser.add_argument("--warm-start-progress", metavar="FILE",
                        help="keep {step, steps, loss} of the warm start's SFT in this JSON file while it trains")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="train data-parallel on N processes on this machine (starts torchrun; the batch size "
                        "is global, split over the processes in whole groups)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    add_config_arguments(parser)
    parser.set_defaults(func=run_train)


def _check_local_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with the thread counts and paths train/warmstart were given (None: nothing), so that bad
    input fails at once instead of after the warm start."""
    for flag in ("threads", "warm_start_threads"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            return f"--{flag.replace('_', '-')} must be >= 0 (0: automatic), got {value}"
    for flag in ("logs_dir", "cache_dir"):
        value = getattr(args, flag, None)
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            return f"--{flag.replace('_', '-')} {value} is a file, not a folder"
    for flag in ("warm_start_progress", "progress_file"):
        value = getattr(args, flag, None)
        if value is not None and (not Path(value).name or not Path(value).resolve().parent.is_dir()):
            return f"--{flag.replace('_', '-')} {value!r}: give a file in an existing folder"
    return None



def run_train(args: argparse.Namespace) -> int:
    import json

    from engine.config import ConfigError, TrainConfig, config_from_args, knob_fields
    from engine.runlog.layout import RUN_JSON, RunInfo, RunLogError, validate_run_name

    if (problem := _check_local_paths(args)) is not None:
        return fail("train", problem)
    try:
        # Names are checked before anything is read or trained: '' is an error, not "no name given", and a name
        # can never lead outside the logs folder.
        if args.resume is not None:
            validate_run_name(args.resume, args.logs_dir)
            if args.run_name is not None and args.run_name != args.resume:
                return fail("train", f"--run-name {args.run_name!r} with --resume {args.resume!r}: a resumed run "
                             "keeps its name")
        elif args.run_name is not None:
            validate_run_name(args.run_name, args.logs_dir)
    except RunLogError as err:
        return fail("train", err)
    try:
        if args.resume is not None:
            run_dir = Path(args.logs_dir) / args.resume
            if not (run_dir / RUN_JSON).is_file():
                return fail("train", f"no run {args.resume!r} in {args.logs_dir} (no {RUN_JSON})")
            try:
                saved = RunInfo.read(run_dir).train_config()
            except RunLogError as err:
                return fail("train", f"cannot resume {args.resume!r}: {RUN_JSON} is unreadable ({err})")
            given = {f.name: getattr(args, f.name) for f in knob_fields() if getattr(args, f.name) is not None}
            fixed = sorted(k for k in given if k not in RESUME_OVERRIDABLE and given[k] != saved.get(k))
            if fixed or args.config:
                return fail("train", f"--resume continues the saved config; only {', '.join(RESUME_OVERRIDABLE)} "
                             f"may change (got {', '.join(fixed) or '--config'})")
            cfg = TrainConfig.from_dict(saved, **given)
            name = args.resume
        else:
            cfg = config_from_args(args)
            name = args.run_name if args.run_name is not None else (
                f"{cfg.algo}-{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    except ConfigError as err:
        return fail("train", err)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from engine.distributed import check_world, launched_by_torchrun, world_size_from_env

    under_torchrun = launched_by_torchrun()
    nproc = args.nproc if args.nproc is not None else world_size_from_env()
    try:
        check_world(cfg, nproc)
    except ConfigError as err:
        return fail("train", err)
    if under_torchrun and args.nproc is not None and args.nproc != world_size_from_env():
        return fail("train", f"--nproc {args.nproc} under torchrun, which started {world_size_from_env()} "
                     "processes: leave --nproc out (torchrun's --nproc_per_node sets it)")
    if under_torchrun and world_size_from_env() > 1 and args.resume is None and args.run_name is None:
        return fail("train", "name the run (--run-name) when starting it with torchrun: every process must log "
                     "into the same run")
    if nproc > 1 and not under_torchrun:
        return _launch_torchrun(args, nproc, name)

    from engine.rollout import DynamicSamplingError
    from engine.train import train

    try:  # train() checks the run's name and folder before the warm start
        status = train(cfg, name, args.logs_dir, resume=args.resume is not None, cache_dir=args.cache_dir,
                       progress=not args.no_progress, num_threads=args.threads or None,
                       warm_start_threads=args.warm_start_threads, warm_start_progress=args.warm_start_progress)
    except (RunLogError, DynamicSamplingError, FileNotFoundError, ValueError) as err:
        return fail("train", err)
    except KeyboardInterrupt:
        print(f"policylens train: aborted; run {name!r} marked stopped", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # once, not once per torchrun process
        print(f"run {name!r} {status}: {Path(args.logs_dir) / name}")
    return 0


def _launch_torchrun(args: argparse.Namespace, nproc: int, name: str) -> int:
    """`policylens train --nproc N ...`: the same command on N processes started by torchrun on this machine, the
    run's name fixed here so that every process logs into the same run."""
    import subprocess

    from engine.distributed import torchrun_command

    train_args = _without_nproc(args.argv[args.argv.index("train") + 1 :])
    if args.resume is None and args.run_name is None:
        train_args += ["--run-name", name]
    launcher = subprocess.Popen(torchrun_command(nproc, train_args))
    # SIGTERM to this process reaches torchrun, which stops its processes (instead of leaving them orphaned)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: launcher.terminate())
    try:
        while True:
            try:
                code = launcher.wait()
                break
            except KeyboardInterrupt:  # torchrun got Ctrl-C too and stops its processes: wait for it
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code:
        _mark_crashed(args.logs_dir, name)
        print(f"policylens train: torchrun exited with code {code}; run {name!r}: "
              f"{_run_status(args.logs_dir, name)}", file=sys.stderr)
    return code


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _mark_crashed(logs_dir: str, name: str) -> None:
    """After torchrun failed: a run.json still saying `running` (rank 0 was killed before it could record
    anything) says `crashed`. Nothing happens when the run does not exist or a writer still holds it."""
    from engine.runlog import RunInfo, RunLogError, RunWriter

    try:
        if RunInfo.read(Path(logs_dir) / name).status == "running":
            RunWriter.resume(logs_dir, name, background=False).close("crashed")  # fails while a writer holds it
    except (RunLogError, OSError, ValueError):
        pass


def _run_status(logs_dir: str, name: str) -> str:
    from engine.runlog import list_runs

    return next((r["status"] for r in list_runs(logs_dir) if r["run"] == name), "not created")


def add_warmstart_command(subparsers) -> None:
    from engine.config import add_config_arguments

    parser = subparsers.add_parser(
        "warmstart", help=CONFIG_COMMANDS["warmstart"],
        description="Supervised warm start of the built-in model, cached in the cache folder so that every "
        "`policylens train` with the same task, seed, model and SFT settings starts at once. Takes the same config "
        "flags as train; prints the held-out greedy accuracy of the warm start.",
    )
    add_logs_dir(parser)
    parser.add_argument("--cache-dir", help="where warm-started models are cached (default: <logs-dir>/.cache)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: one per core, at most 4, as the model is tiny; run it "
                        "when nothing else trains)")
    parser.add_argument("--progress-file", metavar="FILE",
                        help="keep {step, steps, loss} of the SFT in this JSON file (the demo's progress bar)")
    add_config_arguments(parser)
    parser.set_defaults(func=run_warmstart)


def run_warmstart(args: argparse.Namespace) -> int:
    from engine.config import ConfigError, config_from_args

    if (problem := _check_local_paths(args)) is not None:
        return fail("warmstart", problem)
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        return fail("warmstart", err)
    if cfg.model is not None:
        return fail("warmstart", f"--model {cfg.model} is used as it is; only the built-in model has a warm start")

    from engine.policy import greedy_accuracy, sft_progress_reporter
    from engine.tasks import get_task
    from engine.train import load_models, resolve_device

    task = get_task(cfg.task, seed=cfg.task_seed)
    cache_dir = args.cache_dir or Path(args.logs_dir) / ".cache"
    model, _, tokenizer, desc = load_models(cfg, task, resolve_device(cfg.device), cache_dir, sft_threads=args.threads,
                                            progress=sft_progress_reporter(args.progress_file))
    problems = list(task.heldout[: cfg.eval_size])
    accuracy = greedy_accuracy(model, tokenizer, task, problems, cfg.max_new_tokens)
    print(desc)
    print(f"held-out greedy accuracy {accuracy:.1%} on {len(problems)} prompts")
    return 0

