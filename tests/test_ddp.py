"""Tests of data-parallel training (engine.distributed): 2 ranks on CPU with the gloo backend.

- one update on 2 ranks, each with half of a fixed batch, gives the parameters one process gets on the whole batch
  (PPO: its critic's too, and the advantages whitened over the whole batch);
- a 2-rank run logs both ranks' rollouts for every step, with ids unique across ranks, and its step metrics are the
  ones computed from every logged rollout (not rank 0's share);
- killing one rank marks the run crashed, and the run resumes on another number of ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, tiny_config

from engine.distributed import World
from engine.rollout import Batch, Rollout, token_logprobs
from engine.tasks import Problem

B, P, T, RANKS = 8, 4, 10, 2
# Rank 0's half has 29 tokens and width 10, rank 1's 19 tokens and width 9: a rank-local token mean or width is wrong.
LENGTHS = [10, 3, 7, 9, 9, 2, 6, 2]


def _fixed_batch(policy, tokenizer, lengths=LENGTHS) -> Batch:
    """A batch in the layout collect_batch builds (groups of 2), from fixed random tokens and advantages."""
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(4, tokenizer.vocab_size, (B, P + T), generator=gen)
    attention_mask = torch.ones(B, P + T, dtype=torch.long)
    token_mask = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        token_mask[b, :n] = 1.0
        attention_mask[b, P + n :] = 0
        input_ids[b, P + n :] = tokenizer.pad_token_id
    with torch.no_grad():
        old_logp, entropy = token_logprobs(policy, input_ids, attention_mask, P, 1.0)
    seq_adv = torch.randn(B, generator=gen)
    rollouts = [Rollout(problem=Problem(b // 2, "1+1=", "2", ("2",)), group_id=b // 2, index_in_group=b % 2,
                        completion_ids=input_ids[b, P : P + lengths[b]].tolist(), completion="", truncated=False,
                        reward_correct=float(b % 3 == 0), advantage=float(seq_adv[b])) for b in range(B)]
    return Batch(
        rollouts=rollouts, dropped=[], gen_batches=1, input_ids=input_ids, attention_mask=attention_mask,
        prompt_len=P, token_mask=token_mask, loss_mask=token_mask.clone(), old_logp=old_logp * token_mask,
        ref_logp=(old_logp - 0.2 * torch.rand(B, T, generator=gen)) * token_mask, entropy=entropy * token_mask,
        advantages=seq_adv[:, None] * token_mask,
    )


def _rows(batch: Batch, rows: slice) -> Batch:
    """The rows `rows` of a batch: one rank's share."""
    return dataclasses.replace(batch, rollouts=batch.rollouts[rows], **{
        f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)})


# The four aggregations of the policy loss, and PPO: its critic (targets, value loss) and the policy loss on them.
UPDATE_ALGOS = ("dapo", "grpo", "dr_grpo", "gspo", "ppo")
CRITIC_METRICS = ("advantage_mean", "advantage_std", "explained_variance", "value_loss", "value_clip_frac",
                  "critic_grad_norm")


def _one_update(algo: str, world: World | None) -> dict:
    """Build the model (and PPO's critic) and the fixed batch, run one step's update on this rank's rows as
    engine.train does; returns the parameters before and after, the passes' (loss, grad norm) and the critic's."""
    from engine.critic import PPOCritic
    from engine.policy import ModelConfig, build_model, build_tokenizer
    from engine.train import update

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    policy = build_model(tokenizer, ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
                         seed=0).eval()  # eval: no dropout
    batch = _fixed_batch(policy, tokenizer)
    # the critic at the policy's lr (not its default 10x): Adam turns float noise in near-zero gradients into
    # steps of up to lr, which at 1e-2 reach the 1e-5 this test compares at
    cfg = tiny_config(algo=algo, batch_size=B, group_size=2, epochs=2, minibatches=1, lr=1e-3,
                      **({"critic_lr": 1e-3} if algo == "ppo" else {}))
    critic = PPOCritic.build(policy, cfg)  # None but for PPO
    if critic is not None:  # a head that predicts something (it starts at 0): values, GAE and value clip all act
        with torch.no_grad():
            head = critic.model.head.weight
            head.copy_(0.3 * torch.randn(head.shape, generator=torch.Generator().manual_seed(1)))
    models = {"policy": policy, **({"critic": critic.model} if critic else {})}
    start = {f"{m}.{k}": v.detach().clone() for m, model in models.items() for k, v in model.state_dict().items()}
    trained = policy
    if world is not None:
        share = B // world.size
        batch = _rows(batch, slice(world.rank * share, (world.rank + 1) * share))
        trained = torch.nn.parallel.DistributedDataParallel(policy)
    gen = torch.Generator().manual_seed(0)
    out = {"start": start, "critic": {}}
    if critic is not None:
        critic.distribute(world or World(), torch.device("cpu"))
        critic.targets(batch, supervision=cfg.supervision, kl_coef=cfg.kl_coef, gamma=cfg.gae_gamma,
                       lam=cfg.gae_lambda, whiten=cfg.whiten_advantages)
        out["loss_advantages"] = batch.loss_advantages.clone()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    out["records"] = [(r.loss, r.grad_norm) for r in update(trained, optimizer, batch, cfg, gen, world)]
    if critic is not None:
        out["critic"] = critic.update(batch, gen, epochs=cfg.epochs, minibatches=cfg.minibatches,
                                      value_clip=cfg.value_clip, value_coef=cfg.value_coef,
                                      max_grad_norm=cfg.max_grad_norm).metrics()
    out["params"] = {f"{m}.{k}": v.detach().clone() for m, model in models.items()
                     for k, v in model.state_dict().items()}
    return out


def _update_worker(rank: int, folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=RANKS)
    try:
        for algo in UPDATE_ALGOS:  # one pair of processes for every algorithm: starting them is the slow part
            torch.save(_one_update(algo, World(rank=rank, size=RANKS)), f"{folder}/{algo}-rank{rank}.pt")
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_updates(tmp_path_factory) -> Path:
    """The folder where each of 2 ranks saved its `_one_update` of every algorithm of UPDATE_ALGOS."""
    folder = tmp_path_factory.mktemp("ddp-updates")
    with pytest.MonkeyPatch.context() as mp:
        # Spawned processes re-run the parent's __main__ module; after a Streamlit AppTest in the same session that
        # is the dashboard script. A bare __main__ makes them import only this test module.
        mp.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
        torch.multiprocessing.spawn(_update_worker, args=(str(folder),), nprocs=RANKS, join=True)
    return folder


@pytest.mark.slow  # two processes of their own
@pytest.mark.parametrize("algo", UPDATE_ALGOS)
def test_one_update_on_two_ranks_equals_one_process_on_the_whole_batch(two_rank_updates, algo):
    single = _one_update(algo, None)
    ranks = [torch.load(two_rank_updates / f"{algo}-rank{r}.pt") for r in range(RANKS)]
    for model in ("policy", "critic") if algo == "ppo" else ("policy",):
        moved = max(float((single["params"][k] - v).abs().max()) for k, v in single["start"].items()
                    if k.startswith(f"{model}."))
        assert moved > 1e-3, model  # the update did move the parameters, so equality below means something
    for state in ranks:
        for name, value in single["params"].items():
            torch.testing.assert_close(state["params"][name], value, atol=1e-5, rtol=0, msg=name)
    # each rank's loss is its share of the whole batch's loss; the clipped gradient norm is the global one
    for p, (loss, grad_norm) in enumerate(single["records"]):
        assert sum(state["records"][p][0] for state in ranks) == pytest.approx(loss, abs=1e-5)
        for state in ranks:
            assert state["records"][p][1] == pytest.approx(grad_norm, rel=1e-4)
    if algo == "ppo":
        # the advantages the loss used were whitened with the whole batch's statistics, not each rank's
        torch.testing.assert_close(torch.cat([state["loss_advantages"] for state in ranks]),
                                   single["loss_advantages"], atol=1e-5, rtol=0)
        # and the critic's step metrics are the whole batch's on every rank
        for state in ranks:
            for name in CRITIC_METRICS:
                assert state["critic"][name] == pytest.approx(single["critic"][name], rel=1e-4, abs=1e-6), name


# ----------------------------------------------------------------------------- whole runs under torchrun


@pytest.mark.parametrize(("flags", "message"), [
    (["--nproc", "3"], "batch_size must be a multiple of group_size x nproc = 12"),
    (["--nproc", "2", "--batch-size", "8", "--minibatches", "8"], "fewer than the 8 mini-batches"),
    (["--nproc", "0"], "--nproc must be >= 1"),
])
def test_a_batch_that_cannot_be_split_over_the_processes_is_refused_before_anything_starts(tmp_path, capsys, flags,
                                                                                          message):
    from engine.cli import main

    assert main(["train", "--logs-dir", str(tmp_path), "--batch-size", "16", "--group-size", "4", "--run-name", "x",
                 *flags]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _train_command(logs_dir, cache_dir, *args: str) -> list[str]:
    flags = []
    for key, value in TINY.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return [sys.executable, "-m", "engine.cli", "train", "--logs-dir", str(logs_dir), "--cache-dir", str(cache_dir),
            "--no-progress", "--threads", "1", *flags, *args]


def _reader(logs_dir):
    from engine.runlog import RunReader

    return RunReader(logs_dir)


@pytest.mark.slow
def test_a_two_rank_run_logs_both_ranks_and_metrics_of_the_whole_batch(tmp_path, warm_cache):
    done = subprocess.run(_train_command(tmp_path, warm_cache, "--nproc", "2", "--algo", "dapo", "--steps", "2",
                                         "--run-name", "dp"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with _reader(tmp_path) as reader:
        rollouts = reader.sql("SELECT * FROM rollouts WHERE run = 'dp'")
        steps = reader.sql("SELECT * FROM steps WHERE run = 'dp' ORDER BY step").set_index("step")
        tokens = reader.sql("SELECT t.step, t.entropy FROM tokens t JOIN rollouts r USING (run, step, rollout_id) "
                            "WHERE t.run = 'dp' AND r.kind = 'train'")
        passes = reader.sql("SELECT p.step, p.clip FROM token_passes p JOIN rollouts r USING (run, step, rollout_id) "
                            "WHERE p.run = 'dp' AND coalesce(r.filter_reason, '') <> 'overlong'")
    train = rollouts[rollouts["kind"] == "train"]
    assert list(steps.index) == [0, 1, 2]
    for step in (1, 2):
        rows = train[train["step"] == step]
        kept = rows[~rows["filtered"]]
        # both ranks logged their half of the global batch (16 kept completions), in whole groups
        assert sorted(kept.groupby("rank").size().items()) == [(0, 8), (1, 8)]
        assert kept.groupby("group_id")["rank"].nunique().max() == 1
        everything = rollouts[rollouts["step"] == step]
        assert everything["rollout_id"].is_unique and everything[everything.index_in_group == 0]["group_id"].is_unique
        # metrics over every logged rollout of the step, whichever rank sampled it
        m = steps.loc[step]
        assert m["reward_mean"] == pytest.approx(rows["reward"].mean(), abs=1e-9)
        assert m["reward_std"] == pytest.approx(rows["reward"].std(ddof=1), abs=1e-9)
        assert m["accuracy"] == pytest.approx(rows["reward_correct"].mean(), abs=1e-9)
        assert m["response_len_mean"] == pytest.approx(rows["length"].mean(), abs=1e-9)
        assert m["response_len_max"] == rows["length"].max()
        assert m["truncated_frac"] == pytest.approx(rows["truncated"].mean(), abs=1e-9)
        dropped = rows[rows["filter_reason"].isin(["all_correct", "all_wrong", "all_equal"])]
        assert m["groups_filtered"] == dropped.groupby(["rank", "group_id"]).ngroups
        assert m["entropy"] == pytest.approx(tokens[tokens["step"] == step]["entropy"].mean(), rel=1e-6)
        clips = passes[passes["step"] == step]["clip"]
        assert m["clip_high_frac"] == pytest.approx(float((clips == 2).mean()), abs=1e-9)
        assert m["clip_low_frac"] == pytest.approx(float((clips == 1).mean()), abs=1e-9)
    # the held-out evaluation is rank 0's alone, with the one-process numbering after the training rollouts
    evals = rollouts[rollouts["kind"] == "eval"]
    assert set(evals["rank"]) == {0} and set(evals["step"]) == {0, 2}
    assert not np.isnan(steps.loc[2, "heldout_accuracy"])


def _logged_steps(run_dir: Path, rank: int) -> list[int]:
    from engine.runlog import last_steps_by_rank

    last = last_steps_by_rank(run_dir).get(rank)
    return [] if last is None else list(range(1, last + 1))


@pytest.mark.slow
def test_killing_one_rank_marks_the_run_crashed_and_it_resumes_on_another_number_of_ranks(tmp_path, warm_cache):
    # PPO: the run's checkpoints carry its data-parallel critic too, and every rank logs the critic's columns
    from engine.runlog import list_runs

    run_dir = tmp_path / "dp-kill"
    launcher = subprocess.Popen(_train_command(tmp_path, warm_cache, "--nproc", "2", "--algo", "ppo", "--steps",
                                               "200", "--checkpoint-every", "1", "--run-name", "dp-kill"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # generous: the warm start may have to be trained first
        while len(_logged_steps(run_dir, 1)) < 2:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 1 did not log 2 steps in time"
            time.sleep(0.2)
        rank1 = json.loads((run_dir / "writer-rank1.lock").read_text())["pid"]
        os.kill(rank1, signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "crashed", err[-3000:]
    assert next(r for r in list_runs(tmp_path) if r["run"] == "dp-kill")["status"] == "crashed"

    # resume on one process: the steps rank 1 never finished are trained again, the rest of its log stays
    killed_at = max(_logged_steps(run_dir, 1))
    steps = killed_at + 2
    done = subprocess.run(_train_command(tmp_path, warm_cache, "--resume", "dp-kill", "--steps", str(steps)),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    with _reader(tmp_path) as reader:
        train = reader.sql("SELECT step, rank, rollout_id FROM rollouts WHERE run = 'dp-kill' AND kind = 'train' "
                           "AND NOT filtered")
        logged = reader.sql("SELECT step FROM steps WHERE run = 'dp-kill' ORDER BY step")["step"].tolist()
    assert logged == list(range(steps + 1))
    per_step = train.groupby("step")
    assert (per_step.size() == 16).all()  # the global batch at every step, never a duplicate
    assert not train.duplicated(["step", "rollout_id"]).any()
    ranks = per_step["rank"].agg(lambda r: tuple(sorted(set(r))))
    two = [s for s, r in ranks.items() if r == (0, 1)]
    assert two == list(range(1, two[-1] + 1)) and two[-1] <= killed_at
    assert all(r == (0,) for s, r in ranks.items() if s > two[-1])

    # and back on two processes: rank 1 joins with streams of its own
    done = subprocess.run(_train_command(tmp_path, warm_cache, "--resume", "dp-kill", "--nproc", "2", "--steps",
                                         str(steps + 1)), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    with _reader(tmp_path) as reader:
        last = reader.sql("SELECT rank, count(*) AS n FROM rollouts WHERE run = 'dp-kill' AND step = ? "
                          "AND kind = 'train' AND NOT filtered GROUP BY rank ORDER BY rank", [steps + 1])
    assert last.values.tolist() == [[0, 8], [1, 8]]
    with _reader(tmp_path) as reader:
        critic = reader.sql("SELECT r.rank, count(*) AS n, count(t.value) AS values, count(t.return) AS returns "
                            "FROM tokens t JOIN rollouts r USING (run, step, rollout_id) WHERE t.run = 'dp-kill' "
                            "AND r.kind = 'train' GROUP BY r.rank ORDER BY r.rank")
        losses = reader.sql("SELECT value_loss, explained_variance FROM steps WHERE run = 'dp-kill' AND step > 0")
    assert critic["rank"].tolist() == [0, 1] and (critic["values"] == critic["n"]).all()
    assert (critic["returns"] == critic["n"]).all() and losses.notna().all().all()
