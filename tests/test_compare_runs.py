"""benchmarks/compare_runs.py: the commands it trains with and the tables it draws from logged runs.

Two logged runs of different lengths: the table compares them at the last evaluated step both reached, with the
accuracies and per-step means read back from what was logged (the mismatch metrics from `steps.extra`), and the
corrections' dropped share from `token_passes.rejected`. No training, no browser.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compare_runs():
    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "benchmarks" / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(logs_dir: Path, name: str, steps: int, seed: int) -> dict[int, dict]:
    """A synthetic run evaluated every 2 steps, with a growing mismatch in `extra`; returns the metrics logged."""
    from synthetic_runs import synthetic_step

    from engine.runlog import RunWriter

    rng = np.random.default_rng(seed)
    logged = {}
    with RunWriter.create(logs_dir, name, algorithm="grpo", task="linear", config={}, model="synthetic",
                          background=False, compact_every=1000) as writer:
        for step in range(steps + 1):
            data = synthetic_step(step, 2, 2, 6, 1, rng)
            metrics = data["metrics"]
            if step % 2 == 0:
                metrics["heldout_accuracy_sampled"] = float(rng.random())
            metrics["mismatch_out_of_band"] = (seed + 1) * step / 1000  # outside the contract: steps.extra
            passes = data["token_passes"]
            passes["is_weight"] = 1.0
            passes["rejected"] = np.where(np.arange(len(passes)) % 4 == 0, 2, 0).astype("int8")
            writer.log_step(step, **data)
            logged[step] = {**metrics, "rejected": int((passes["rejected"] != 0).sum()), "passes": len(passes)}
    return logged


def test_runs_are_compared_at_the_last_evaluated_step_all_reached(tmp_path, compare_runs, monkeypatch):
    long, short = _write_run(tmp_path, "run-long", 9, seed=0), _write_run(tmp_path, "run-short", 6, seed=1)
    _write_run(tmp_path, "run-new", 0, seed=2)  # only its warm start evaluated so far
    monkeypatch.setattr(compare_runs, "SPAN", 2)  # early = the first 2 steps, late = the last 2
    monkeypatch.setitem(compare_runs.GROUPS, "mismatch", [("run-long", "long", []), ("run-new", "new", []),
                                                          ("run-short", "short", []), ("never-run", "unborn", [])])

    lines = compare_runs.report(tmp_path, ["mismatch"], None)

    assert lines[0] == "### mismatch: 2 of 4 runs compared at step 6"  # run-short's last evaluation; run-long went on
    assert lines[2] == "Not evaluated after the warm start yet: new, unborn."
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ") for line in lines if line.startswith("| ")}
    for label, logged, seed in (("long", long, 0), ("short", short, 1)):
        cells = rows[label]
        best = max(logged[s]["heldout_accuracy"] for s in range(0, 7, 2))
        assert cells[1] == (f"{logged[0]['heldout_accuracy']:.1%} -> {logged[6]['heldout_accuracy']:.1%} "
                            f"({best:.1%})")
        sampled = (logged[0]["heldout_accuracy_sampled"], logged[6]["heldout_accuracy_sampled"])
        assert cells[2] == f"{sampled[0]:.1%} -> {sampled[1]:.1%}"
        # from step 3 on (a sampler lagging 2 updates): steps 3-4, then the last two up to the common step, 5-6
        early, late = ((seed + 1) * np.mean([a, a + 1]) / 1000 for a in (3, 5))
        assert cells[3] == f"{early:.4g} -> {late:.4g}"
        rejected = sum(logged[s]["rejected"] for s in range(7)) / sum(logged[s]["passes"] for s in range(7))
        assert cells[6] == f"{rejected:.2%}"  # token-passes with a rejection code, up to the common step
    assert set(rows) == {"run", "long", "short"}


def test_a_chunk_starts_a_new_run_with_its_flags_or_resumes_it_without(tmp_path, compare_runs):
    flags = ["--algo", "grpo", "--sampler-lag", "2"]
    new = compare_runs.chunk_command(tmp_path, "mm-none", flags, -1, 10, 1)
    assert new[new.index("--steps") + 1] == "10" and new[new.index("--run-name") + 1] == "mm-none"
    assert new[-len(flags):] == flags and new[new.index("--seed") + 1] == "0" and "--resume" not in new
    resumed = compare_runs.chunk_command(tmp_path, "mm-none", flags, 10, 20, 1)
    assert resumed[resumed.index("--resume") + 1] == "mm-none" and resumed[resumed.index("--steps") + 1] == "20"
    assert "--algo" not in resumed and "--run-name" not in resumed  # a resumed run keeps its saved config

