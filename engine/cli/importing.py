"""`policylens import`: other frameworks' rollout and token dumps as runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.common import add_logs_dir

IMPORT_EXAMPLES = """examples:
  policylens import trl runs/qwen-grpo --run-name qwen-grpo         (TRL output_dir, log_completions=True)
  policylens import verl ckpt/rollouts --run-name verl-gsm8k --tokenizer ~/models/qwen --follow
  policylens import prime-rl outputs/ --tokenizer ~/models/qwen     (token_exports/step_<N>/rank_<R>.jsonl)
  policylens import nemo-rl logs/exp_001 --tokenizer ~/models/qwen  (train_data_step<N>.jsonl)
  policylens import slime debug/ --tokenizer ~/models/qwen          (--save-debug-rollout-data / -train-data)
"""
IMPORT_SOURCES = ("trl", "verl", "prime-rl", "nemo-rl", "slime")  # = engine.importers.SOURCES (not imported here)


def add_import_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "import", help="import the rollouts or tokens another trainer dumped into a run (again: only new steps)",
        epilog=IMPORT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=IMPORT_SOURCES, help="the trainer that wrote the folder")
    parser.add_argument("folder", help="TRL: the output_dir (completions/ inside); verl: trainer.rollout_data_dir; "
                        "prime-rl: the output_dir (token_exports/ inside); nemo-rl: the log_dir; slime: the folder "
                        "of the debug dumps")
    parser.add_argument("--run-name", help="the PolicyLens run to create or continue (default: the folder's name)")
    parser.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder: token texts (prime-rl, nemo-rl, "
                        "slime), or the tokens table from the text (trl, verl)")
    parser.add_argument("--follow", action="store_true", help="keep importing new files until Ctrl-C")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between looks with --follow")
    add_logs_dir(parser)
    parser.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from engine.importers import follow, import_run, run_name_from_folder
    from engine.runlog import RunLogError

    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"policylens import: {folder} is not a folder", file=sys.stderr)
        return 2
    run = args.run_name or run_name_from_folder(folder)

    def show(report) -> None:
        # Whole lines, in order, when stdout and stderr go to the same pipe (stdout is block-buffered there).
        for problem in report.problems:
            print(f"policylens import: {problem}", file=sys.stderr, flush=True)
        if report.imported or not args.follow:
            print(f"policylens import: run {report.run}: {len(report.imported)} step(s) imported"
                  + (f" ({report.imported[0]}..{report.imported[-1]})" if report.imported else "")
                  + (f", {report.already_there} already there" if report.already_there else ""), flush=True)

    try:
        if args.follow:
            follow(args.source, folder, args.logs_dir, run, args.tokenizer, interval=args.interval, on_report=show)
        else:
            show(import_run(args.source, folder, args.logs_dir, run, args.tokenizer))
    except RunLogError as err:
        print(f"policylens import: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


