"""`RunWriter`: appends steps to one run, a whole step visible at once, encoding on a writer thread.

A step's files are written into a ``.tmp-`` folder, renamed into place in one ``os.rename`` (the commit point), so a
kill (SIGKILL included) loses at most the step being written; the writer thread is at most one step behind the
caller. The rows are built by `engine.runlog.schema`; compaction and truncation are `engine.runlog.repair`'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.runlog import repair
from engine.runlog.derived import TokenVocabulary, stored_passes, stored_tokens
from engine.runlog.files import FolderWriter, write_folder
from engine.runlog.layout import (
    STATUSES,
    RunInfo,
    RunLogError,
    WriterLock,
    check_rank,
    chunk_dir,
    data_dir_of,
    lock_path,
    next_seq,
    rank_of_segment_name,
    remove_tree,
    scan_segments,
    step_dir,
    validate_run_name,
)
from engine.runlog.schema import VOCABULARY_TABLE, steps_row, table_rows
from engine.runlog.summary import step_summary

_ROW_TABLES = ("rollouts", "tokens", "token_passes", "prm_steps", "ref_tokens")  # `steps` comes from the metrics


class RunWriter:
    """Appends steps to one run. One writer per (run, rank); readers never block it and it never blocks them.

    Use `RunWriter.create` for a new run and `RunWriter.resume` to continue one; both work as context managers
    (finished on normal exit, stopped on KeyboardInterrupt, crashed on any other exception).
    """

    def __init__(self, logs_dir: Path, name: str, rank: int, info: RunInfo, lock: WriterLock,
                 compact_every: int = 32, background: bool = True):
        self.logs_dir = Path(logs_dir)
        self.name = name
        self.rank = rank
        self.run_dir = self.logs_dir / name
        self.data_dir = data_dir_of(self.run_dir)
        self.info = info
        self.compact_every = compact_every
        self._lock = lock
        self._created_unix = float(info.created_unix or time.time())
        self._last_log_time: float | None = None
        self.last_step: int | None = self._last_logged()
        self._vocabulary = self._load_vocabulary()
        self._closed = False
        self._meta_lock = threading.Lock()
        # Parquet encoding releases the GIL, so one writer thread overlaps it with the next training step.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"runlog-{name}") if background else None
        self._pending: Future | None = None
        self._superseded: list[tuple[float, list[Path]]] = []  # (when replaced, folders) awaiting deletion
        self._deleter: threading.Thread | None = None  # deletes them after `close`
        # Part of every step folder's name (see `layout.step_dir`).
        self._session = f"{time.time_ns() // 1000:x}"

    # ---- opening

    @classmethod
    def create(
        cls,
        logs_dir: str | os.PathLike,
        name: str,
        *,
        algorithm: str = "",
        task: str = "",
        config: Mapping[str, Any] | Any = None,
        model: str = "",
        rank: int = 0,
        compact_every: int = 32,
        background: bool = True,
        wait_seconds: float = 60.0,
    ) -> RunWriter:
        """Start a new run (rank 0; error if it exists). Ranks > 0 join the run rank 0 creates (waiting for it)."""
        logs_dir = Path(logs_dir)
        validate_run_name(name, logs_dir)
        check_rank(rank)
        run_dir = logs_dir / name
        if rank > 0:
            deadline = time.monotonic() + wait_seconds
            while not (run_dir / "run.json").exists():
                if time.monotonic() > deadline:
                    raise RunLogError(f"rank {rank}: run {name!r} was not created by rank 0 within "
                                      f"{wait_seconds:.0f} s")
                time.sleep(0.05)
            return cls.resume(logs_dir, name, rank=rank, compact_every=compact_every, background=background)
        logs_dir.mkdir(parents=True, exist_ok=True)
        exists = f"run {name!r} already exists in {logs_dir}; pick another name or resume it"
        if run_dir.exists():
            raise RunLogError(exists)
        info = RunInfo.new(name, algorithm=algorithm, task=task, model=model, config=config)
        # Build the folder under a dot name and rename it into place: a reader never sees a run without
        # run.json, and of two processes creating the same name only one rename succeeds.
        tmp = logs_dir / f".tmp-create-{name}-{uuid.uuid4().hex[:8]}"
        (tmp / "data" / f"run={name}").mkdir(parents=True)  # = data_dir_of(run_dir) once renamed
        info.write(tmp)
        lock = WriterLock(lock_path(tmp, 0), name, rank)
        try:
            os.rename(tmp, run_dir)
        except OSError:
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)
            raise RunLogError(exists) from None
        lock.path = lock_path(run_dir, 0)
        return cls(logs_dir, name, rank, info, lock, compact_every, background)

    @classmethod
    def resume(
        cls,
        logs_dir: str | os.PathLike,
        name: str,
        *,
        rank: int = 0,
        truncate_after: int | None = None,
        compact_every: int = 32,
        background: bool = True,
    ) -> RunWriter:
        """Continue a run after its last complete step (`last_step`), e.g. after a crash.

        `truncate_after=N` first deletes this rank's logged steps > N (restarting from a checkpoint taken at N),
        so the steps logged again replace them instead of duplicating rows.
        """
        logs_dir = Path(logs_dir)
        validate_run_name(name, logs_dir)
        check_rank(rank)
        run_dir = logs_dir / name
        info = RunInfo.read(run_dir)
        lock = WriterLock(lock_path(run_dir, rank), name, rank)
        try:
            data_dir = data_dir_of(run_dir)
            data_dir.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(data_dir, rank)
            writer = cls(logs_dir, name, rank, info, lock, compact_every, background)
            if truncate_after is not None:
                writer.discard_after(truncate_after)
        except BaseException:
            lock.release()
            raise
        if rank == 0:
            writer._update_meta(status="running", last_step=writer.last_step)
        return writer

    def discard_after(self, step: int) -> None:
        """Delete this rank's logged steps > `step` (-1: every step), to log them again from a checkpoint taken at
        `step`; a no-op when nothing was logged after it."""
        self.flush()
        if self.last_step is None or self.last_step <= step:
            return
        repair.truncate(self.data_dir, self.rank, step)
        self.last_step = self._last_logged()
        self._vocabulary = self._load_vocabulary()  # the pairs of the steps deleted may be logged differently
        if self.rank == 0:
            self._update_meta(last_step=self.last_step)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("stopped")
        else:
            self.close("crashed")

    # ---- logging

    def log_step(
        self,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        rollouts: Any = None,
        tokens: Any = None,
        token_passes: Any = None,
        prm_steps: Any = None,
        ref_tokens: Any = None,
        *,
        wall_time: float | None = None,
    ) -> None:
        """Write one step (all tables at once, visible to readers atomically). Steps must strictly increase.

        `metrics` fills one `steps` row (contract names as columns, any other key into the JSON `extra` column);
        `step_seconds` defaults to the time since the previous `log_step`. Rank 0 always writes a `steps` row.
        The tables are converted (and checked) here; encoding and writing happen on the writer thread while the
        caller goes on training (`background=False` writes before returning). Call `flush()` to wait.
        """
        if self._closed:
            raise RunLogError(f"run {self.name!r}: log_step after close")
        step = int(step)
        if step < 0:
            raise RunLogError(f"run {self.name!r}: step must be >= 0, got {step}")
        if self.last_step is not None and step <= self.last_step:
            raise RunLogError(
                f"run {self.name!r} rank {self.rank}: step {step} is not after the last logged step {self.last_step}; "
                f"to log steps again from a checkpoint, open the writer with RunWriter.resume(..., "
                f"truncate_after=<checkpoint step>) or call discard_after(<checkpoint step>) first"
            )
        now = time.time()
        if metrics is not None or self.rank == 0:
            metrics = dict(metrics or {})
            if metrics.get("step_seconds") is None and self._last_log_time is not None:
                metrics["step_seconds"] = now - self._last_log_time
        tables = self._step_tables(step, metrics, dict(rollouts=rollouts, tokens=tokens, token_passes=token_passes,
                                                       prm_steps=prm_steps, ref_tokens=ref_tokens),
                                   wall_time=wall_time, now=now)
        self.last_step = step
        self._last_log_time = now
        self._submit(self._write_step, step, tables)

    def _step_tables(self, step: int, metrics: Mapping[str, Any] | None, data: Mapping[str, Any], *,
                     wall_time: float | None, now: float) -> dict[str, pa.Table | None]:
        """One step's tables in the run-log schema (checked and sorted; `steps` only if there are metrics), as
        given: `stored_tables` derives what is written from them on the writer thread."""
        if unknown := sorted(set(data) - set(_ROW_TABLES)):
            raise TypeError(f"unknown table argument(s) {unknown}; the tables are metrics, {', '.join(_ROW_TABLES)}")
        tables = {table: table_rows(table, data.get(table), self.name, step) for table in _ROW_TABLES}
        if metrics is not None:
            metrics = dict(metrics)
            step_seconds = metrics.pop("step_seconds", None)
            wall = wall_time if wall_time is not None else metrics.pop("wall_time", now - self._created_unix)
            tables["steps"] = steps_row(metrics, self.name, step, wall, step_seconds)
        return tables

    def log_many(self, steps: Sequence[int], tables_of: Callable[[int], Mapping[str, Any]]) -> None:
        """Log many steps at once (bulk import: a run converted from another logger, a benchmark's big run).

        `tables_of(step)` returns the keyword arguments of `log_step` for that step. Each step goes straight into
        the folder where compaction would finally put it: the files are the same as `log_step` for each step
        followed by every merge (`repair.final_segments`; row groups do not depend on how rows arrived, see
        `FolderWriter`), but every row is encoded once instead of once per merge level. Not for a live run: steps
        appear chunk by chunk."""
        if self._closed:
            raise RunLogError(f"run {self.name!r}: log_many after close")
        steps = [int(s) for s in steps]
        previous = self.last_step
        for s in steps:
            if s < 0 or (previous is not None and s <= previous):
                raise RunLogError(f"run {self.name!r}: log_many steps must be >= 0 and strictly increasing after "
                                  f"the last logged step {self.last_step}, got {s} after {previous}")
            previous = s
        self.flush()
        mine = self._segments()
        plan = repair.final_segments([(s.first, s.last, s.seq) for s in mine], steps, self.compact_every,
                                     next_seq(self.data_dir))
        by_step = iter(steps)

        def fill(folder: FolderWriter, first: int, last: int, absorbed: list) -> None:
            repair.copy_rows(absorbed, folder)  # segments logged before that this chunk replaces
            for step in by_step:
                kwargs = dict(tables_of(step))
                if self.rank == 0:
                    kwargs.setdefault("metrics", {})
                folder.add_tables(stored_tables(self._step_tables(step, kwargs.pop("metrics", None), kwargs,
                                                                  wall_time=kwargs.pop("wall_time", None),
                                                                  now=time.time()), self._vocabulary))
                if step == last:
                    break

        for first, last, seq in plan:
            absorbed = sorted((s for s in mine if s.first <= last and first <= s.last), key=lambda s: s.first)
            if seq < 0:
                label, final = f"step-{first:09d}", step_dir(self.data_dir, first, self.rank, self._session)
            else:
                label, final = f"chunk-{first:09d}", chunk_dir(self.data_dir, first, last, seq, self.rank)
            write_folder(self.data_dir, self.rank, label, final,
                         lambda folder, a=first, b=last, c=absorbed: fill(folder, a, b, c))
            if absorbed:
                self._superseded.append((time.monotonic(), [Path(s.path) for s in absorbed]))
            self.last_step = last
            if self.rank == 0:
                self._update_meta(last_step=last)

    def log_stream(self, steps: Iterable[tuple[int, Mapping[str, Any]]]) -> list[int]:
        """Log steps as an iterable yields them, (step, keyword arguments of `log_step`), e.g. an import reading
        one step of a dump at a time; returns the steps written.

        Every `compact_every` steps (and the steps left when `steps` ends) go straight into the chunk folder that
        `log_step` for each of them followed by the merges and the closing merge would produce (same rows, same
        encoding: `FolderWriter`), so every row is encoded once and closing has nothing to merge. Each chunk
        appears when it is complete: a kill loses the chunk being written (at most `compact_every` steps), never
        one already written; an exception from `steps` first writes the chunk of the steps it yielded. A step's
        token rows are made as stored (`stored_token_rows`) on the calling thread, and its summary and pass rows
        derived and everything encoded on the writer thread while the iterable reads the next step (two steps in
        memory): importing long responses, the writer thread had more to do than the reading one."""
        if self._closed:
            raise RunLogError(f"run {self.name!r}: log_stream after close")
        if self.compact_every <= 0:  # no compaction: one step folder per step, as log_step writes
            written = []
            for step, kwargs in steps:
                self.log_step(step, **kwargs)
                written.append(step)
            return written
        self.flush()
        written: list[int] = []
        group: list[int] = []
        folder: FolderWriter | None = None
        try:
            for step, kwargs in steps:
                step = int(step)
                if step < 0 or (self.last_step is not None and step <= self.last_step):
                    raise RunLogError(f"run {self.name!r}: log_stream steps must be >= 0 and strictly increasing "
                                      f"after the last logged step {self.last_step}, got {step}")
                kwargs = dict(kwargs)
                metrics = kwargs.pop("metrics", {} if self.rank == 0 else None)
                tables = self._step_tables(step, metrics, kwargs, wall_time=kwargs.pop("wall_time", None),
                                           now=time.time())
                tables = stored_token_rows(tables, self._vocabulary)  # here; the rest on the writer thread
                if folder is None:
                    folder = FolderWriter(self.data_dir, self.rank, f"chunk-{step:09d}")
                self._submit(_add_to_chunk, folder, tables)
                del tables, kwargs  # the writer thread frees them once encoded, while the next step is read
                group.append(step)
                self.last_step = step
                if len(group) == self.compact_every:
                    self._submit(self._commit_chunk, folder, group)
                    written += group
                    folder, group = None, []
        except BaseException:
            if folder is not None:
                try:  # the steps read before the error are whole: keep them
                    self._submit(self._commit_chunk, folder, group)
                    self.flush()
                    written += group
                except Exception:
                    folder.abort()
                    self.last_step = self._last_logged()
            raise
        if folder is not None:
            self._submit(self._commit_chunk, folder, group)
            written += group
        self.flush()
        return written

    def _commit_chunk(self, folder: FolderWriter, steps: list[int]) -> None:
        """Rename a chunk written by `log_stream` into place (on the writer thread, after its steps' rows)."""
        try:
            folder.commit(chunk_dir(self.data_dir, steps[0], steps[-1], next_seq(self.data_dir), self.rank))
        except BaseException:
            folder.abort()
            raise
        if self.rank == 0:
            self._update_meta(last_step=steps[-1])
        self._maybe_compact()
        self._delete_superseded()

    def flush(self) -> None:
        """Wait until every step passed to `log_step` is on disk (raises if writing one failed)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as err:
                raise RunLogError(f"run {self.name!r}: writing a step failed: {err}") from err

    def set_status(self, status: str) -> None:
        """Record the run's status (only rank 0 writes run.json; other ranks ignore this)."""
        if status not in STATUSES:
            raise RunLogError(f"status must be one of {STATUSES}, got {status!r}")
        self.flush()
        if self.rank == 0:
            self._update_meta(status=status)

    def close(self, status: str = "finished") -> None:
        """Write what is pending, merge the remaining step folders (unless `status` is crashed), record `status`
        and release the writer lock. Safe to call twice.

        The folders a recent merge replaced are deleted by a thread once `repair.DELETE_GRACE_SECONDS` have
        passed, so closing does not wait for it; the process exits after that thread."""
        if self._closed:
            return
        try:
            self.flush()
            if status != "crashed" and self.compact_every > 0:
                self._compact_tail()
            self.set_status(status)
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._lock.release()
            if self._superseded:  # not a daemon: exiting waits for it (a kill leaves them to the next resume)
                self._deleter = threading.Thread(target=self._delete_superseded, kwargs={"wait": True},
                                                 name=f"runlog-delete-{self.name}")
                self._deleter.start()

    # ---- internals

    def _segments(self) -> list:
        return [s for s in scan_segments(self.data_dir) if s.rank == self.rank]

    def _last_logged(self) -> int | None:
        return max((s.last for s in self._segments()), default=None)

    def _load_vocabulary(self) -> TokenVocabulary | None:
        """Rank 0's token ids by text as its logged steps hold them (see `TokenVocabulary`); None on other ranks."""
        if self.rank != 0:
            return None
        files = [Path(s.path) / f"{VOCABULARY_TABLE}.parquet" for s in sorted(self._segments(), key=lambda s: s.first)]
        pairs = []
        for file in files:
            with contextlib.suppress(FileNotFoundError, pa.ArrowException):  # a damaged file costs only its folder
                pairs.append(pq.read_table(file, columns=["token_id", "token_text"]))
        return TokenVocabulary(pa.concat_tables(pairs) if pairs else None)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` on the writer thread, at most one step behind: the caller waits for the previous step."""
        self.flush()
        if self._executor is None:
            fn(*args)
        else:
            self._pending = self._executor.submit(fn, *args)

    def _write_step(self, step: int, tables: dict[str, pa.Table | None]) -> None:
        write_folder(self.data_dir, self.rank, f"step-{step:09d}",
                     step_dir(self.data_dir, step, self.rank, self._session),
                     lambda f: f.add_tables(stored_tables(tables, self._vocabulary)))
        if self.rank == 0:
            self._update_meta(last_step=step)
        if self.compact_every > 0:
            self._maybe_compact()
        self._delete_superseded()

    def _update_meta(self, **changes: Any) -> None:
        with self._meta_lock:
            self.info.touch(**changes)
            self.info.write(self.run_dir)

    def _delete_superseded(self, wait: bool = False) -> None:
        """Delete folders replaced by a chunk at least `DELETE_GRACE_SECONDS` ago (all of them if `wait`)."""
        while self._superseded:
            age = time.monotonic() - self._superseded[0][0]
            if age < repair.DELETE_GRACE_SECONDS:
                if not wait:
                    return
                time.sleep(repair.DELETE_GRACE_SECONDS - age)
            for path in self._superseded.pop(0)[1]:
                remove_tree(path)

    def _merge(self, group: list) -> None:
        repair.merge(self.data_dir, group, self.rank, next_seq(self.data_dir))
        self._superseded.append((time.monotonic(), [Path(s.path) for s in group]))

    def _compact_tail(self) -> None:
        """Merge this rank's remaining step folders into one chunk when the run closes: a finished run is then
        read from a few files instead of up to `compact_every` more (listing 200 finished runs of 40 steps
        opens 400 steps files instead of 1,800). Resuming later merges the way it always does."""
        steps = [s for s in self._segments() if not s.is_chunk]
        if len(steps) > 1:
            self._merge(steps)

    def _maybe_compact(self) -> None:
        """Merge this rank's step folders into a chunk once there are `compact_every` of them, and every
        `MERGE_FAN_IN` chunks of one size into one larger chunk, so the number of files (what a query pays
        for) grows with the logarithm of the number of steps (the rule: `repair.next_merge`)."""
        while True:
            segments = self._segments()
            picked = repair.next_merge([(s.first, s.last, s.seq) for s in segments], self.compact_every)
            if picked is None:
                return
            self._merge([s for s in segments if (s.first, s.last, s.seq) in picked])


def _add_to_chunk(folder: FolderWriter, tables: dict[str, pa.Table | None]) -> None:
    """Add a step's tables (token rows as stored) to a chunk being written; a failure deletes the chunk (it could
    not be whole)."""
    try:
        folder.add_tables(with_pass_and_summary_rows(tables))
    except BaseException:
        folder.abort()
        raise


def stored_tables(tables: dict[str, pa.Table | None],
                  vocabulary: TokenVocabulary | None = None) -> dict[str, pa.Table | None]:
    """A step's tables as written (on the writer thread for `log_step`: the caller goes on meanwhile): token rows
    without what they repeat, pass rows without what they repeat of their token, the step's `token_summary`."""
    return with_pass_and_summary_rows(stored_token_rows(tables, vocabulary))


def stored_token_rows(tables: dict[str, pa.Table | None],
                      vocabulary: TokenVocabulary | None) -> dict[str, pa.Table | None]:
    """A step's tables with its token rows as written: without what they repeat of themselves, nor their ids of
    `vocabulary` (rank 0's), with the step's `token_vocab` rows. Steps in order: the vocabulary remembers them."""
    tables = dict(tables)
    tables["tokens"] = stored_tokens(tables["tokens"])
    if vocabulary is not None and tables["tokens"] is not None:
        tables["tokens"], tables[VOCABULARY_TABLE] = vocabulary.elide(tables["tokens"])
    return tables


def with_pass_and_summary_rows(tables: dict[str, pa.Table | None]) -> dict[str, pa.Table | None]:
    """A step's tables with its pass rows as written and its `token_summary` rows. Both read only token columns
    that `stored_token_rows` leaves whole (keys, text, old/ref log-probs, advantage, entropy)."""
    tables = dict(tables)
    tables["token_passes"] = stored_passes(tables["tokens"], tables["token_passes"])
    tables["token_summary"] = step_summary(tables["rollouts"], tables["tokens"], tables["token_passes"])
    return tables


def _remove_leftovers(data_dir: Path, rank: int) -> None:
    """What a killed writer of `rank` left: its ``.tmp-`` / ``.trash-`` folders, and folders a chunk had replaced
    but that were not deleted yet."""
    live = {s.path for s in scan_segments(data_dir)}
    for entry in os.scandir(data_dir):
        if entry.name.startswith((".tmp-", ".trash-")) and f".rank{rank}-" in entry.name:
            shutil.rmtree(entry.path, ignore_errors=True)
        elif rank_of_segment_name(entry.name) == rank and entry.path not in live:
            remove_tree(Path(entry.path))
