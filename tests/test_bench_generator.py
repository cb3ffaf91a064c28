"""The benchmark's synthetic steps are what the run log accepts and what the pages read: a step of each shape is
written through RunWriter and read back, every pass row belongs to a trained token, and the step's mismatch
metrics are those of its own rows (a benchmark that breaks is caught here, not when someone measures)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_dashboard", ROOT / "benchmarks" / "bench_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_dashboard"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("long, zipf", [(False, False), (True, False), (True, True)])
def test_a_synthetic_step_is_written_and_read_back(tmp_path, bench, long, zipf):
    from dataclasses import replace

    from engine.correction_settings import REJECT_NONE
    from engine.runlog import RunReader, RunWriter

    shape = bench.LONG_SHAPE if long else bench.short_shape(2, 4, 30)
    if zipf:
        shape = replace(shape, zipf_vocabulary=bench.REAL_VOCABULARY)
    tables = bench.synthetic_step(1, shape, 2, np.random.default_rng(0))
    tokens, passes, metrics = tables["tokens"], tables["token_passes"], tables["metrics"]
    trained = tokens["rollout_id"] < sum(shape.group_sizes)
    assert len(passes["rollout_id"]) == 2 * int(trained.sum())  # every trained token, once per pass
    log_ratio = tokens["old_logp"][trained] - tokens["sampler_logp"][trained]
    assert metrics["mismatch_mean_abs_log_ratio"] == pytest.approx(np.abs(log_ratio).mean())
    rejected = passes["rejected"][: int(trained.sum())]
    assert metrics["mismatch_rejected_token_share"] == pytest.approx((rejected != REJECT_NONE).mean())

    with RunWriter.create(tmp_path, "bench", algorithm="grpo", task="linear") as log:
        log.log_step(1, **tables)
    counts = RunReader(tmp_path, "bench").sql(
        "SELECT (SELECT count(*) FROM tokens) AS tokens, (SELECT count(*) FROM token_passes) AS passes")
    assert (int(counts.tokens[0]), int(counts.passes[0])) == (len(tokens["rollout_id"]), len(passes["rollout_id"]))
    if zipf:  # a real vocabulary's spread: tens of thousands of texts, each its id's, the commonest far ahead
        texts, counts = np.unique(tokens["token_text"].astype(str), return_counts=True)
        assert len(texts) > 20_000 and counts.max() > 20 * np.median(counts)
        assert all(text == f" w{i}" for text, i in zip(tokens["token_text"][:100], tokens["token_id"][:100],
                                                         strict=True))


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl", "slime"])
def test_the_import_benchmark_s_dumps_import_whole(tmp_path, fmt):
    """bench_import.py's generated dumps are read by the importers: every completion token of every sample, with
    Zipf-drawn ids inside the vocabulary and a head far above a uniform draw's."""
    spec = importlib.util.spec_from_file_location("bench_import", ROOT / "benchmarks" / "bench_import.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from engine.importers import import_run
    from engine.runlog import RunReader

    module.WRITERS[fmt](tmp_path / "dump", 32, 40, 2, "zipf")  # 32 samples of 40 tokens (10 of them prompt)
    report = import_run(fmt, tmp_path / "dump", tmp_path / "logs", "bench")
    assert report.imported == [1, 2] and report.problems == []
    with RunReader(tmp_path / "logs") as reader:
        counts = reader.sql("SELECT step, count(*) AS n, count(DISTINCT rollout_id) AS r FROM tokens "
                            "GROUP BY step ORDER BY step").values.tolist()
        lowest_entropy = reader.sql("SELECT min(entropy) FROM tokens").iloc[0, 0]
    assert counts == [[1, 16 * 30, 16], [2, 16 * 30, 16]]
    assert lowest_entropy > 0 if fmt != "nemo-rl" else pd.isna(lowest_entropy)  # NeMo-RL's dump holds none
    ids = module.token_draw(module.random.Random(0), "zipf")(20_000)
    assert min(ids) >= 0 and max(ids) < module.REAL_VOCABULARY
    # by Zipf's law the commonest id is drawn about 20,000 / H(151,936) = 1,600 times; uniformly, a handful
    assert max(np.bincount(ids)) > 1000
