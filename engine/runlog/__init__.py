"""The run log: every token of every step as Parquet files, queryable with DuckDB while the run trains.

The package, one job per module:

- `schema`: the tables, their columns and types, and the row builders (`table_rows`, `steps_row`) every producer
  of rows goes through (the trainer via `engine.logrows`, the TRL adapter, the importers);
- `layout`: run names and their validation, paths and folder names, writer locks, and run.json as `RunInfo`
  (read and written only there), `list_runs`;
- `files`: the Parquet files of a folder (encodings, row groups, `FolderWriter`);
- `writer`: `RunWriter`;
- `repair`: compaction, truncation, and telling damaged or foreign files apart;
- `reader`: `RunReader`, with the read-only SQL sandbox.

DuckDB lets one process write a database file or many processes read it, never both, so a live dashboard cannot
open the trainer's database. Instead each run is a folder of immutable Parquet files; readers hold their own
in-memory DuckDB connection with views over those files.

On-disk layout (``SCHEMA_VERSION`` 1)::

    <logs_dir>/<run>/run.json                      name, run_id, algorithm, task, model, config, status, times,
                                                   last_step, schema_version (replaced atomically, rank 0 only;
                                                   `layout.RunInfo`; the algorithm is stored once, not again in
                                                   config)
    <logs_dir>/<run>/writer-rank<R>.lock           held (flock) by the live writer of rank R: pid and host inside
    <logs_dir>/<run>/data/run=<run>/               the step data (``run=`` lets DuckDB skip other runs by path):
        step-<S>.rank<R>.s<W>/                     one finished step of one rank: <table>.parquet for each table
                                                   that has rows (steps, rollouts, tokens, token_passes, prm_steps,
                                                   ref_tokens; their columns: `schema.TABLE_SCHEMAS`), and what the
                                                   writer derives (token_summary; token_vocab, the token ids the
                                                   tokens rows leave out: `derived.TokenVocabulary`);
                                                   W identifies the writer session (hex microseconds)
        chunk-<A>-<B>-<Q>.rank<R>/                 steps A..B of rank R merged into larger sorted files
                                                   (compaction; Q is a sequence number, the newest chunk wins)
        .tmp-* / .trash-*                          in progress / being deleted; readers never look at dot names

How the behaviour the issue asks for is obtained:

1. A step is visible all at once: its files are written into ``.tmp-...`` and the folder is renamed to
   ``step-<S>.rank<R>.s<W>`` in one ``os.rename``. Readers list folders themselves (not a DuckDB glob) and give
   DuckDB explicit file lists, so they only ever see whole steps. Killing the writer (SIGKILL included) leaves at
   most a ``.tmp-`` folder behind. Encoding happens on one writer thread at most one step behind the caller (the
   next ``log_step`` waits for it), so a kill loses at most the step being written; ``flush()``/``close()`` wait.
2. Many steps stay fast to query: after ``compact_every`` step folders the writer merges them into one chunk
   (files sorted by step, rollout, position, so row-group statistics prune a one-rollout query), and every
   ``repair.MERGE_FAN_IN`` chunks of one size into a bigger one: the file count grows with the log of the step count.
   Row groups have a fixed size whatever the merge path (`files.FolderWriter`), so `RunWriter.log_many` can write a
   bulk import straight into its final chunks; closing a run merges its remaining step folders into one chunk;
   a reader lists a data folder again only when its mtime changed.
   A reader that lists a chunk and the folders it replaced uses the chunk. The replaced folders are deleted
   ``repair.DELETE_GRACE_SECONDS`` later (readdir is no snapshot; see there); a reader whose view still names a
   deleted file refreshes and retries the query (`RunReader.sql`).
3. Several processes (torchrun ranks) write disjoint folders (``.rank<R>``); only rank 0 writes ``run.json``.
4. Crash detection: the writer holds an exclusive ``flock`` on ``writer-rank<R>.lock`` for its lifetime; the kernel
   releases it when the process dies. A run whose ``run.json`` says ``running`` while nobody holds the rank-0 lock
   is shown as ``crashed``. (On another host the lock cannot be probed: a heartbeat older than
   ``STALE_AFTER_SECONDS`` counts as crashed.)
5. Resume: ``RunWriter.resume`` continues after the last complete step of its rank on disk. Steps must strictly
   increase, so a re-logged step never duplicates rows: logging a step <= ``last_step`` is an error. To restart from
   a checkpoint older than the log, pass ``truncate_after=checkpoint_step`` (or call ``discard_after`` once the
   writer's ``last_step`` is known): the log of steps after it is deleted first (a chunk that straddles it is
   rewritten and the rewrite wins by its newer sequence number).
6. Damaged or foreign files cost only themselves: every Parquet file is checked once (footer and schema) before it
   enters a view; bad files, foreign files, files where a step folder belongs, unreadable ``run.json``, folders
   that are not valid run names and runs of a newer schema version are skipped and listed in
   ``RunReader.problems``. Damage inside a file's data pages shows only when a query decodes them: the reader then
   finds the file (from DuckDB's message, or by decoding each file not yet known to be whole once), leaves it out
   and runs the query again (`RunReader._handle_file_error`). Asking for such a run by name raises `RunLogError`.
7. Read-only SQL: a reader runs reading statements only, and its DuckDB may open no file outside the runs it reads
   (external access off but for those folders, no extension installed or loaded, configuration locked);
   ``RunReader(..., unsafe=True)`` is a full DuckDB shell instead.

Logging from any training loop (the engine does the same in ``engine/train.py``)::

    from engine.runlog import RunWriter, RunReader

    with RunWriter.create("logs", "my-run", algorithm="grpo", task="arith", config={"lr": 1e-6},
                          model="tiny-gpt 2x64") as log:
        for step in range(100):
            ...  # sample a group of completions, score them, update the policy
            log.log_step(
                step,
                metrics={"reward_mean": 0.42, "loss": 0.13, "lr": 1e-6},
                rollouts={"rollout_id": [0, 1], "group_id": [0, 0], "index_in_group": [0, 1],
                          "kind": ["train", "train"], "prompt": ["2+3=", "2+3="],
                          "completion": ["5", "6"], "reward": [1.0, 0.0], "advantage": [0.7, -0.7]},
                tokens={"rollout_id": [0, 1], "position": [0, 0], "token_text": ["5", "6"],
                        "old_logp": [-0.1, -2.3], "advantage": [0.7, -0.7]},
            )  # DataFrames, pyarrow Tables or dicts of columns; missing columns are stored as NULL
    # leaving the block marks the run finished (stopped on Ctrl-C, crashed on an exception)

    reader = RunReader("logs")
    print(reader.sql("SELECT step, reward_mean FROM steps WHERE run = ? ORDER BY step", ["my-run"]))

Timestamps (``created_at``, ``updated_at``) are UTC. ``wall_time`` is seconds since the run was created.
Durability is against process death, not power loss (no fsync), which keeps logging cheap.
With several ranks, make ``rollout_id`` unique across ranks and let rank 0 log the metrics.
"""


from engine.runlog.files import FolderWriter, row_group_rows
from engine.runlog.layout import (
    RUN_NAME_PATTERN,
    RUN_NAME_RULE,
    SCHEMA_VERSION,
    STALE_AFTER_SECONDS,
    STATUSES,
    RunInfo,
    RunLogError,
    data_dir_of,
    last_steps_by_rank,
    list_runs,
    scan_segments,
    validate_run_name,
)
from engine.runlog.reader import RunReader
from engine.runlog.schema import (
    ADDED_COLUMNS,
    ALL_TABLES,
    DATA_TABLES,
    FILE_SCHEMAS,
    RUNS_SCHEMA,
    TABLE_SCHEMAS,
    steps_row,
    table_rows,
)
from engine.runlog.writer import RunWriter

# The names of the single module this package was, for code written against it.
_FolderWriter = FolderWriter
_row_group_rows = row_group_rows
_scan_segments = scan_segments

__all__ = [
    "ADDED_COLUMNS",
    "ALL_TABLES",
    "DATA_TABLES",
    "FILE_SCHEMAS",
    "RUNS_SCHEMA",
    "RUN_NAME_PATTERN",
    "RUN_NAME_RULE",
    "SCHEMA_VERSION",
    "STALE_AFTER_SECONDS",
    "STATUSES",
    "TABLE_SCHEMAS",
    "RunInfo",
    "RunLogError",
    "RunReader",
    "RunWriter",
    "data_dir_of",
    "last_steps_by_rank",
    "list_runs",
    "steps_row",
    "table_rows",
    "validate_run_name",
]
