"""The token-weighting rules of issue 22 against their reference implementations, on the same random tensors.

References: verl 0.9.1 `verl/trainer/ppo/core_algos.py` (gpg, dppo_tv, dppo_kl, dro, clip_cov, kl_cov, geo_mean),
called as functions (tests/verl_reference.py imports them); TRL 1.16 `trl/trainer/grpo_trainer.py`
(GRPOTrainer.get_gamma_weights and get_high_entropy_mask called; the few lines of `_compute_loss` that turn them
into a loss are restated below with the line they come from, since they are not functions).

What is compared: the gradient wrt the log-probs (autograd through the reference) against `grad_weight` and
against autograd through `policy_loss`, and the loss value. For the score-function rules (GPG, DPPO, DRO, VESPO)
the libraries' value is -w A log pi, ours -w A (objectives departure 1): the test converts ours by adding
sum a * w A (1 - log pi), with w A the coefficient of log pi in the library's token loss. Tolerance 1e-6 (absolute).
`WORST` collects the largest difference of each rule; `pytest tests/test_rules.py -s` prints them at the end (the
figures of docs/algorithms.md).
"""

from __future__ import annotations

import types

import pytest
import torch
from verl_reference import ActorSettings, import_verl

from engine.objectives import policy_loss, top_entropy_mask

torch.set_num_threads(1)
F64 = torch.float64
TOL = 1e-6
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_worst_differences():
    yield
    print("\nworst |difference| per rule (loss value and gradient weight):")
    for rule, worst in sorted(WORST.items()):
        print(f"  {rule}: {worst:.2e}")


def random_batch(seed: int, B: int = 24, T: int = 12):
    """log-probs with per-row log-ratio scales from 1e-3 to 2 (every region of every rule is visited), one
    advantage per sequence (both signs and 0), ragged lengths, garbage-free padding (verl reads every position)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-3, 0.02, 0.1, 0.3, 0.6, 1.0, 1.5, 2.0], dtype=F64).repeat(B // 8 + 1)[:B]
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.02  # log-probs in (-3.02, -0.02): p_old up to 0.98
    logp = (old + torch.randn(B, T, generator=g, dtype=F64) * scales[:, None]).clamp(max=-1e-4)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64).repeat(B)[:B] * (0.2 + 1.5 * torch.rand(B, generator=g, dtype=F64))
    adv[-1] = 0.0
    ent = torch.rand(B, T, generator=g, dtype=torch.float32) * 2
    ref = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    return logp, old, adv[:, None].expand(B, T).clone(), mask, ent, ref


def ours(algo, logp, old, adv, mask, **kw):
    """policy_loss's output and its autograd gradient -dloss/dlogp."""
    x = logp.clone().requires_grad_(True)
    out = policy_loss(algo, x, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(out.loss, x)
    torch.testing.assert_close(out.grad_weight, -g, rtol=0, atol=1e-10)  # closed form == autograd
    return out


def reference(fn, logp):
    """A reference loss `fn(x)` and its -dloss/dlogp by autograd."""
    x = logp.clone().requires_grad_(True)
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), -g


def agree(rule, ours_value, ref_value, ours_weight, ref_weight):
    worst = max(float((ours_value - ref_value).abs()), float((ours_weight - ref_weight).abs().max()))
    WORST[rule] = max(WORST.get(rule, 0.0), worst)
    assert worst <= TOL, f"{rule}: worst difference {worst:.3g}"


def library_value(out, log_coef, logp, mask):
    """Our value in the libraries' -w A log pi form: + sum a * (wA) (1 - log pi), a the token-mean weights."""
    a = mask / mask.sum()
    return out.loss.detach() + (a * log_coef * (1 - logp)).sum()


# ---------------------------------------------------------------- verl 0.9.1 core_algos


@pytest.fixture(scope="module")
def core():
    return import_verl("verl.trainer.ppo.core_algos")


SEEDS = (1, 2, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_is_verls(core, seed):
    logp, old, adv, mask, *_ = random_batch(seed)
    out = ours("gpg", logp, old, adv, mask)
    ref_loss, ref_w = reference(lambda x: core.compute_policy_loss_gpg(
        old, x, adv, mask, "token-mean", ActorSettings())[0], logp)
    agree("gpg", library_value(out, adv * mask, logp, mask), ref_loss, out.grad_weight, ref_w)
    torch.testing.assert_close(out.grad_weight, adv * mask / mask.sum())  # -A log pi: weight A, no ratio


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("algo", "bound"), [("dppo_tv", (0.2, 0.2)), ("dppo_tv", (0.1, 0.3)),
                                             ("dppo_kl", (0.05, 0.05)), ("dppo_kl", (0.02, 0.1))])
def test_dppo_is_verls(core, algo, bound, seed):
    logp, old, adv, mask, *_ = random_batch(seed)
    adv[1::4] = 0.0  # A = 0 rows take verl's negative branch
    out = ours(algo, logp, old, adv, mask, eps_low=bound[0], eps_high=bound[1])
    settings = ActorSettings(clip_ratio=0.2, clip_ratio_low=bound[0], clip_ratio_high=bound[1], clip_ratio_c=3.0)
    fn = core.compute_policy_loss_dppo_tv if algo == "dppo_tv" else core.compute_policy_loss_dppo_kl
    ref_loss, ref_w = reference(lambda x: fn(old, x, adv, mask, "token-mean", settings)[0], logp)
    h = out.grad_weight * mask.sum()  # token-mean: w A per token
    agree(algo, library_value(out, h, logp, mask), ref_loss, out.grad_weight, ref_w)
    on = mask > 0
    # the mask acted (both directions) and the cap at clip_ratio_c = 3, not the fallback 20, acted too
    assert ((out.clip == 1) & on).any() and ((out.clip == 2) & on).any() and ((out.clip == 3) & on).any()
    ratio = torch.exp(logp - old)
    capped = (out.clip == 3) & on
    torch.testing.assert_close(h[capped], 3.0 * adv[capped])
    assert bool((ratio[capped] > 3.0).all())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dro_beta", [1.0, 0.3])
def test_dro_is_verls(core, seed, dro_beta):
    logp, old, adv, mask, _, ref = random_batch(seed)
    out = ours("dro", logp, old, adv, mask, dro_beta=dro_beta, ref_logp=ref, beta=0.04)
    settings = ActorSettings(policy_loss={"dro_beta": dro_beta})
    a = mask / mask.sum()
    # DRO's penalty is its own coefficient on log(pi/pi_old); beta stays the k3 KL weight, added as the engine does
    kl = lambda x: (a * 0.04 * (torch.exp(ref - x) - (ref - x) - 1)).sum()  # noqa: E731
    ref_loss, ref_w = reference(lambda x: core.compute_policy_loss_dro(old, x, adv, mask, "token-mean",
                                                                       settings)[0] + kl(x), logp)
    agree("dro", library_value(out, adv * mask, logp, mask), ref_loss, out.grad_weight, ref_w)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("share", [2e-4, 0.05])
def test_clip_cov_is_verls_given_the_same_permutation(core, seed, share):
    logp, old, adv, mask, *_ = random_batch(seed)
    settings = ActorSettings(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2,
                             policy_loss={"clip_cov_ratio": share, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
    torch.manual_seed(100 + seed)  # verl draws from torch's global generator
    ref_loss, ref_w = reference(lambda x: core.compute_policy_loss_clip_cov(old, x, adv, mask, "token-mean",
                                                                            settings)[0], logp)
    out = ours("clip_cov", logp, old, adv, mask, clip_cov_ratio=share,
               generator=torch.Generator().manual_seed(100 + seed))
    agree("clip_cov", out.loss.detach(), ref_loss, out.grad_weight, ref_w)
    # the rule really zeroed unclipped tokens' gradients (compared with plain PPO-clip on the same batch)
    plain = ours("dapo", logp, old, adv, mask, eps_high=0.2)
    zeroed = (plain.grad_weight != 0) & (out.grad_weight == 0)
    expected = max(int(share * mask.sum().item()), 1)
    assert 1 <= int(zeroed.sum()) <= expected
    # the selected tokens carry code 4 ("cov"): every zeroed one, and no more than the share
    assert bool((out.clip[zeroed] == 4).all()) and int((out.clip == 4).sum()) <= expected
    if share == 0.05:
        assert int(zeroed.sum()) > 1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("share", [2e-4, 0.05])
def test_kl_cov_is_verls(core, seed, share):
    logp, old, adv, mask, *_ = random_batch(seed)
    settings = ActorSettings(policy_loss={"kl_cov_ratio": share, "ppo_kl_coef": 0.1})
    ref_loss, ref_w = reference(lambda x: core.compute_policy_loss_kl_cov(old, x, adv, mask, "token-mean",
                                                                          settings)[0], logp)
    out = ours("kl_cov", logp, old, adv, mask, kl_cov_ratio=share)
    agree("kl_cov", out.loss.detach(), ref_loss, out.grad_weight, ref_w)
    penalised = (out.grad_weight - adv * torch.exp(logp - old) * mask / mask.sum()).abs() > 1e-12
    assert int(penalised.sum()) == max(1, int(share * mask.sum().item()))
    assert torch.equal(out.clip == 4, penalised)  # code 4 ("cov") marks exactly the penalised tokens


@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo_is_verls_geo_mean(core, seed):
    logp, old, adv, mask, *_ = random_batch(seed)
    settings = ActorSettings(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4)
    ref_loss, ref_w = reference(lambda x: core.compute_policy_loss_geo_mean(old, x, adv, mask, "token-mean",
                                                                            settings)[0], logp)
    out = ours("gmpo", logp, old, adv, mask)
    agree("gmpo", out.loss.detach(), ref_loss, out.grad_weight, ref_w)


# ---------------------------------------------------------------- TRL 1.16 GRPOTrainer


@pytest.fixture(scope="module")
def trl_trainer():
    from trl import GRPOTrainer

    return GRPOTrainer


@pytest.mark.parametrize("seed", SEEDS)
def test_vespo_is_trls(trl_trainer, seed):
    logp, old, adv, mask, *_ = random_batch(seed)
    A = adv[:, :1]  # (B, 1) as TRL holds it

    def trl_vespo(x):
        phi = trl_trainer.get_gamma_weights(advantages=A, log_ratio_per_token=x - old, mask=mask,
                                            importance_sampling_ratio=None)  # TRL's defaults 2, 3, 3, 2
        per_token_loss = -phi * A * x  # grpo_trainer.py, _compute_loss, loss_type == "vespo"
        return (per_token_loss * mask).sum() / mask.sum()  # normalised like "dapo": by the batch's tokens

    ref_loss, ref_w = reference(trl_vespo, logp)
    out = ours("vespo", logp, old, adv, mask)
    h = out.grad_weight * mask.sum()
    agree("vespo", library_value(out, h, logp, mask), ref_loss, out.grad_weight, ref_w)
    # w is the product of the token ratios (the SUM of log ratios), clamped
    w = torch.exp(((logp - old) * mask).sum(-1).clamp(max=20.0))
    on = mask > 0
    torch.testing.assert_close(out.seq_ratio, w.clamp(min=1e-8))
    assert ((out.clip == 3) & on).any() and ((out.clip == 0) & on & (adv != 0)).any()


@pytest.mark.parametrize("seed", SEEDS)
def test_luspo_is_trls(seed):
    logp, old, adv, mask, *_ = random_batch(seed, B=32)
    logp = old + (logp - old) * 5e-3  # GSPO's band is 3e-4 / 4e-4 on the mean log ratio: both sides visited
    A = adv[:, :1]

    def trl_luspo(x):  # grpo_trainer.py, _compute_loss: importance_sampling_level="sequence", loss_type "luspo"
        coef_1 = torch.exp((((x - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1))
        coef_2 = torch.clamp(coef_1, 1 - 3e-4, 1 + 4e-4)
        per_token_loss = -torch.min(coef_1 * A, coef_2 * A)
        return (per_token_loss * mask).sum(-1).mean()

    ref_loss, ref_w = reference(trl_luspo, logp)
    out = ours("luspo", logp, old, adv, mask)
    agree("luspo", out.loss.detach(), ref_loss, out.grad_weight, ref_w)
    codes = set(out.clip[mask > 0].tolist())
    assert {0, 1, 2} <= codes


class _OneProcess:
    """The accelerator calls get_high_entropy_mask makes, for a single process."""

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x

    @staticmethod
    def gather(x):
        return x


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("algo", "loss_type", "q"), [("grpo", "grpo", 0.2), ("dapo", "bnpo", 0.5),
                                                      ("grpo", "grpo", 0.8)])
def test_top_entropy_quantile_is_trls(trl_trainer, seed, algo, loss_type, q):
    logp, old, adv, mask, ent, ref = random_batch(seed)
    fake = types.SimpleNamespace(accelerator=_OneProcess())
    trl_mask = trl_trainer.get_high_entropy_mask(fake, ent, mask, 1 - q)  # q is the share KEPT
    torch.testing.assert_close(top_entropy_mask(ent, mask, q), trl_mask, rtol=0, atol=0)
    A = adv[:, :1]

    def trl_loss(x):  # grpo_trainer.py, _compute_loss: clip, entropy mask on the policy term, then + beta * KL
        coef_1 = torch.exp(x - old)
        per_token_loss = -torch.min(coef_1 * A, torch.clamp(coef_1, 0.8, 1.2) * A) * trl_mask
        per_token_loss = per_token_loss + 0.04 * (torch.exp(ref - x) - (ref - x) - 1)
        if loss_type == "grpo":
            return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # bnpo: the local batch's tokens

    ref_loss, ref_w = reference(trl_loss, logp)
    out = ours(algo, logp, old, adv, mask, entropy=ent, ref_logp=ref, beta=0.04, eps_high=0.2,
               top_entropy_quantile=q)
    agree("top_entropy_quantile", out.loss.detach(), ref_loss, out.grad_weight, ref_w)
    kept = int(trl_mask.sum())
    assert 0 < kept < int(mask.sum())


def test_top_entropy_quantile_needs_entropy():
    logp, old, adv, mask, *_ = random_batch(0)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss("grpo", logp, old, adv, mask, top_entropy_quantile=0.2)


def test_docs_table_is_the_registrys():
    from pathlib import Path

    from engine.algorithms import defaults_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    table = text.split("<!-- defaults-table -->")[1].split("<!-- /defaults-table -->")[0].strip()
    assert table == defaults_table()
