"""What every `policylens` command shares: the logs-folder flag, error and warning lines, the config commands."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_LOGS_DIR = "logs"

# The commands whose flags are engine.config's fields: building them imports the engine, and with it torch (about
# a second), so for any other command they are only named, and `policylens runs` or `sql` start at once.
CONFIG_COMMANDS = {
    "train": "train a policy and log every token",
    "warmstart": "build (or reuse) the cached warm start that `policylens train` with these flags uses",
}


def add_logs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logs-dir", default=DEFAULT_LOGS_DIR, help="folder holding the runs (default: logs)")


def passive_thread_waits() -> None:
    """Let torch's OpenMP threads sleep while they wait, instead of spinning (unless OMP_WAIT_POLICY is set): with
    one core kept busy by another process, spinning threads made the warm start's SFT about 10x slower. OpenMP
    reads this once, when torch loads it, so it is set before anything imports torch."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def fail(command: str, message: object) -> int:
    print(f"policylens {command}: error: {message}", file=sys.stderr)
    return 2


def warn_problems(command: str, problems: list[str], shown: set[str]) -> None:
    """Print each file or run the reader left out once (a query can find more: a damaged data page)."""
    for problem in problems:
        if problem not in shown:
            shown.add(problem)
            print(f"policylens {command}: warning: {problem}", file=sys.stderr)

