"""The run log's compact storage (engine/runlog/derived.py, schema.py): float32 per-token values, sampler log-probs
left out where they repeat another column of the token row, token-pass values left out where the token row gives
them back, each pass row's entropy decile, and runs of the previous layout (float64, every value stored) still read
and compacted."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.objectives import policy_loss
from engine.runlog import RunReader, RunWriter, data_dir_of
from engine.runlog.derived import entropy_deciles, stored_tokens
from engine.runlog.layout import scan_segments
from engine.runlog.schema import FILE_SCHEMAS, TABLE_SCHEMAS, table_rows


def _deciles(rollout_ids, entropies) -> list[int]:
    return entropy_deciles(pa.table({"rollout_id": rollout_ids, "entropy": entropies})).tolist()


def test_entropy_deciles_by_hand():
    # One response of 5 tokens: sorted 0.1 0.3 0.5 0.7 0.9, cut points at 0.18 0.26 0.34 0.42 0.50 0.58 0.66 0.74
    # 0.82 (linear interpolation, h = 0.4 k): 0.3 is above 2 of them, 0.5 above 4 (not 0.50 itself), 0.7 above 7.
    assert _deciles([0] * 5, [0.1, 0.5, 0.3, 0.9, 0.7]) == [0, 4, 2, 9, 7]
    # Ties share the lower rank; a second response is ranked on its own; one token alone is decile 0.
    assert _deciles([3, 3, 3, 4, 5], [1.0, 1.0, 2.0, 0.2, None]) == [0, 0, 9, 0, -1]


def test_entropy_deciles_match_torch_quantiles():
    """The decile is the number of torch.quantile cut points at 0.1..0.9 strictly below the token's entropy."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 60)
    rollout = np.repeat(np.arange(60), lengths)
    entropy = np.round(rng.gamma(2.0, 0.4, len(rollout)), 2)  # rounded: ties
    got = np.array(_deciles(rollout, entropy))
    for r in range(60):
        e = torch.tensor(entropy[rollout == r], dtype=torch.float64)
        cuts = torch.quantile(e, torch.arange(1, 10, dtype=torch.float64) / 10)
        np.testing.assert_array_equal(got[rollout == r], (e[:, None] > cuts[None, :]).sum(1).numpy())


def _step(algo: str, seed: int = 0, kl_of=None) -> dict:
    """One step's tokens and two passes of `algo` (engine.objectives) on 4 responses of 2..12 tokens."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 12
    lengths = torch.tensor([12, 7, 2, 9])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # (B, T)
    old = -torch.rand(B, T, generator=g) * 6  # (B, T)
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)
    keep = mask.bool()
    rid, pos = keep.nonzero(as_tuple=True)
    # the sampler: the policy itself for responses 0 and 1 (its log-probs are old_logp's), another engine for 2 and
    # 3, which truncated response 3 with top-p (its full log-prob is lower)
    sampler = torch.where(torch.arange(B)[:, None] < 2, old, old + 0.01 * torch.randn(B, T, generator=g))
    sampler_full = torch.where(torch.arange(B)[:, None] == 3, sampler - 0.1, sampler)
    tokens = {"rollout_id": rid.numpy(), "position": pos.numpy(), "old_logp": old[keep].numpy(),
              "ref_logp": ref[keep].numpy(), "entropy": torch.rand(B, T, generator=g)[keep].numpy(),
              "advantage": adv[keep].numpy(), "sampler_logp": sampler[keep].numpy(),
              "sampler_logp_full": sampler_full[keep].numpy()}
    passes = []
    for p in range(2):
        new = old + (0.05 * p) * torch.randn(B, T, generator=g)  # pass 0 on-policy: ratio exactly 1
        out = policy_loss(algo, new, old, adv, mask, ref_logp=ref)
        kl = out.kl if kl_of is None else kl_of(new, ref)
        passes.append({"pass": np.full(len(rid), p), "rollout_id": rid.numpy(), "position": pos.numpy(),
                       "new_logp": new[keep].numpy(), "ratio": out.ratio[keep].numpy(),
                       "clip": out.clip[keep].numpy(), "grad_weight": out.grad_weight[keep].numpy(),
                       "token_loss": out.token_loss[keep].numpy(), "kl": kl[keep].numpy()})
    return {"tokens": tokens, "token_passes": {k: np.concatenate([p[k] for p in passes]) for k in passes[0]}}


def _stored_and_read(tmp_path, name: str, step: dict):
    with RunWriter.create(tmp_path, name, background=False) as writer:
        writer.log_step(0, **step)
    (path,) = data_dir_of(tmp_path / name).rglob("token_passes.parquet")
    stored = pq.read_table(path)
    with RunReader(tmp_path, runs=name) as reader:
        read = reader.sql("SELECT * FROM token_passes ORDER BY \"pass\", rollout_id, position")
    return stored, read


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_token_level_ratio_and_k3_kl_are_derived_not_stored(tmp_path, algo):
    step = _step(algo)
    stored, read = _stored_and_read(tmp_path, algo, step)
    assert stored["new_logp"].null_count == stored["kl"].null_count == stored.num_rows  # nothing stored
    assert stored["ratio"].null_count == 0
    given = step["token_passes"]
    np.testing.assert_allclose(read.new_logp, given["new_logp"], rtol=1e-6, atol=1e-6)  # float32 tolerance
    np.testing.assert_allclose(read.kl, given["kl"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read.ratio, given["ratio"], rtol=1e-7)
    assert read.entropy_decile.notna().all()


def test_values_the_token_row_does_not_give_are_stored(tmp_path):
    """GSPO's ratio is the sequence's (new_logp is not old + ln ratio); a k1 KL is not the k3 the view derives."""
    step = _step("gspo", kl_of=lambda new, ref: new - ref)
    stored, read = _stored_and_read(tmp_path, "gspo", step)
    given = step["token_passes"]
    derivable = np.isclose(given["new_logp"], step["tokens"]["old_logp"][np.tile(np.arange(30), 2)]
                           + np.log(given["ratio"]), rtol=0, atol=1e-6)
    assert stored["new_logp"].null_count == derivable.sum() < stored.num_rows  # stored where not derivable
    assert stored["kl"].null_count == (given["kl"] == 0).sum()  # k1 = k3 = 0 only where new == ref
    np.testing.assert_allclose(read.new_logp, given["new_logp"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(read.kl, given["kl"], rtol=1e-6, atol=1e-7)


def test_sampler_log_probs_that_repeat_a_column_are_stored_once(tmp_path):
    step = _step("grpo")
    tokens = step["tokens"]
    rollout = tokens["rollout_id"]
    # an import with the sampler's log-prob but not the full one (NULL, not "equal"), one value 1 ulp off old_logp
    tokens["sampler_logp_full"] = np.where(rollout == 1, np.nan, tokens["sampler_logp_full"])
    tokens["sampler_logp_full"] = [None if np.isnan(v) else v for v in tokens["sampler_logp_full"]]
    tokens["sampler_logp"][0] = np.nextafter(tokens["old_logp"][0], np.float32(0))
    with RunWriter.create(tmp_path, "sampler", background=False) as writer:
        writer.log_step(0, **step)
    (path,) = data_dir_of(tmp_path / "sampler").rglob("tokens.parquet")
    stored = pq.read_table(path)
    assert stored.schema.equals(FILE_SCHEMAS["tokens"])
    # rollouts 0 and 1: sampler = old; 0, 2: full = sampler; 1: full NULL, 3: differs; token 0: neither (1 ulp)
    first = np.arange(len(rollout)) == 0
    same_as_old = (rollout < 2) & ~first
    same_as_sampler = ((rollout == 0) | (rollout == 2)) & ~first
    np.testing.assert_array_equal(stored["sampler_logp"].is_null().to_numpy(zero_copy_only=False), same_as_old)
    np.testing.assert_array_equal(stored["sampler_logp_full"].is_null().to_numpy(zero_copy_only=False),
                                  same_as_sampler | (rollout == 1))
    np.testing.assert_array_equal(stored["elided"].to_numpy(), same_as_old * 1 + same_as_sampler * 2)
    with RunReader(tmp_path) as reader:
        read = reader.sql("SELECT * FROM tokens ORDER BY rollout_id, position")
        exported = reader.export(tmp_path / "sampler.duckdb")
    assert list(read.columns) == TABLE_SCHEMAS["tokens"].names  # `elided` is the files' own
    for name in ("old_logp", "sampler_logp"):  # exactly the logged float32 values
        np.testing.assert_array_equal(read[name].to_numpy(), np.asarray(tokens[name], np.float32))
    full = np.array([np.nan if v is None else v for v in tokens["sampler_logp_full"]], np.float32)
    np.testing.assert_array_equal(read.sampler_logp_full.to_numpy(), full)  # NaN where NULL, as logged
    with duckdb.connect(str(exported), read_only=True) as con:
        assert con.execute("SELECT count(sampler_logp), count(sampler_logp_full) FROM tokens").fetchone() == (
            len(rollout), int((rollout != 1).sum()))


def test_stored_tokens_compares_bits():
    """-0.0 and 0.0 are equal numbers with other bits (kept); NaN repeats NaN (left out: it reads back as NaN)."""
    rows = table_rows("tokens", {"rollout_id": [0, 0, 0], "position": [0, 1, 2], "old_logp": [0.0, np.nan, -1.5],
                                 "sampler_logp": [-0.0, np.nan, -1.5], "sampler_logp_full": [None, np.nan, -1.25]},
                      "r", 0)
    stored = stored_tokens(rows)
    assert stored["elided"].to_pylist() == [0, 1 | 2, 1]
    assert stored["sampler_logp"].is_null().to_pylist() == [False, True, True]
    assert stored["sampler_logp_full"].to_pylist()[2] == -1.25


def test_a_query_that_reads_no_derived_column_reads_no_token_file(tmp_path):
    """The view's join with the tokens is grouped on the key, so DuckDB drops it when no derived column is read:
    sums over every pass row cost a scan of the passes alone."""
    _stored_and_read(tmp_path, "plan", _step("grpo"))
    with RunReader(tmp_path) as reader:
        lean = reader.rows("EXPLAIN SELECT avg(grad_weight), avg(ratio) FROM token_passes")[1][0][1]
        full = reader.rows("EXPLAIN SELECT avg(kl) FROM token_passes")[1][0][1]
    assert "JOIN" not in lean.upper() and "tokens.parquet" not in lean
    assert "JOIN" in full.upper()


_PREVIOUS_RELEASE = ("entropy_decile", "token_text")  # token-pass columns the previous layout did not have


def _to_previous_layout(logs_dir, name: str) -> None:
    """Rewrite a run's step folders as the release before this layout wrote them: float64 per-token values, every
    value stored (new_logp, kl and the sampler log-probs as the current views derive them), no `elided` and no
    columns of `_PREVIOUS_RELEASE`."""
    with RunReader(logs_dir, runs=name) as reader:
        passes = reader.sql("SELECT * FROM token_passes ORDER BY step, rollout_id, \"pass\", position")  # file order
        tokens = reader.sql("SELECT * FROM tokens ORDER BY step, rollout_id, position")
    live = scan_segments(data_dir_of(logs_dir / name))  # not the folders a merge replaced (being deleted)
    for path in (p for segment in live for p in Path(segment.path).glob("*.parquet")):
        table = path.stem
        rows = pq.read_table(path)
        if table == "token_passes":
            mine = passes[passes.step.isin(set(rows["step"].to_pylist()))]
            for column in ("new_logp", "kl"):
                rows = rows.set_column(rows.schema.get_field_index(column), column,
                                       pa.array(mine[column].to_numpy(np.float32)))
        if table == "tokens":
            mine = tokens[tokens.step.isin(set(rows["step"].to_pylist()))]
            for column in ("sampler_logp", "sampler_logp_full"):
                rows = rows.set_column(rows.schema.get_field_index(column), column,
                                       pa.array(mine[column].to_numpy(np.float32), from_pandas=True))
        fields = [pa.field(f.name, pa.float64()) if f.type == pa.float32() else f for f in TABLE_SCHEMAS[table]
                  if table != "token_passes" or f.name not in _PREVIOUS_RELEASE]
        pq.write_table(pa.Table.from_arrays([rows[f.name].cast(f.type) for f in fields],
                                            schema=pa.schema(fields)), path)


def test_a_run_of_the_previous_layout_reads_and_compacts(tmp_path):
    step = _step("grpo")
    with RunWriter.create(tmp_path, "old", background=False, compact_every=1000) as writer:
        writer.log_step(0, **step)
    tokens_sql = "SELECT * FROM tokens ORDER BY step, rollout_id, position"
    with RunReader(tmp_path) as reader:
        expected = reader.sql("SELECT * FROM token_passes ORDER BY rollout_id, \"pass\", position")
        expected_tokens = reader.sql(tokens_sql)
    _to_previous_layout(tmp_path, "old")
    data = data_dir_of(tmp_path / "old")
    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        pd_testing_equal(reader.sql(tokens_sql), expected_tokens)
        old = reader.sql("SELECT * FROM token_passes ORDER BY rollout_id, \"pass\", position")
        assert old.entropy_decile.isna().all() and old.token_text.isna().all()
        pd_testing_equal(old.drop(columns=list(_PREVIOUS_RELEASE)), expected.drop(columns=list(_PREVIOUS_RELEASE)))
    # Logging on with compaction merges the old step into a chunk in the current layout.
    with RunWriter.resume(tmp_path, "old", compact_every=2, background=False) as writer:
        writer.log_step(1, **step)
    (chunk,) = [p for p in data.rglob("token_passes.parquet") if "chunk-" in str(p)]
    assert pq.read_schema(chunk).remove_metadata().equals(TABLE_SCHEMAS["token_passes"])
    with RunReader(tmp_path) as reader:
        both = reader.sql("SELECT * FROM token_passes ORDER BY step, rollout_id, \"pass\", position")
        both_tokens = reader.sql(tokens_sql)
    pd_testing_equal(both_tokens[both_tokens.step == 0], expected_tokens)
    pd_testing_equal(both[both.step == 0].drop(columns=list(_PREVIOUS_RELEASE)),
                     expected.drop(columns=list(_PREVIOUS_RELEASE)))


def _training_run(logs_dir, name: str, steps: int = 3) -> None:
    with RunWriter.create(logs_dir, name, algorithm="grpo", background=False, compact_every=1000) as writer:
        for i in range(steps):
            step = _step("dapo", seed=i)
            texts = np.array(["a", "b", " c", "\n"], dtype=object)
            step["tokens"]["token_text"] = texts[(step["tokens"]["position"] * 7 + i) % 4]
            step["rollouts"] = {"rollout_id": np.arange(4), "kind": ["train"] * 4, "length": [12, 7, 2, 9]}
            writer.log_step(i, **step)


@pytest.mark.parametrize("bucket", [0, 4])
def test_token_statistics_of_the_previous_layout_equal_the_current(tmp_path, bucket):
    """The current layout's join-free statistics (text and decile on the passes) against the token join that runs
    of the previous layout still take: the same numbers, for every bin count."""
    from dashboard import data, token_data

    _training_run(tmp_path, "new")
    _training_run(tmp_path, "old")
    _to_previous_layout(tmp_path, "old")
    with RunReader(tmp_path) as reader:
        assert data.passes_carry_tokens(reader, "new", 2) and not data.passes_carry_tokens(reader, "old", 2)
        new, old = (token_data.token_stats(reader, run, 0, 2, bucket) for run in ("new", "old"))
        assert len(new) == 4 * (1 if not bucket else 3) and new["count"].sum() == 3 * 30
        pd_testing_equal(new, old)
        for bins in (10, 5, 4):
            new, old = (token_data.entropy_bins(reader, (run,), 0, 2, bins).drop(columns="run")
                        for run in ("new", "old"))
            assert new.pass_rows.sum() == 3 * 60
            pd_testing_equal(new, old)


def test_token_statistics_page_opens_on_the_whole_run_when_its_passes_carry_their_tokens(tmp_path, monkeypatch):
    from test_dashboard import open_page

    from dashboard import queries

    _training_run(tmp_path, "new")
    _training_run(tmp_path, "old")
    _to_previous_layout(tmp_path, "old")
    monkeypatch.setattr(queries, "STATS_DEFAULT_TOKENS", 1)  # every step is over the budget: the last step alone
    for run, opened in (("new", (0, 2)), ("old", (2, 2))):
        at = open_page(tmp_path, "token_stats", monkeypatch, run=run)
        assert at.select_slider(key="stats_steps").value == opened


def pd_testing_equal(a, b) -> None:
    import pandas as pd

    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_exact=False,
                                  rtol=1e-6, atol=1e-7)


def test_export_holds_the_derived_values(tmp_path):
    step = _step("grpo")
    _, read = _stored_and_read(tmp_path, "exp", step)
    import duckdb

    with RunReader(tmp_path) as reader:
        reader.export(tmp_path / "out.duckdb")
    with duckdb.connect(str(tmp_path / "out.duckdb"), read_only=True) as con:
        got = con.execute("SELECT new_logp, kl FROM token_passes ORDER BY \"pass\", rollout_id, position").df()
        kinds = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'tokens'").fetchall())
    np.testing.assert_array_equal(got.new_logp, read.new_logp)
    np.testing.assert_array_equal(got.kl, read.kl)
    assert kinds["old_logp"] == "DOUBLE"
