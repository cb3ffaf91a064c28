"""The TRL adapter (engine/integrations/trl.py) on real TRL GRPOTrainer runs of the tiny warm-started model, on CPU.

Every run is a handful of optimizer steps of a ~90k-parameter model: seconds each. What is checked is what TRL
itself computed (its logged metrics, its backward through the tensor hook) against what the run log holds, and
the hooked gradients against engine.objectives.policy_loss on the same inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig

from engine.importers import run_name_from_folder
from engine.integrations.trl import PolicyLensGRPOTrainer, algorithm_name
from engine.integrations.trl_tasks import task_dataset, task_reward_funcs
from engine.objectives import policy_loss
from engine.runlog import RunReader

MAX_LEN = 24


@pytest.fixture(scope="session")
def warm_model_dir(warm_cache, tmp_path_factory):
    """The tiny warm-started model of the engine's tests, as a save_pretrained folder (model + tokenizer)."""
    from conftest import tiny_config

    from engine.tasks import get_task
    from engine.train import load_models

    cfg = tiny_config()
    model, _, tokenizer, _ = load_models(cfg, get_task(cfg.task, seed=cfg.task_seed), torch.device("cpu"),
                                         warm_cache, sft_threads=1)
    folder = tmp_path_factory.mktemp("trl-warm-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class _KeepLogs(TrainerCallback):
    """Every dict TRL logs, in order (one per optimizer step with logging_steps=1)."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "train_runtime" not in logs:
            self.logs.append(dict(logs))


def train_trl(tmp_path, model_dir, run_name="trl-run", log_groups=None, max_steps=8, tokenizer=None,
              reward_funcs=None, dataset=None, **config):
    """Train a PolicyLensGRPOTrainer run; returns (logs_dir, run_name, output_dir, TRL's logs, trainer)."""
    from engine.tasks import get_task

    torch.set_num_threads(1)
    task = get_task("linear")
    settings = dict(per_device_train_batch_size=8, num_generations=4, steps_per_generation=2, num_iterations=2,
                    max_completion_length=MAX_LEN, max_steps=max_steps, learning_rate=1e-3, beta=0.04,
                    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                    log_completions=True, num_completions_to_print=0, loss_type="grpo",
                    use_bias_correction_kl=False)  # the plain k3 KL of GRPO (and of the engine)
    settings.update(config)
    output_dir = tmp_path / "out" / run_name
    keep = _KeepLogs()
    trainer = PolicyLensGRPOTrainer(
        model=str(model_dir), processing_class=tokenizer,
        reward_funcs=reward_funcs or task_reward_funcs(task, MAX_LEN), args=GRPOConfig(str(output_dir), **settings),
        train_dataset=dataset or task_dataset(task), callbacks=[keep], logs_dir=tmp_path / "logs",
        run_name=run_name, log_groups=log_groups)
    trainer.train()
    return tmp_path / "logs", run_name, output_dir, keep.logs, trainer


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, warm_model_dir):
    """Two PolicyLens steps (generations) of TRL's GRPO: 2 mini-batches x 2 passes each, beta 0.04."""
    return train_trl(tmp_path_factory.mktemp("trl"), warm_model_dir)


def frame(logs_dir, query, params=()):
    with RunReader(logs_dir) as reader:
        assert reader.problems == []
        return reader.sql(query, list(params))


# ---------------------------------------------------------------- the run log of a TRL run


def test_two_trl_steps_are_logged_whole(grpo_run):
    logs_dir, _, _, trl_logs, trainer = grpo_run
    with RunReader(logs_dir) as reader:
        (meta,) = reader.sql("SELECT * FROM runs").to_dict("records")
        steps = reader.sql("SELECT * FROM steps ORDER BY step")
        rollouts = reader.sql("SELECT * FROM rollouts ORDER BY step, rollout_id")
        tokens = reader.sql("SELECT * FROM tokens ORDER BY step, rollout_id, position")
        passes = reader.sql("SELECT * FROM token_passes")
    assert meta["status"] == "finished" and meta["algorithm"] == "grpo"
    config = json.loads(meta["config"])
    assert config["loss_type"] == "grpo" and config["beta"] == 0.04 and config["num_generations"] == 4
    assert list(steps["step"]) == [1, 2]
    assert len(trl_logs) == 8  # 2 generations x 2 passes x 2 mini-batches, one optimizer step each
    # the steps row averages TRL's logs of its generation
    for step, logs in ((1, trl_logs[:4]), (2, trl_logs[4:])):
        row = steps[steps["step"] == step].iloc[0]
        assert "reward" in logs[0] and not any("reward" in x for x in logs[1:])  # logged once per generation
        assert row["reward_mean"] == pytest.approx(logs[0]["reward"])
        assert row["loss"] == pytest.approx(np.mean([x["loss"] for x in logs]))
        assert row["clip_high_frac"] == pytest.approx(np.mean([x["clip_ratio/high_mean"] for x in logs]))
        assert json.loads(row["extra"])["trl_global_step"] == 4 * step

    # rollouts: 16 per step in 4 groups of 4; the total reward is the sum of its components (weights 1)
    assert rollouts.groupby("step").size().tolist() == [16, 16]
    assert (rollouts["group_id"] == rollouts["rollout_id"] // 4).all() and (rollouts["rank"] == 0).all()
    parts = rollouts["reward_components"].map(json.loads)
    assert set(parts.iloc[0]) == {"correct", "overlong"}
    np.testing.assert_allclose(parts.map(lambda d: d["correct"] + d["overlong"]), rollouts["reward"], atol=1e-6)
    # GRPO advantages, as TRL computes them: (r - group mean) / (group std + 1e-4)
    grouped = rollouts.groupby(["step", "group_id"])["reward"]
    expected = (rollouts["reward"] - grouped.transform("mean")) / (grouped.transform("std") + 1e-4)
    np.testing.assert_allclose(rollouts["advantage"], expected, atol=1e-5)

    # tokens: one row per completion token (the EOS included), positions 0..length-1
    per_rollout = tokens.groupby(["step", "rollout_id"])["position"].agg(["count", "max"]).reset_index()
    merged = per_rollout.merge(rollouts[["step", "rollout_id", "length"]], on=["step", "rollout_id"])
    assert (merged["count"] == merged["length"]).all() and (merged["max"] == merged["length"] - 1).all()
    tok = trainer.processing_class
    for (_, r), (_, toks) in zip(rollouts.iterrows(), tokens.groupby(["step", "rollout_id"]), strict=True):
        assert tok.decode(list(toks["token_id"]), skip_special_tokens=True) == r["completion"]
        assert "".join(toks["token_text"]).replace(tok.eos_token, "") == r["completion"]
    assert tokens["ref_logp"].notna().all() and tokens["entropy"].notna().all()

    # token passes: every token twice (num_iterations = 2), in one of 4 passes per step
    assert len(passes) == 2 * len(tokens)
    assert sorted(passes["pass"].unique()) == [0, 1, 2, 3]


def test_ratio_is_exp_of_new_minus_old_and_the_first_pass_is_on_policy(grpo_run):
    logs_dir = grpo_run[0]
    joined = frame(logs_dir, """SELECT p.step, p.pass, p.ratio, p.new_logp, t.old_logp FROM token_passes p
                                JOIN tokens t USING (step, rollout_id, position)""")
    np.testing.assert_allclose(joined["ratio"], np.exp(joined["new_logp"] - joined["old_logp"]), rtol=1e-5)
    # pass 0 is the first mini-batch before any update of its generation: TRL's old log-probs are its own
    first = joined[joined["pass"] == 0]
    np.testing.assert_allclose(first["ratio"], 1.0, atol=1e-5)
    assert (joined[joined["pass"] > 0]["ratio"] - 1).abs().max() > 1e-3  # later passes moved


def test_clip_codes_match_trls_logged_clip_fractions_pass_by_pass(grpo_run):
    logs_dir, _, _, trl_logs, _ = grpo_run
    fractions = frame(logs_dir, """SELECT step, pass, avg((clip = 1)::DOUBLE) AS low, avg((clip = 2)::DOUBLE) AS high,
                                   count(*) AS n FROM token_passes GROUP BY step, pass ORDER BY step, pass""")
    assert len(fractions) == len(trl_logs) == 8
    for (_, row), logs in zip(fractions.iterrows(), trl_logs, strict=True):
        assert row["low"] == pytest.approx(logs["clip_ratio/low_mean"], abs=1e-6)
        assert row["high"] == pytest.approx(logs["clip_ratio/high_mean"], abs=1e-6)
    assert (fractions["low"] + fractions["high"]).sum() > 0  # lr 1e-3 clips some tokens: the check compared something


# ---------------------------------------------------------------- grad_weight against engine.objectives


def _pass_tensors(logs_dir, step, pass_):
    """(B, T) tensors of one pass from the run log, rows in rollout order, padded with mask 0."""
    df = frame(logs_dir, """SELECT p.rollout_id, p.position, p.new_logp, p.grad_weight, p.clip, t.old_logp,
                                   t.ref_logp, t.advantage, t.entropy FROM token_passes p JOIN tokens t
                                   USING (step, rollout_id, position) WHERE p.step = ? AND p.pass = ?""",
               [step, pass_])
    ids = sorted(df["rollout_id"].unique())
    row = {r: i for i, r in enumerate(ids)}
    B, T = len(ids), int(df["position"].max()) + 1
    names = ("new_logp", "grad_weight", "old_logp", "ref_logp", "advantage", "clip", "entropy")
    out = {k: torch.zeros(B, T, dtype=torch.float64) for k in (*names, "mask")}
    for r in df.itertuples(index=False):
        i, t = row[r.rollout_id], r.position
        for k in names:
            out[k][i, t] = getattr(r, k)
        out["mask"][i, t] = 1.0
    return out


# (TRL loss_type, importance_sampling_level, extra GRPOConfig) -> (engine algorithm, policy_loss overrides)
MATCHING = {
    "grpo": (("grpo", "token", {}), ("grpo", {"eps_low": 0.2, "eps_high": 0.2})),
    "dapo": (("dapo", "token", {"epsilon_high": 0.28}), ("dapo", {"eps_low": 0.2, "eps_high": 0.28})),
    "bnpo": (("bnpo", "token", {}), ("dapo", {"eps_low": 0.2, "eps_high": 0.2})),
    "dr_grpo": (("dr_grpo", "token", {}), ("dr_grpo", {"eps_low": 0.2, "eps_high": 0.2, "max_len": MAX_LEN})),
    # TRL's CISPO caps the IS weight at epsilon_high (absolute), no lower bound: the engine's 1 + eps_high, eps_low 1
    "cispo": (("cispo", "token", {"epsilon_high": 1.5}), ("cispo", {"eps_low": 1.0, "eps_high": 0.5})),
    "sapo": (("sapo", "token", {}), ("sapo", {})),
    "gspo": (("grpo", "sequence", {"epsilon": 3e-4, "epsilon_high": 4e-4}),
             ("gspo", {"eps_low": 3e-4, "eps_high": 4e-4})),
    "luspo": (("luspo", "sequence", {"epsilon": 3e-4, "epsilon_high": 4e-4}),
              ("luspo", {"eps_low": 3e-4, "eps_high": 4e-4})),
    "vespo": (("vespo", "token", {}), ("vespo", {})),
    # the policy term of only the top half of the tokens by entropy (TRL's threshold over this single process)
    "top_entropy": (("grpo", "token", {"top_entropy_quantile": 0.5}),
                    ("grpo", {"eps_low": 0.2, "eps_high": 0.2, "top_entropy_quantile": 0.5})),
}


@pytest.mark.parametrize("name", list(MATCHING))
def test_grad_weight_is_trls_gradient_and_equals_policy_loss(tmp_path, warm_model_dir, name):
    """One mini-batch per pass (steps_per_generation=1) so TRL's normalisers are the engine's aggregations.

    Not compared, because the engine lacks them: TRL's delta two-sided clipping, the off-policy mask and the vLLM
    importance-sampling correction. dapo / cispo / vespo with several mini-batches per generation normalise by the
    whole generation's token count, the engine by the mini-batch's: the same weights up to that constant factor.
    top_entropy_quantile is compared on pass 0 only: its mask reads the entropy of the pass's own forward, and the
    run log keeps the entropy of the first forward over a token (later passes' entropies are not logged).
    """
    (loss_type, level, extra), (algo, overrides) = MATCHING[name]
    logs_dir, *_ = train_trl(tmp_path, warm_model_dir, run_name=f"trl-{name}", max_steps=2,
                                  steps_per_generation=1, loss_type=loss_type, importance_sampling_level=level, **extra)
    assert frame(logs_dir, "SELECT algorithm FROM runs")["algorithm"][0] == algorithm_name(loss_type, level) == algo
    for pass_ in (0,) if "top_entropy_quantile" in overrides else (0, 1):
        t = _pass_tensors(logs_dir, 1, pass_)
        logp = t["new_logp"].clone().requires_grad_(True)
        out = policy_loss(algo, logp, t["old_logp"], t["advantage"], t["mask"], ref_logp=t["ref_logp"], beta=0.04,
                          entropy=t["entropy"].float(), **overrides)
        on = t["mask"] > 0
        np.testing.assert_allclose(t["grad_weight"][on], out.grad_weight[on], rtol=2e-3, atol=1e-7)
        if name != "sapo":  # TRL logs no SAPO clip rule; the adapter's is the engine's, identical by construction
            assert torch.equal(t["clip"][on].to(torch.int8), out.clip[on])
    if "top_entropy_quantile" in overrides:  # pass 0 (pi = pi_ref, no KL gradient): exactly the kept half moves
        from engine.objectives import top_entropy_mask

        keep = top_entropy_mask(t["entropy"].float(), t["mask"], overrides["top_entropy_quantile"])
        assert torch.equal(t["grad_weight"].abs() > 0, keep) and 0 < int(keep.sum()) < int(on.sum())
    else:
        assert (t["grad_weight"][on].abs() > 0).all()


def test_log_groups_keeps_tokens_of_the_first_groups_only(tmp_path, warm_model_dir):
    logs_dir, *_ = train_trl(tmp_path, warm_model_dir, run_name="trl-some-groups", log_groups=1, max_steps=4)
    counts = frame(logs_dir, """SELECT (SELECT count(*) FROM rollouts) AS rollouts,
                                       (SELECT count(DISTINCT rollout_id) FROM tokens) AS with_tokens,
                                       (SELECT max(rollout_id) FROM token_passes) AS last_pass_rollout,
                                       (SELECT count(*) FROM steps) AS steps""")
    assert counts.iloc[0].tolist() == [16, 4, 3, 1]
    # the kept group's tokens and passes are exactly those of the same run logged in full (same seed, same run):
    # keeping only its rows on the device, and only their gradients in the hook, loses or shifts nothing
    full_dir, *_ = train_trl(tmp_path / "full", warm_model_dir, run_name="trl-all-groups", max_steps=4)
    query = """SELECT step, pass, rollout_id, position, new_logp, ratio, clip, grad_weight, token_loss, kl
               FROM token_passes WHERE rollout_id < 4 ORDER BY ALL"""
    some, full = frame(logs_dir, query), frame(full_dir, query)
    assert len(some) > 0 and some.equals(full)
    query = "SELECT * EXCLUDE (run) FROM tokens WHERE rollout_id < 4 ORDER BY step, rollout_id, position"
    assert frame(logs_dir, query).equals(frame(full_dir, query))


def test_run_name_comes_from_the_output_folder_and_bad_arguments_are_refused(grpo_run, tmp_path, warm_model_dir):
    from engine.runlog import RunLogError
    from engine.tasks import get_task

    assert run_name_from_folder(tmp_path / "my run: v2") == "my-run-v2"
    assert run_name_from_folder("/") == "imported-run"
    with pytest.raises(ValueError, match="log_groups"):
        PolicyLensGRPOTrainer(model=str(warm_model_dir), reward_funcs=[], log_groups=0)
    logs_dir, run, *_ = grpo_run
    before = frame(logs_dir, "SELECT count(*) AS n FROM tokens")["n"][0]
    with pytest.raises(RunLogError, match="already exists"):  # before any training, and the run is untouched
        PolicyLensGRPOTrainer(model=str(warm_model_dir), reward_funcs=[lambda completions, **_: [0.0]],
                              args=GRPOConfig(str(tmp_path / "out"), use_cpu=True, report_to=[]),
                              train_dataset=task_dataset(get_task("linear")),
                              logs_dir=logs_dir, run_name=run)
    assert frame(logs_dir, "SELECT count(*) AS n FROM tokens")["n"][0] == before


# ---------------------------------------------------------------- importing TRL's completions files


def test_importing_trls_completions_files_gives_the_adapters_rollouts(grpo_run, tmp_path):
    import shutil

    from engine.importers import import_trl

    logs_dir, run, output_dir, *_ = grpo_run
    files = sorted((output_dir / "completions").glob("completions_*.parquet"))
    assert len(files) == 8  # one per logging step: each generation written 4 times
    report = import_trl(output_dir, tmp_path / "imported", "from-trl")
    assert report.problems == [] and report.imported == [1, 5]  # deduplicated: one step per generation

    def rows(logs, name):
        return frame(logs, """SELECT dense_rank() OVER (ORDER BY step) AS generation, rollout_id, group_id, prompt,
                                     completion, round(reward, 5) AS reward, round(advantage, 4) AS advantage,
                                     reward_components FROM rollouts WHERE run = ? ORDER BY step, rollout_id""", [name])

    adapter, imported = rows(logs_dir, run), rows(tmp_path / "imported", "from-trl")
    cols = ["generation", "rollout_id", "group_id", "prompt", "completion", "reward", "advantage"]
    assert adapter[cols].equals(imported[cols])
    assert [json.loads(c) for c in imported["reward_components"]] == [
        {k: pytest.approx(v) for k, v in json.loads(c).items()} for c in adapter["reward_components"]]

    # importing again adds nothing and changes nothing
    again = import_trl(output_dir, tmp_path / "imported", "from-trl")
    assert again.imported == [] and again.already_there == 2
    assert rows(tmp_path / "imported", "from-trl").equals(imported)

    # a damaged file is reported by name and skipped; the generation is taken from its next copy
    damaged = tmp_path / "damaged-out"
    shutil.copytree(output_dir, damaged)
    (damaged / "completions" / "completions_00005.parquet").write_bytes(b"PAR1 not really")
    report = import_trl(damaged, tmp_path / "imported", "from-damaged")
    assert len(report.problems) == 1 and "completions_00005.parquet" in report.problems[0]
    assert report.imported == [1, 6]


# ---------------------------------------------------------------- the dashboard on a TRL run


@pytest.mark.parametrize("page", [None, "token_inspector", "groups", "replay", "prm_steps", "algorithm_weighting"])
def test_every_dashboard_page_renders_a_trl_run(grpo_run, page, monkeypatch):
    from tests.test_dashboard import groups_text, open_page

    logs_dir, run, *_ = grpo_run
    at = open_page(str(logs_dir), page, monkeypatch, run=run, step=2, rollout=16)
    if page == "groups":  # every reward function's value is shown next to each completion
        assert "correct" in groups_text(at) and "overlong" in groups_text(at)
    if page == "token_inspector":
        assert not at.error


# ---------------------------------------------------------------- two processes under accelerate


@pytest.mark.slow
def test_two_processes_under_accelerate_log_their_rollouts_by_rank(tmp_path, warm_model_dir):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    # accelerate 1.15: --cpu --num_processes 2 would start one process; --multi_gpu starts two ranks (gloo on CPU)
    done = subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(repo / "examples" / "trl_grpo.py"),
         "--steps", "2", "--prompts", "4", "--model-dir", str(warm_model_dir), "--logs-dir", str(tmp_path),
         "--run-name", "two-ranks"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with RunReader(tmp_path) as reader:
        assert reader.problems == []
        (meta,) = reader.sql("SELECT status, config FROM runs").to_dict("records")
        by_rank = reader.sql("""SELECT step, rank, count(*) AS n, min(rollout_id) AS first, max(rollout_id) AS last,
                                       count(DISTINCT group_id) AS groups FROM rollouts GROUP BY ALL ORDER BY 1, 2""")
        steps = reader.sql("SELECT step, reward_mean FROM steps ORDER BY step")
        totals = reader.sql("SELECT step, avg(reward) AS reward FROM rollouts GROUP BY step ORDER BY step")
        tokens_by_rank = reader.sql("""SELECT r.rank, count(*) AS n FROM tokens t JOIN rollouts r
                                       USING (step, rollout_id) GROUP BY ALL ORDER BY 1""")
    assert meta["status"] == "finished" and json.loads(meta["config"])["policylens"]["world_size"] == 2
    # each rank logged its half of every generation batch (32 completions: 4 prompts x 8), ids unique across ranks
    assert by_rank[["step", "rank", "n", "first", "last"]].values.tolist() == [
        [1, 0, 16, 0, 15], [1, 1, 16, 16, 31], [2, 0, 16, 0, 15], [2, 1, 16, 16, 31]]
    assert tokens_by_rank["rank"].tolist() == [0, 1] and (tokens_by_rank["n"] > 0).all()
    # rank 0's steps row holds TRL's global metrics: the mean reward over both ranks' rollouts
    assert steps["step"].tolist() == [1, 2]
    np.testing.assert_allclose(steps["reward_mean"], totals["reward"], rtol=1e-5)


# ---------------------------------------------------------------- a byte-level BPE tokenizer


def byte_level_bpe(corpus: list[str]):
    """A byte-level BPE tokenizer (GPT-2 style) trained here on `corpus` with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, min_frequency=2, special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def test_byte_level_tokens_are_shown_readably():
    from engine.rollout import TokenText

    tokenizer = byte_level_bpe(["x = 2 is the answer"] * 20 + ["one arrow: →"])  # '→' too rare to merge
    ids = tokenizer("so x → 2", add_special_tokens=False)["input_ids"]
    texts = [TokenText(tokenizer).token(i) for i in ids]
    raw = tokenizer.convert_ids_to_tokens(ids)
    assert "Ġ" in raw  # the space marker of byte-level BPE ...
    assert "Ġ" not in "".join(texts) and texts[raw.index("Ġ")] == " "  # ... is shown as the space it stands for
    # '→' (3 bytes of UTF-8) is 3 tokens; each alone is partial UTF-8: shown as its byte, not as U+FFFD
    arrow = [t for t in texts if t.startswith("\\x")]
    assert arrow == ["\\xe2", "\\x86", "\\x92"] and "\ufffd" not in "".join(texts)


def test_adapter_with_a_byte_level_bpe_model(tmp_path):
    """A tiny random Llama with a locally trained byte-level BPE: tokens line up with TRL's completions."""
    from engine.policy import build_model
    from engine.tasks import get_task
    from engine.train import model_config

    task = get_task("linear")
    tokenizer = byte_level_bpe([p.prompt + task.solution_text(p) for p in task.train[:400]] + ["é → ü"])
    model_dir = tmp_path / "bpe-model"
    build_model(tokenizer, model_config("tiny")).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    logs_dir, *_ = train_trl(tmp_path, model_dir, run_name="bpe", max_steps=1, steps_per_generation=1,
                             num_iterations=1, tokenizer=tokenizer)
    with RunReader(logs_dir) as reader:
        rollouts = reader.sql("SELECT rollout_id, completion, length FROM rollouts ORDER BY rollout_id")
        tokens = reader.sql("SELECT rollout_id, position, token_id, token_text FROM tokens ORDER BY 1, 2")
        passes = reader.sql("SELECT rollout_id, position FROM token_passes ORDER BY 1, 2")
    assert len(rollouts) == 8
    assert passes.values.tolist() == tokens[["rollout_id", "position"]].values.tolist()
    for r in rollouts.itertuples(index=False):
        mine = tokens[tokens["rollout_id"] == r.rollout_id]
        assert mine["position"].tolist() == list(range(r.length))
        assert tokenizer.decode(mine["token_id"].tolist(), skip_special_tokens=True) == r.completion
    texts = "".join(tokens["token_text"])
    assert "\ufffd" not in texts and "Ġ" not in texts
    assert "\\x" in texts  # the random model wrote partial UTF-8 bytes: shown as bytes


def test_engine_trains_a_model_dir_with_a_byte_level_bpe_tokenizer(tmp_path, run_tiny):
    """`policylens train --model DIR` with the same kind of tokenizer: tokens line up with the completions."""
    from engine.policy import build_model
    from engine.tasks import get_task
    from engine.train import model_config

    task = get_task("linear")
    tokenizer = byte_level_bpe([p.prompt + task.solution_text(p) for p in task.train[:400]] + ["é → ü"])
    model_dir = tmp_path / "bpe-model"
    build_model(tokenizer, model_config("tiny")).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert run_tiny(tmp_path / "logs", "engine-bpe", model=str(model_dir), steps=1, eval_every=0) == "finished"
    with RunReader(tmp_path / "logs") as reader:
        rollouts = reader.sql("SELECT rollout_id, completion, length, truncated FROM rollouts WHERE kind = 'train'")
        tokens = reader.sql("SELECT rollout_id, position, token_id, token_text FROM tokens ORDER BY 1, 2")
    for r in rollouts.itertuples(index=False):
        mine = tokens[tokens["rollout_id"] == r.rollout_id]
        assert mine["position"].tolist() == list(range(r.length))
        assert tokenizer.decode(mine["token_id"].tolist(), skip_special_tokens=True) == r.completion
    assert "\ufffd" not in "".join(tokens["token_text"]) and "Ġ" not in "".join(tokens["token_text"])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "cispo", "sapo"])
def test_the_adapters_surrogates_are_trls_formulas(loss_type):
    """The adapter computes TRL's token losses and clip rules with the engine's surrogates (trl_surrogate); on random
    ratios they are TRL 1.16's lines of `_compute_loss` (restated here), CISPO's absolute bound included."""
    from engine.integrations.trl import clip_codes, token_losses

    g = torch.Generator().manual_seed(5)
    coef_1 = torch.exp(torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.6)
    adv = torch.randn(6, 1, generator=g, dtype=torch.float64)
    adv[0] = 0.0
    eps_low, eps_high = (0.2, 1.5) if loss_type == "cispo" else (0.2, 0.28)
    if loss_type == "cispo":  # per_token_loss = -clamp(coef_1, max=epsilon_high) * A (* log pi: departure 1)
        expected = -torch.clamp(coef_1, max=eps_high) * adv
        low, high, dual = torch.zeros_like(coef_1, dtype=torch.bool), torch.zeros_like(coef_1, dtype=torch.bool), (
            coef_1 > eps_high) & (adv > 0)  # is_cispo_clipped
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, 1.0, 1.05).to(torch.float64)
        expected = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
        gate = torch.sigmoid(tau * (coef_1 - 1))
        low = high = torch.zeros_like(coef_1, dtype=torch.bool)
        dual = (4 * gate * (1 - gate) < 0.5) & (adv != 0)  # the engine's soft-cap rule (TRL logs none)
    else:
        expected = -torch.min(coef_1 * adv, torch.clamp(coef_1, 1 - eps_low, 1 + eps_high) * adv)
        low, high = (coef_1 < 1 - eps_low) & (adv < 0), (coef_1 > 1 + eps_high) & (adv > 0)
        dual = torch.zeros_like(low)
    torch.testing.assert_close(token_losses(loss_type, coef_1, adv, eps_low, eps_high), expected.expand(6, 9))
    codes = clip_codes(loss_type, coef_1, adv, eps_low, eps_high)
    assert torch.equal(codes == 1, low) and torch.equal(codes == 2, high) and torch.equal(codes == 3, dual)
    assert bool((codes > 0).any()) or loss_type == "sapo"


def test_trls_sampler_log_probs_is_ratio_and_masks_are_logged_per_token(tmp_path, warm_model_dir, monkeypatch):
    """TRL's vLLM path without vLLM: each generation's output gains what TRL's vLLM branch puts there,
    `sampling_per_token_logps` (here the old log-probs plus noise) and `importance_sampling_ratio` (token_mask mode
    with C_max 1.5, TRL's formula: engine.corrections.trl_is_ratio, equal to it in test_corrections_reference.py),
    and the off-policy mask is on. The run log holds them as sampler_logp, is_weight and rejected (the off-policy
    mask as TRL's own get_off_policy_mask decides it on the logged log-probs, pass by pass), and the step's
    mismatch metrics."""
    from trl import GRPOTrainer

    from engine.correction_settings import REJECT_IS_ZERO, REJECT_OFF_POLICY
    from engine.corrections import offpolicy_metrics, trl_is_ratio

    fed = []
    original = GRPOTrainer._generate_and_score_completions

    def as_with_vllm(self, inputs):
        output = original(self, inputs)
        old, mask = output["old_per_token_logps"], output["completion_mask"]
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(len(fed)))
        sampler = old + 0.3 * noise
        sampler[0, 0] = float("nan")  # a token vLLM could not score: TRL keeps NaN, its ratio is 1
        output["sampling_per_token_logps"] = sampler
        output["importance_sampling_ratio"] = ratio = trl_is_ratio(old - sampler, mask, "token_mask", None, 1.5)
        fed.append({"old": old.detach().clone(), "sampler": sampler.clone(), "ratio": ratio.clone(), "mask": mask})
        return output

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", as_with_vllm)
    threshold = 0.05
    logs_dir, *_ = train_trl(tmp_path, warm_model_dir, max_steps=4, off_policy_mask_threshold=threshold)
    ((batch,),) = [fed]  # one generation: 2 mini-batches x 2 passes
    tokens = frame(logs_dir, "SELECT * FROM tokens WHERE step = 1 ORDER BY rollout_id, position")
    rows, positions = tokens["rollout_id"].to_numpy(), tokens["position"].to_numpy()
    np.testing.assert_allclose(tokens["sampler_logp"], batch["sampler"][rows, positions].numpy(), rtol=1e-6)
    assert np.isnan(tokens["sampler_logp"].iloc[0])  # rollout 0, position 0: kept NaN, as TRL has it

    passes = frame(logs_dir, "SELECT p.*, r.advantage AS seq_advantage FROM token_passes p JOIN rollouts r "
                             "USING (run, step, rollout_id) WHERE step = 1 ORDER BY pass, rollout_id, position")
    rows, positions = passes["rollout_id"].to_numpy(), passes["position"].to_numpy()
    ratio = batch["ratio"][rows, positions].numpy()
    np.testing.assert_allclose(passes["is_weight"], ratio, rtol=1e-6)
    expected = np.where(ratio == 0, REJECT_IS_ZERO, 0)
    for _, part in passes.groupby("pass"):
        ids = sorted(part["rollout_id"].unique())
        new = torch.zeros(len(ids), batch["mask"].shape[1], dtype=torch.float64)
        new[np.searchsorted(ids, part["rollout_id"]), part["position"].to_numpy()] = torch.tensor(
            part["new_logp"].to_numpy())
        advantages = torch.tensor(part.groupby("rollout_id")["seq_advantage"].first().to_numpy())[:, None]
        kept = GRPOTrainer.get_off_policy_mask(advantages, new, batch["sampler"][ids].double(),
                                               batch["mask"][ids].double(), threshold)  # (b, 1)
        dropped = (kept[np.searchsorted(ids, part["rollout_id"]), 0] == 0).numpy()
        expected[part.index[dropped]] = REJECT_OFF_POLICY
    assert set(expected) == {0, REJECT_IS_ZERO, REJECT_OFF_POLICY}, "the noise should trigger both"
    np.testing.assert_array_equal(passes["rejected"].to_numpy(), expected)

    (extra,) = frame(logs_dir, "SELECT extra FROM steps WHERE step = 1")["extra"]
    logged = {k[len("mismatch_"):]: v for k, v in json.loads(extra).items() if k.startswith("mismatch_")}
    scored = batch["mask"].bool() & torch.isfinite(batch["sampler"])  # the NaN token left out
    assert logged == pytest.approx(offpolicy_metrics(batch["old"], batch["sampler"], scored), rel=1e-5)
