"""The run log across processes: a reader polling while a writer process appends steps, and a writer killed
with SIGKILL in the middle of a step (engine/runlog/)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.runlog import RunReader, RunWriter, data_dir_of, list_runs

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

# Step s has (s % 5 + 1) rollouts of LENGTH tokens and 2 passes, so every table's row count per step is known
# and a partially visible step would show up as a wrong count.
LENGTH = 50
REPO = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import engine.runlog as runlog

    logs, name, steps, pause, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    LENGTH = int(sys.argv[7])

    if kill_at >= 0:  # stop inside step `kill_at`, after its first row group is written, and tell the test
        original = runlog._FolderWriter._write
        def slow_write(self, table, rows):
            original(self, table, rows)
            if self.tmp.name.startswith(f".tmp-step-{kill_at:09d}"):
                print("MID-STEP", flush=True)
                time.sleep(60)
        runlog._FolderWriter._write = slow_write

    start = int(sys.argv[6])
    if start:
        writer = runlog.RunWriter.resume(logs, name, compact_every=4)
    else:
        writer = runlog.RunWriter.create(logs, name, algorithm="grpo", task="t", compact_every=4)
    for step in range(start, steps):
        n = step % 5 + 1
        rid = np.repeat(np.arange(n), LENGTH)
        pos = np.tile(np.arange(LENGTH), n)
        writer.log_step(
            step,
            metrics={"reward_mean": float(n)},
            rollouts={"rollout_id": np.arange(n), "completion": ["x" * LENGTH] * n},
            tokens={"rollout_id": rid, "position": pos, "old_logp": -np.ones(n * LENGTH)},
            token_passes={"pass": np.repeat([0, 1], n * LENGTH), "rollout_id": np.tile(rid, 2),
                          "position": np.tile(pos, 2)},
        )
        print("logged", step, flush=True)
        time.sleep(pause)
    writer.close()
    """
)


def start_writer(tmp_path, name, steps, pause=0.0, kill_at=-1, start=0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [str(tmp_path), name, str(steps), str(pause), str(kill_at), str(start), str(LENGTH)]
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, *args],
        stdout=subprocess.PIPE, text=True, env=env,
    )


def check_whole_steps(reader: RunReader, run: str) -> set[int]:
    """Every visible step must be complete in every table; returns the visible steps."""
    counts = reader.sql(
        """
        SELECT step, max(s) AS s, max(r) AS r, max(t) AS t, max(p) AS p FROM (
            SELECT step, count(*) AS s, 0 AS r, 0 AS t, 0 AS p FROM steps WHERE run = $run GROUP BY step
            UNION ALL SELECT step, 0, count(*), 0, 0 FROM rollouts WHERE run = $run GROUP BY step
            UNION ALL SELECT step, 0, 0, count(*), 0 FROM tokens WHERE run = $run GROUP BY step
            UNION ALL SELECT step, 0, 0, 0, count(*) FROM token_passes WHERE run = $run GROUP BY step
        ) GROUP BY step ORDER BY step
        """,
        {"run": run},
    )
    for row in counts.itertuples():
        n = row.step % 5 + 1
        assert (row.s, row.r, row.t, row.p) == (1, n, n * LENGTH, 2 * n * LENGTH), f"partial step: {row}"
    return set(counts.step.tolist())


def test_reader_polling_while_writer_appends_never_errors_nor_sees_partial_steps(tmp_path):
    steps = 16
    proc = start_writer(tmp_path, "live", steps, pause=0.1)
    reader = None
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if reader is None and (tmp_path / "live").exists():
                reader = RunReader(tmp_path)
            if reader is not None:
                visible = check_whole_steps(reader, "live")
                assert visible == set(range(len(visible))), "steps appear in order, none missing"
                seen.append(len(visible))
            if proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert reader is not None
    assert check_whole_steps(reader, "live") == set(range(steps))  # after the final compaction too
    assert seen == sorted(seen) and len(set(seen)) > 3, seen  # we really watched it grow
    assert reader.sql("SELECT status FROM runs").status[0] == "finished"
    assert not reader.problems


def test_sigkill_mid_step_loses_only_that_step_then_resume(tmp_path):
    proc = start_writer(tmp_path, "killed", steps=10, kill_at=6)
    try:
        for line in proc.stdout:
            if line.startswith("MID-STEP"):
                break
        else:
            pytest.fail("writer never reached step 6")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()

    data = data_dir_of(tmp_path / "killed")
    assert any(p.name.startswith(".tmp-step-000000006") for p in data.iterdir())  # the interrupted step
    reader = RunReader(tmp_path)
    assert check_whole_steps(reader, "killed") == set(range(6))
    assert reader.sql("SELECT status, last_step FROM runs").values.tolist() == [["crashed", 5]]
    assert [r["status"] for r in list_runs(tmp_path)] == ["crashed"]

    writer = RunWriter.resume(tmp_path, "killed")
    assert writer.last_step == 5
    assert not any(p.name.startswith(".tmp-") for p in data.iterdir())  # leftovers cleaned
    assert reader.sql("SELECT status FROM runs").status[0] == "running"
    writer.close("crashed")  # hand over to a resumed writer process that finishes the run
    proc = start_writer(tmp_path, "killed", steps=9, start=6)
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()
    assert check_whole_steps(reader, "killed") == set(range(9))
    assert reader.sql("SELECT status, last_step FROM runs").values.tolist() == [["finished", 8]]
