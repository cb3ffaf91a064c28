"""End-to-end tests of the training engine on a tiny config: every algorithm, logged invariants, determinism, resume.

Each run trains a ~90k-parameter model for 2-4 steps (see conftest.TINY); the warm start is cached across sessions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY

from engine.objectives import ALGORITHMS, CLIP_COV, CLIP_HIGH, CLIP_LOW, CLIP_NONE, OBJECTIVES, defaults
from engine.runlog import RunReader, list_runs

pytestmark = pytest.mark.slow

TIMING = {"wall_time", "step_seconds", "extra"}


def read(logs_dir, run, query, params=()):
    with RunReader(logs_dir) as r:
        return r.sql(query.replace("RUN", "?"), [run, *params] if "RUN" in query else list(params))


# ----------------------------------------------------------------------------- every algorithm, 2 steps


@pytest.fixture(scope="module")
def algo_runs(tmp_path_factory, run_tiny):
    """Two steps of every algorithm into one logs folder (eval only at step 0 to keep it quick)."""
    logs_dir = tmp_path_factory.mktemp("algos")
    for algo in ALGORITHMS:
        status = run_tiny(logs_dir, f"t-{algo}", algo=algo, steps=2, eval_every=0, checkpoint_every=2)
        assert status == "finished"
    return logs_dir


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_each_algorithm_trains_and_logs_consistent_values(algo_runs, warm_cache, algo):
    from engine.policy import load_policy
    from engine.tasks import get_task
    from engine.train import checkpoint_steps, model_config

    logs_dir, run = algo_runs, f"t-{algo}"
    cfg = json.loads((logs_dir / run / "run.json").read_text())["config"]

    # ---- parameters changed (checkpoint after step 2 vs the cached warm start)
    task = get_task(cfg["task"], seed=cfg["task_seed"])
    from engine.policy import SFTConfig

    warm, _, _ = load_policy(task, cache_dir=warm_cache, seed=cfg["task_seed"], model_config=model_config("tiny"),
                             sft=SFTConfig(steps=cfg["sft_steps"], warmup_steps=min(20, cfg["sft_steps"]),
                                           num_threads=1), device="cpu")
    checkpoints = checkpoint_steps(logs_dir / run)
    ckpt = torch.load(checkpoints[max(checkpoints)], weights_only=False)
    assert ckpt["step"] == 2
    moved = [k for k, v in warm.state_dict().items() if not torch.equal(v, ckpt["model"][k])]
    assert moved, "no parameter changed"

    steps = read(logs_dir, run, "SELECT * FROM steps WHERE run = RUN ORDER BY step")
    assert steps.step.tolist() == [1, 2]  # no evaluation, so no step 0
    assert steps.groups_kept.tolist() == [4, 4]

    roll = read(logs_dir, run, "SELECT * FROM rollouts WHERE run = RUN AND kind = 'train' AND NOT filtered")
    assert len(roll) == 2 * 16
    # ---- group advantages sum to ~0 per group (outcome supervision; a critic's GAE advantages are not relative)
    if not OBJECTIVES[algo].critic:
        sums = roll.groupby(["step", "group_id"]).advantage.sum()
        np.testing.assert_allclose(sums.to_numpy(), 0.0, atol=1e-4)
    if algo == "dr_grpo":  # A = R - mean, no std
        for _, g in roll.groupby(["step", "group_id"]):
            np.testing.assert_allclose(g.advantage, g.reward - g.reward.mean(), atol=1e-5)

    tp = read(logs_dir, run, """
        SELECT p.*, t.old_logp, t.ref_logp, t.advantage AS adv, r.length
        FROM token_passes p JOIN tokens t USING (run, step, rollout_id, position)
        JOIN rollouts r USING (run, step, rollout_id) WHERE p.run = RUN""")
    n_tokens = int(roll.length.sum())
    epochs, minibatches = cfg["epochs"], cfg["minibatches"]
    assert len(tp) == epochs * n_tokens  # every train token once per epoch
    assert tp["pass"].max() == epochs * minibatches - 1

    # pass 0 sees the sampling policy itself: ratio 1, nothing clipped
    first = tp[tp["pass"] == 0]
    np.testing.assert_allclose(first.ratio, 1.0, atol=1e-4)
    # soft caps may mark a cap at r == 1; covariance rules select tokens at any ratio (code 4, nothing else)
    assert (first["clip"] == CLIP_NONE).all() or algo in ("cispo", "sapo", "clip_cov", "kl_cov")
    if algo in ("clip_cov", "kl_cov"):
        assert set(first["clip"]) <= {CLIP_NONE, CLIP_COV} and (tp["clip"] == CLIP_COV).any()
        # the steps row's share of selected tokens (in `extra`) is the token rows' own
        shares = tp.groupby("step")["clip"].apply(lambda c: float((c == CLIP_COV).mean()))
        logged = [json.loads(e)["clip_cov_frac"] for e in steps.extra]
        np.testing.assert_allclose(logged, shares.loc[[1, 2]].to_numpy(), rtol=1e-9)
    assert (tp.ratio - 1).abs().max() > 1e-3, "ratios never left 1: the update passes are not off-policy"

    # ---- clip codes agree with ratios, advantages and eps
    p = defaults(algo) | {k: cfg[k] for k in ("eps_low", "eps_high") if cfg.get(k) is not None}
    adv = tp.adv.to_numpy()
    if algo in ("grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "luspo", "clip_cov"):
        lo, hi = 1 - p["eps_low"], 1 + p["eps_high"]
        np.testing.assert_array_equal(tp["clip"] == CLIP_LOW, (adv < 0) & (tp.ratio < lo))
        np.testing.assert_array_equal(tp["clip"] == CLIP_HIGH, (adv > 0) & (tp.ratio > hi))
    if algo in ("grpo", "dapo", "dr_grpo", "ppo", "gpg", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov"):
        np.testing.assert_allclose(tp.ratio, np.exp(tp.new_logp - tp.old_logp), rtol=1e-5)
    if algo == "aspo":  # eps 0.2, or 0.4 on high-entropy tokens
        low, high = tp["clip"] == CLIP_LOW, tp["clip"] == CLIP_HIGH
        assert ((adv[low] < 0) & (tp.ratio[low] < 0.8)).all()
        assert ((adv[high] > 0) & (tp.ratio[high] > 1.2)).all()
    if algo in ("gspo", "gspo_token", "gmpo", "luspo", "vespo"):  # one sequence ratio per rollout and pass, logged
        spread = tp.groupby(["step", "pass", "rollout_id"]).ratio.agg(lambda x: x.max() - x.min())
        assert spread.max() < 1e-5
        seq = read(logs_dir, run, "SELECT seq_ratio FROM rollouts WHERE run = RUN AND kind = 'train'")
        assert all(len(s) == epochs for s in seq.seq_ratio)

    # ---- grad weights: zero on hard-clipped tokens (up to the KL term for algorithms with beta > 0)
    clipped = tp[tp["clip"].isin([CLIP_LOW, CLIP_HIGH])]
    if cfg["beta"] == 0:
        np.testing.assert_allclose(clipped.grad_weight, 0.0, atol=1e-9)
    else:
        kl_bound = cfg["beta"] * np.abs(np.exp(clipped.ref_logp - clipped.new_logp) - 1) + 1e-9
        assert (clipped.grad_weight.abs() <= kl_bound).all()


# ----------------------------------------------------------------------------- the shared fixtures' runs


def test_tiny_run_tables_are_complete(tiny_run):
    logs_dir, run = tiny_run
    with RunReader(logs_dir) as r:
        meta = r.sql("SELECT * FROM runs WHERE run = ?", [run])
        assert meta.status.tolist() == ["finished"] and meta.last_step.tolist() == [3]
        cfg = json.loads(meta.config[0])
        # the algorithm is stored once, as the run's `algorithm` (not again in its config)
        assert meta.algorithm.tolist() == ["grpo"] and "algo" not in cfg
        assert cfg["eps_low"] == 0.2 and cfg["beta"] == 0.04
        steps = r.sql("SELECT * FROM steps WHERE run = ? ORDER BY step", [run])
        assert steps.step.tolist() == [0, 1, 2, 3]
        assert steps.heldout_accuracy.notna().tolist() == [True, False, True, True]
        assert steps.loss.iloc[1:].notna().all() and steps.entropy.iloc[1:].gt(0).all()
        roll = r.sql("SELECT * FROM rollouts WHERE run = ?", [run])
        assert roll.groupby("step").rollout_id.apply(lambda s: s.is_unique).all()
        evals = roll[roll.kind == "eval"]
        assert sorted(evals.step.unique()) == [0, 2, 3]
        # the same held-out prompts at every evaluation, greedy (index 0) and sampled (index 1)
        ids = evals.groupby("step").prompt_id.apply(lambda s: tuple(sorted(s)))
        assert ids.nunique() == 1 and len(ids.iloc[0]) == 16
        # eval accuracy in steps == mean correctness of the logged greedy eval rollouts
        greedy = evals[evals.index_in_group == 0].groupby("step").reward_correct.mean()
        np.testing.assert_allclose(steps.set_index("step").heldout_accuracy.dropna(), greedy)
        tokens = r.sql("SELECT step, rollout_id, count(*) AS n, max(position) AS last FROM tokens WHERE run = ? "
                       "GROUP BY ALL", [run])
        merged = tokens.merge(roll, on=["step", "rollout_id"])
        assert (merged.n == merged.length).all() and (merged["last"] == merged.length - 1).all()
        kinds = r.sql("SELECT DISTINCT kind FROM token_passes JOIN rollouts USING (run, step, rollout_id) "
                      "WHERE run = ?", [run])
        assert kinds.kind.tolist() == ["train"]  # eval rollouts are never trained on
        # truncated <=> no EOS token at the end
        eos = r.sql("SELECT step, rollout_id, token_text FROM tokens WHERE run = ? AND position = "
                    "(SELECT length - 1 FROM rollouts x WHERE x.run = tokens.run AND x.step = tokens.step "
                    "AND x.rollout_id = tokens.rollout_id)", [run]).merge(roll, on=["step", "rollout_id"])
        np.testing.assert_array_equal(eos.truncated, eos.token_text != "<eos>")


def test_process_run_token_advantages_sum_later_step_rewards(tiny_process_run):
    logs_dir, run = tiny_process_run
    with RunReader(logs_dir) as r:
        prm = r.sql("SELECT p.* FROM prm_steps p JOIN rollouts USING (run, step, rollout_id) "
                    "WHERE p.run = ? AND kind = 'train' AND NOT filtered", [run])
        tok = r.sql("SELECT t.* FROM tokens t JOIN rollouts USING (run, step, rollout_id) "
                    "WHERE t.run = ? AND kind = 'train'", [run])
    assert len(prm) > 0 and prm.reward_norm.notna().all()
    assert set(prm.reward_raw.unique()) <= {1.0, 0.25, -1.0}
    assert tok.advantage.abs().sum() > 0
    for (step, rid), steps_ in prm.groupby(["step", "rollout_id"]):
        t = tok[(tok.step == step) & (tok.rollout_id == rid)].sort_values("position")
        for pos, adv in zip(t.position, t.advantage, strict=True):
            expected = steps_[steps_.last_pos >= pos].reward_norm.sum()
            assert adv == pytest.approx(expected, abs=1e-4)
        # a token's PRM step is the step that ends at or after it
        for _, s in steps_.iterrows():
            owned = t[(t.position >= s.first_pos) & (t.position <= s.last_pos)]
            assert (owned.prm_step == s.step_index).all()
    # normalised over all steps of the group: mean 0 per group
    with RunReader(logs_dir) as r:
        g = r.sql("SELECT p.step, group_id, avg(reward_norm) AS m, count(DISTINCT reward_raw) AS k FROM prm_steps p "
                  "JOIN rollouts USING (run, step, rollout_id) WHERE p.run = ? AND kind = 'train' GROUP BY ALL",
                  [run])
    np.testing.assert_allclose(g[g.k > 1].m, 0.0, atol=1e-4)


# ----------------------------------------------------------------------------- determinism and resume


def _comparable(logs_dir, run):
    steps = read(logs_dir, run, "SELECT * FROM steps WHERE run = RUN ORDER BY step").drop(columns=[*TIMING, "run"])
    passes = read(logs_dir, run, "SELECT step, pass, rollout_id, position, new_logp, ratio, clip, grad_weight "
                  "FROM token_passes WHERE run = RUN ORDER BY ALL")
    comps = read(logs_dir, run, "SELECT step, rollout_id, completion, reward, advantage FROM rollouts "
                 "WHERE run = RUN ORDER BY ALL")
    return steps, passes, comps


def assert_same_run(a, b):
    """The runs `a` and `b` ((logs_dir, name) each) logged the same steps with the same numbers (timings aside)."""
    for x, y in zip(_comparable(*a), _comparable(*b), strict=True):
        assert len(x) > 0
        for col in x.columns:
            if x[col].dtype.kind == "f":
                np.testing.assert_allclose(x[col].to_numpy(), y[col].to_numpy(), rtol=1e-6, atol=1e-7,
                                           err_msg=col, equal_nan=True)
            else:
                assert x[col].tolist() == y[col].tolist(), col


def test_same_config_same_numbers_and_resume_continues_identically(tmp_path, run_tiny):
    overrides = dict(algo="dapo", steps=3, eval_every=2, checkpoint_every=2, seed=3)
    assert run_tiny(tmp_path, "straight", **overrides) == "finished"
    # the same run in two parts: 2 steps, then --resume to 3
    assert run_tiny(tmp_path, "halves", **(overrides | {"steps": 2})) == "finished"
    assert run_tiny(tmp_path, "halves", resume=True, **overrides) == "finished"

    assert _comparable(tmp_path, "straight")[0].step.tolist() == [0, 1, 2, 3]
    assert_same_run((tmp_path, "straight"), (tmp_path, "halves"))
    assert read(tmp_path, "halves", "SELECT status FROM runs WHERE run = RUN").status[0] == "finished"


def test_a_run_whose_sampler_lags_resumes_with_its_stale_weights(tmp_path, run_tiny):
    """The checkpoint keeps the sampler's lag window: resumed after step 2, a bf16 sampler two updates behind
    samples step 3 with the weights of step 1, as the uninterrupted run did (not with the restored ones)."""
    overrides = dict(algo="grpo", steps=4, eval_every=0, checkpoint_every=2, seed=5, sampler_dtype="bfloat16",
                     sampler_lag=2)
    assert run_tiny(tmp_path, "straight", **overrides) == "finished"
    assert run_tiny(tmp_path, "halves", **(overrides | {"steps": 2})) == "finished"
    assert run_tiny(tmp_path, "halves", resume=True, **overrides) == "finished"

    assert_same_run((tmp_path, "straight"), (tmp_path, "halves"))
    query = "SELECT step, rollout_id, position, sampler_logp FROM tokens WHERE run = RUN AND step > 2 ORDER BY ALL"
    straight, halves = read(tmp_path, "straight", query), read(tmp_path, "halves", query)
    assert len(straight) > 0 and straight.sampler_logp.notna().all()
    np.testing.assert_allclose(halves.sampler_logp, straight.sampler_logp, rtol=1e-6, atol=1e-7)


def test_a_run_with_the_former_single_checkpoint_file_resumes_from_it(tmp_path, run_tiny):
    """Runs logged before per-step checkpoints kept one `checkpoints/latest.pt`: resume continues from it instead
    of discarding their steps."""
    from engine.train import LEGACY_CHECKPOINT_FILE, checkpoint_steps

    assert run_tiny(tmp_path, "old", steps=2, checkpoint_every=1, **KILLED) == "finished"
    found = checkpoint_steps(tmp_path / "old")
    assert sorted(found) == [2]  # once the run is closed, only the newest
    found[2].rename(found[2].with_name(LEGACY_CHECKPOINT_FILE))
    before = steps_and_times(tmp_path, "old")
    assert run_tiny(tmp_path, "old", resume=True, steps=3, **KILLED) == "finished"
    after = steps_and_times(tmp_path, "old")
    assert after.step.tolist() == [0, 1, 2, 3] and after.wall_time.iloc[:3].tolist() == before.wall_time.tolist()


def test_resume_of_a_missing_run_is_a_clear_error(tmp_path, run_tiny):
    from engine.runlog import RunLogError

    with pytest.raises(RunLogError, match="no run 'never-ran' to resume"):
        run_tiny(tmp_path, "never-ran", resume=True, steps=2)


# ----------------------------------------------------------------------------- SIGKILL and --resume

KILLED = dict(algo="grpo", eval_every=2, seed=5)
"""Config of the runs killed below (on top of TINY); `straight_run` trains it to FINAL_STEP with no kill."""
FINAL_STEP = 10


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, run_tiny):
    logs_dir = tmp_path_factory.mktemp("straight")
    assert run_tiny(logs_dir, "straight", steps=FINAL_STEP, **KILLED) == "finished"
    return logs_dir, "straight"


def train_process(logs_dir, warm_cache, name, *flags, before=""):
    """`policylens train` of a tiny run (KILLED) in a subprocess, 40 steps (it is killed long before), after
    running the Python statements `before` in that process."""
    import subprocess
    import sys

    argv = ["train", "--logs-dir", str(logs_dir), "--run-name", name, "--cache-dir", str(warm_cache),
            "--no-progress", "--steps", "40", *flags]
    for key, value in (TINY | KILLED).items():
        if key != "checkpoint_every":
            argv += ["--" + key.replace("_", "-"), str(value)]
    code = f"{before}\nimport sys\nfrom engine.cli import main\nsys.exit(main({argv!r}))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def last_logged_step(logs_dir, run) -> int | None:
    return next((r["last_step"] for r in list_runs(logs_dir) if r["run"] == run), None)


def kill_when(proc, condition, what):
    """SIGKILL `proc` as soon as `condition()` holds (failing if it exits first, or makes no progress)."""
    from waits import wait_until

    def check():
        assert proc.poll() is None, proc.communicate()
        return condition()

    try:
        wait_until(check, what)
    finally:
        proc.kill()
        proc.communicate()


def steps_and_times(logs_dir, run):
    return read(logs_dir, run, "SELECT step, wall_time FROM steps WHERE run = RUN ORDER BY step")


def test_a_kill_after_the_checkpoint_but_before_the_step_is_logged_loses_nothing(tmp_path, warm_cache, run_tiny,
                                                                                  straight_run):
    """The bad moment made certain: in the training process, writing step 3's Parquet files hangs, so the trainer
    writes step 3's checkpoint and goes on to step 4 while step 3 is not in the log. Killed then, the resumed run
    must train step 3 again (not continue at step 4 with step 3 missing for good)."""
    from engine.train import CHECKPOINT_DIR

    hang_at_step_3 = (
        "import time, engine.runlog as runlog\n"
        "write = runlog._FolderWriter._write\n"
        "def hang_at_step_3(folder, table, rows):\n"
        "    if '.tmp-step-000000003.' in str(folder.tmp):\n"
        "        time.sleep(3600)\n"
        "    write(folder, table, rows)\n"
        "runlog._FolderWriter._write = hang_at_step_3"
    )
    proc = train_process(tmp_path, warm_cache, "killed", "--checkpoint-every", "1", before=hang_at_step_3)
    ckpt_dir = tmp_path / "killed" / CHECKPOINT_DIR

    def step_3_checkpointed():  # a checkpoint file that holds step 3 (whatever its name)
        import torch

        for path in ckpt_dir.glob("[!.]*.pt"):
            try:
                if torch.load(path, weights_only=False)["step"] == 3:
                    return True
            except (OSError, RuntimeError, EOFError, KeyError):  # being replaced
                pass
        return False

    kill_when(proc, step_3_checkpointed, "step 3's checkpoint")
    assert steps_and_times(tmp_path, "killed").step.tolist() == [0, 1, 2]  # the checkpoint is ahead of the log

    assert run_tiny(tmp_path, "killed", resume=True, steps=FINAL_STEP, **KILLED) == "finished"
    assert steps_and_times(tmp_path, "killed").step.tolist() == list(range(FINAL_STEP + 1))
    assert_same_run(straight_run, (tmp_path, "killed"))


@pytest.mark.parametrize("checkpoint_every", [None, 0], ids=["default", "no-checkpoint"])
def test_a_killed_run_resumes_losing_at_most_the_step_in_flight(tmp_path, warm_cache, run_tiny, straight_run,
                                                                checkpoint_every):
    """SIGKILL while training, at no chosen moment. With the default (a checkpoint every step) the resumed run keeps
    every logged step but at most the last (whose checkpoint may not have been complete) and goes on; a run killed
    before it had any checkpoint starts again from the warm start (keeping step 0, the warm start's evaluation).
    Either way the finished run has each step once, with the numbers of a run never killed."""
    flags = () if checkpoint_every is None else ("--checkpoint-every", str(checkpoint_every))
    proc = train_process(tmp_path, warm_cache, "killed", *flags)
    kill_when(proc, lambda: (last_logged_step(tmp_path, "killed") or 0) >= 3, "step 3 to be logged")
    before = steps_and_times(tmp_path, "killed")
    assert before.step.tolist() == list(range(len(before))) and 4 <= len(before) <= FINAL_STEP

    assert run_tiny(tmp_path, "killed", resume=True, steps=FINAL_STEP, **KILLED) == "finished"
    after = steps_and_times(tmp_path, "killed")
    assert after.step.tolist() == list(range(FINAL_STEP + 1))  # no step missing, none twice
    kept = int((after.wall_time.iloc[: len(before)].to_numpy() == before.wall_time.to_numpy()).sum())
    if checkpoint_every is None:
        assert kept >= len(before) - 1, (kept, len(before))  # only the step in flight was trained again
    else:
        assert kept == 1  # nothing to continue from: every step again from the warm start, but its evaluation
    assert_same_run(straight_run, (tmp_path, "killed"))


# ----------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_gives_up_after_max_gen_batches(tmp_path, run_tiny):
    from engine.rollout import DynamicSamplingError

    # Near-greedy sampling makes the G completions of a prompt identical: every group has equal rewards.
    with pytest.raises(DynamicSamplingError, match=r"after 2 generation batches.*max-gen-batches"):
        run_tiny(tmp_path, "ds", algo="dapo", steps=1, temperature=0.01, max_gen_batches=2, eval_every=0)
    assert read(tmp_path, "ds", "SELECT status FROM runs WHERE run = RUN").status[0] == "crashed"


def test_dynamic_sampling_logs_dropped_groups(tmp_path, run_tiny):
    run_tiny(tmp_path, "ds2", algo="dapo", steps=2, eval_every=0, max_gen_batches=30, temperature=1.3)
    steps = read(tmp_path, "ds2", "SELECT * FROM steps WHERE run = RUN AND step > 0 ORDER BY step")
    roll = read(tmp_path, "ds2", "SELECT * FROM rollouts WHERE run = RUN AND kind = 'train'")
    kept = roll[~roll.filtered]
    # every kept group has mixed rewards; every dropped group has equal rewards and says why
    assert (kept.groupby(["step", "group_id"]).reward.nunique() > 1).all()
    dropped = roll[roll.filtered]
    assert set(dropped.filter_reason.unique()) <= {"all_correct", "all_wrong", "all_equal"}
    if len(dropped):
        assert (dropped.groupby(["step", "group_id"]).reward.nunique() == 1).all()
    assert (steps.groups_filtered.to_numpy() == dropped.groupby("step").group_id.nunique()
            .reindex(steps.step, fill_value=0).to_numpy()).all()
    assert (steps.gen_batches >= 1).all()


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_stops_after_the_step_and_the_run_resumes(tmp_path, warm_cache, run_tiny):
    import signal

    from waits import wait_until

    proc = train_process(tmp_path, warm_cache, "sig", "--checkpoint-every", "0")
    try:
        def progress():
            return last_logged_step(tmp_path, "sig")

        def has_a_step():
            assert proc.poll() is None, proc.communicate()
            return (progress() or 0) >= 1

        wait_until(has_a_step, "a first training step", progress)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: proc.poll() is not None, "the run to stop after its step", progress)
        out, err = proc.communicate()
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped" in out
    run = next(r for r in list_runs(tmp_path) if r["run"] == "sig")
    assert run["status"] == "stopped" and 1 <= run["last_step"] < 40
    # a checkpoint was written on the way out (none before: --checkpoint-every 0), so the run continues with the
    # next step number and keeps the steps it logged
    last = run["last_step"]
    before = steps_and_times(tmp_path, "sig")
    assert run_tiny(tmp_path, "sig", resume=True, steps=last + 1, **KILLED) == "finished"
    after = steps_and_times(tmp_path, "sig")
    assert after.step.tolist() == list(range(last + 2))
    assert after.wall_time.iloc[:-1].tolist() == before.wall_time.tolist()


def test_time_limit_finishes_after_the_step_that_crosses_it(tmp_path, run_tiny):
    assert run_tiny(tmp_path, "timed", steps=50, time_limit_minutes=1e-9, eval_every=10) == "finished"
    steps = read(tmp_path, "timed", "SELECT step, heldout_accuracy FROM steps WHERE run = RUN ORDER BY step")
    assert steps.step.tolist() == [0, 1] and steps.heldout_accuracy.notna().all()  # the last step is evaluated
