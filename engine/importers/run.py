"""Writing what a format reader yields into a PolicyLens run, once (`import_run`) or as it grows (`follow`).

Importing is idempotent: a run made by importing the same folder is continued after its last step (a second
import of an unchanged folder adds nothing); any other existing run of that name is refused. A folder without a
single dump file of the format is an error naming what was expected, and creates nothing. Everything goes
through `RunWriter`; the steps already written stay whatever happens later.

`follow` keeps one writer open for the whole session (the run is not reopened at every look). The run's status is
`running` while a look writes steps and `finished` between looks, so a finished import never reads as running;
Ctrl-C closes it as `finished`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.importers.base import ImportReport, ReadContext, Step, StepReader
from engine.importers.nemo_rl import nemo_rl_steps
from engine.importers.prime_rl import prime_rl_steps
from engine.importers.slime import slime_steps
from engine.importers.trl import trl_steps
from engine.importers.verl import verl_steps
from engine.runlog import RunInfo, RunLogError, RunWriter, validate_run_name
from engine.runlog.layout import RUN_JSON

SOURCES: dict[str, StepReader] = {
    "trl": trl_steps, "verl": verl_steps, "prime-rl": prime_rl_steps, "nemo-rl": nemo_rl_steps, "slime": slime_steps,
}
ALGORITHM_OF_SOURCE = {"trl": "trl", "verl": "grpo", "prime-rl": "prime-rl", "nemo-rl": "grpo", "slime": "slime"}


class Importer:
    """One import target: a folder of `source` dumps into run `run`. `poll()` writes the steps not yet written
    through one writer, opened at the first step to write (so an empty or unreadable folder creates nothing)."""

    def __init__(self, source: str, folder, logs_dir, run: str, tokenizer_dir=None):
        if source not in SOURCES:
            raise RunLogError(f"unknown source {source!r}; accepted: {', '.join(SOURCES)}")
        self.source, self.folder, self.logs_dir, self.run = source, Path(folder), Path(logs_dir), run
        validate_run_name(run, self.logs_dir)
        self.tokenizer, self.token_text = _load_tokenizer(tokenizer_dir)
        self.writer: RunWriter | None = None
        self._check_existing()

    def _existing(self) -> RunInfo | None:
        """The run of that name already in the logs folder, if any."""
        if not (self.logs_dir / self.run / RUN_JSON).exists():
            return None
        try:
            return RunInfo.read(self.logs_dir / self.run)
        except RunLogError as err:
            raise RunLogError(f"{err}; pick another --run-name") from None

    def _check_existing(self) -> None:
        """Refuse a run of that name that is not an import of this folder from this source."""
        info = self._existing()
        if info is not None and info.config.get("import") != self._origin():
            raise RunLogError(f"run {self.run!r} already exists in {self.logs_dir} and is not an import of "
                              f"{self.folder} from {self.source}; pick another --run-name")

    def _origin(self) -> dict[str, str]:
        return {"source": self.source, "path": str(self.folder.resolve())}

    def _last_step(self) -> int | None:
        if self.writer is not None:
            return self.writer.last_step
        try:
            info = self._existing()
        except RunLogError:
            return None
        return None if info is None else info.last_step

    def _open(self) -> RunWriter:
        if self.writer is None:
            if (self.logs_dir / self.run / RUN_JSON).exists():
                self._check_existing()
                self.writer = RunWriter.resume(self.logs_dir, self.run)
            else:
                self.writer = RunWriter.create(
                    self.logs_dir, self.run, algorithm=ALGORITHM_OF_SOURCE[self.source], task="",
                    config={"import": self._origin()}, model=f"imported from {self.source}")
        else:
            self.writer.set_status("running")
        return self.writer

    def poll(self, settle: bool = False) -> ImportReport:
        """Write every step of the folder after the run's last step; the status is `finished` afterwards.

        The steps go through `RunWriter.log_stream`: straight into their final chunk folders, each row encoded
        once, the next step read while the previous one is encoded."""
        report = ImportReport(self.run)
        last = self._last_step()
        ctx = ReadContext(report, settle=settle, token_text=self.token_text, after=last)
        new_steps = (item for item in SOURCES[self.source](self.folder, ctx) if not self._already_there(item, last,
                                                                                                     report))
        first = next(new_steps, None)
        if first is None:
            return report
        writer = self._open()
        steps = _first_then_rest([first], new_steps)
        del first  # else the first step's rows stay in memory for the whole import
        report.imported = writer.log_stream(self._log_arguments(item) for item in steps)
        writer.set_status("finished")
        return report

    @staticmethod
    def _already_there(item: Step, last: int | None, report: ImportReport) -> bool:
        if last is not None and item.step <= last:
            report.already_there += 1
            return True
        return False

    def _log_arguments(self, item: Step) -> tuple[int, dict[str, Any]]:
        """(step, keyword arguments of `RunWriter.log_step`) of a step read from a dump."""
        tokens = item.tokens
        if tokens is None and self.tokenizer is not None:
            tokens, lengths = _token_rows(self.tokenizer, item.rollouts["completion"], self.token_text)
            item.rollouts["length"] = lengths
        metrics = item.metrics if item.metrics is not None else _metrics(item)
        return item.step, {"metrics": {**metrics, **item.extra}, "rollouts": item.rollouts, "tokens": tokens}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close("finished")
            self.writer = None


def _first_then_rest(box: list[Step], rest: Iterator[Step]) -> Iterator[Step]:
    """The step in `box`, then `rest`; the step is taken out of the box, so nothing keeps it once written
    (`itertools.chain([first], rest)` would hold it for the whole import)."""
    yield box.pop()
    yield from rest


def _load_tokenizer(tokenizer_dir):
    if tokenizer_dir is None:
        return None, None
    from transformers import AutoTokenizer

    from engine.rollout import TokenText

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise RunLogError(f"--tokenizer {tokenizer_dir}: no tokenizer there ({err}); accepted: a local "
                          "folder written by save_pretrained") from None
    return tokenizer, TokenText(tokenizer)


def _token_rows(tokenizer, completions: list[str], token_text) -> tuple[dict, list[int]]:
    """Tokens of dumps that hold text only (TRL, verl): the completion tokenized again, no log-probs."""
    ids_per_row = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    rows: dict[str, list] = {"rollout_id": [], "position": [], "token_id": [], "token_text": []}
    for rid, ids in enumerate(ids_per_row):
        rows["rollout_id"] += [rid] * len(ids)
        rows["position"] += list(range(len(ids)))
        rows["token_id"] += ids
        rows["token_text"] += [token_text.token(t) for t in ids]
    return rows, [len(ids) for ids in ids_per_row]


def _metrics(item: Step) -> dict[str, Any]:
    rewards = [r for r in item.rollouts["reward"] if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = (math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
           if mean is not None and len(rewards) > 1 else None)
    lengths = item.rollouts.get("length")
    return {"reward_mean": mean, "reward_std": std,
            "response_len_mean": sum(lengths) / len(lengths) if lengths else None,
            "response_len_max": max(lengths) if lengths else None}


def import_run(source: str, folder: str | os.PathLike, logs_dir: str | os.PathLike, run: str,
               tokenizer_dir: str | os.PathLike | None = None, settle: bool = False) -> ImportReport:
    """Import every step of `folder` (a dump folder of `source`, see SOURCES) not yet in run `run`."""
    importer = Importer(source, folder, logs_dir, run, tokenizer_dir)
    try:
        return importer.poll(settle)
    finally:
        importer.close()


def import_trl(output_dir, logs_dir, run, tokenizer_dir=None) -> ImportReport:
    """`import_run("trl", ...)`: a TRL output_dir with completions/completions_<step>.parquet."""
    return import_run("trl", output_dir, logs_dir, run, tokenizer_dir)


def import_verl(rollout_dir, logs_dir, run, tokenizer_dir=None) -> ImportReport:
    """`import_run("verl", ...)`: a verl trainer.rollout_data_dir with <step>.jsonl files."""
    return import_run("verl", rollout_dir, logs_dir, run, tokenizer_dir)


def follow(source: str, folder, logs_dir, run, tokenizer_dir=None, interval: float = 5.0,
           on_report: Callable[[ImportReport], None] = print, stop: Callable[[], bool] = lambda: False) -> None:
    """Import again every `interval` seconds (new files of a run still being written) until `stop()` is true,
    through one writer; a folder still without dump files is waited for (nothing is created meanwhile)."""
    importer = Importer(source, folder, logs_dir, run, tokenizer_dir)
    reported: set[str] = set()
    try:
        while True:
            report = importer.poll(settle=True)
            report.problems = [p for p in report.problems if p not in reported]  # each problem once
            reported.update(report.problems)
            on_report(report)
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                if stop():
                    return
                time.sleep(min(0.2, interval))
    finally:
        importer.close()
