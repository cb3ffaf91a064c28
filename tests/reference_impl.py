"""An independent, deliberately plain implementation of the published objectives, for tests only.

Written from the papers' formulas (and, for ASPO and GMPO, the structure of the official code), one token at a time
with Python loops and scalar tensors, sharing no code with engine/objectives.py. The loss is built with autograd
so its gradient is autograd's, not a closed form. tests/test_objectives.py compares policy_loss against it.

`value` picks how CISPO's loss and ASPO's soft dual clip are written:
- "paper": as published, -sg(w) * A * log pi (the value depends on the absolute log-prob);
- "ratio": -sg(w) * A * r / sg(r), PolicyLens's convention (value -w * A). Both have the same gradient.
"""

from __future__ import annotations

import torch

# The author defaults, typed again from the papers (not imported from the engine).
PUBLISHED = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.04, "aggregation": "seq-mean-token-mean"},
    "dapo": {"eps_low": 0.2, "eps_high": 0.28, "beta": 0.0, "aggregation": "token-mean"},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0, "aggregation": "seq-mean"},
    "gspo_token": {"eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0, "aggregation": "seq-mean-token-mean"},
    "aspo": {
        "eps_low": 0.2,
        "eps_high": 0.2,
        "beta": 0.001,
        "aggregation": "token-mean",
        "dual_clip": 3.0,
        "eps_high_entropy": 0.4,
        "entropy_quantile": 0.8,
    },
    "dr_grpo": {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "aggregation": "seq-mean-token-sum-norm"},
    "cispo": {"eps_low": 1.0, "eps_high": 0.28, "beta": 0.0, "aggregation": "token-mean"},
    "sapo": {"beta": 0.0, "aggregation": "seq-mean-token-mean", "tau_pos": 1.0, "tau_neg": 1.05},
    "gmpo": {"eps_low": 0.4, "eps_high": 0.4, "beta": 0.0, "aggregation": "seq-mean"},
    # Ziegler et al. 2019 / the N-implementation-details write-up: clip 0.2, whole-batch token mean, KL in the reward
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "aggregation": "token-mean"},
}


def _clip(x, lo, hi):
    return torch.clamp(x, min=lo, max=hi)


def _token_losses(algo, lp, olp, A, eps_n, eps_p, p, value):
    """Loss of one token (scalar tensors). eps_n / eps_p: the clip ranges for A < 0 / A > 0 of this token."""
    r = torch.exp(lp - olp)
    if algo in ("grpo", "dapo", "dr_grpo", "ppo"):
        # PPO / GRPO eq. 3: min(r A, clip(r, 1 - eps, 1 + eps) A)
        return -torch.minimum(r * A, _clip(r, 1 - p["eps_low"], 1 + p["eps_high"]) * A)
    if algo == "cispo":
        # MiniMax-M1 Sec. 3.1: sg(clip(r)) * A * log pi
        w = _clip(r, 1 - p["eps_low"], 1 + p["eps_high"]).detach()
        return -w * A * (lp if value == "paper" else r / r.detach())
    if algo == "sapo":
        tau = p["tau_pos"] if A > 0 else p["tau_neg"]
        return -A * torch.sigmoid(tau * (r - 1)) * 4 / tau
    if algo == "aspo":
        c = p["dual_clip"]
        carrier = lp if value == "paper" else r / r.detach()
        if A < 0:
            clipped = torch.clamp(r, min=1 - eps_n)
            if clipped.item() > c:
                return -A * c * carrier
            return -A * clipped
        clipped = torch.clamp(r, max=1 + eps_p)
        if 1 / clipped.item() > c:
            return -A * c * carrier
        return -A * clipped / clipped.detach() / clipped.detach()
    raise AssertionError(algo)


def reference_loss(
    algo,
    logp,
    old_logp,
    advantages,
    mask,
    ref_logp=None,
    entropy=None,
    value="ratio",
    **overrides,
):
    """Loss of `algo` written plainly; advantages (B,) one per sequence. Differentiable wrt logp."""
    p = {**PUBLISHED[algo], "max_len": None, **overrides}
    B, T = logp.shape
    lengths = [int(mask[i].sum().item()) for i in range(B)]
    valid = [[t for t in range(T) if mask[i, t] > 0] for i in range(B)]

    # token_loss[i] is a list of per-token losses (the sequence loss repeated for sequence-level objectives)
    token_loss = []
    for i in range(B):
        A = float(advantages[i])
        losses = []
        if algo == "gspo":
            # GSPO Sec. 4.1: s_i = (prod_t r_t)^(1/|o_i|), min(s A, clip(s) A) once per sequence
            s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in valid[i]) / max(lengths[i], 1))
            seq = -torch.minimum(s * A, _clip(s, 1 - p["eps_low"], 1 + p["eps_high"]) * A)
            losses = [seq for _ in valid[i]]
        elif algo == "gspo_token":
            # GSPO-token, Sec. 4.3: s_it = sg(s_i) * pi_t / sg(pi_t)
            s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in valid[i]) / max(lengths[i], 1)).detach()
            for t in valid[i]:
                s_t = s * torch.exp(logp[i, t] - logp[i, t].detach())
                losses.append(-torch.minimum(s_t * A, _clip(s_t, 1 - p["eps_low"], 1 + p["eps_high"]) * A))
        elif algo == "gmpo":
            # official GMPO code: sign-aware clip of each token's log ratio, then the geometric mean
            sgn = -1.0 if A >= 0 else 1.0
            bound = p["eps_high"] if A >= 0 else p["eps_low"]
            total = 0.0
            for t in valid[i]:
                diff = sgn * (logp[i, t] - old_logp[i, t])
                total = total + sgn * torch.maximum(diff, torch.clamp(diff, min=-bound))
            ratio = torch.exp(total / max(lengths[i], 1))
            losses = [-A * ratio for _ in valid[i]]
        else:
            high_entropy = set()
            if algo == "aspo" and entropy is not None and valid[i]:
                ents = torch.stack([entropy[i, t] for t in valid[i]])
                q = torch.quantile(ents, p["entropy_quantile"]).item()
                high_entropy = {t for t in valid[i] if entropy[i, t].item() > q}
            for t in valid[i]:
                eps_n = p.get("eps_high_entropy") if t in high_entropy else p.get("eps_low")
                eps_p = p.get("eps_high_entropy") if t in high_entropy else p.get("eps_high")
                losses.append(_token_losses(algo, logp[i, t], old_logp[i, t], A, eps_n, eps_p, p, value))
        if ref_logp is not None and p["beta"] > 0:
            for k, t in enumerate(valid[i]):
                x = ref_logp[i, t] - logp[i, t]
                losses[k] = losses[k] + p["beta"] * (torch.exp(x) - x - 1)
        token_loss.append(losses)

    agg = p["aggregation"]
    zero = logp.sum() * 0.0
    if agg in ("seq-mean-token-mean", "seq-mean"):
        return sum((sum(ls, zero) / max(len(ls), 1) for ls in token_loss), zero) / B
    if agg == "token-mean":
        return sum((sum(ls, zero) for ls in token_loss), zero) / max(sum(lengths), 1)
    if agg == "seq-mean-token-sum-norm":
        return sum((sum(ls, zero) for ls in token_loss), zero) / (B * (p["max_len"] or T))
    if agg == "seq-mean-token-sum":  # LUSPO: each sequence's token sum, mean over all sequences
        return sum((sum(ls, zero) for ls in token_loss), zero) / B
    raise AssertionError(agg)


def reference_grad_weight(algo, logp, old_logp, advantages, mask, **kw):
    """(loss, -dloss/dlogp) of the reference implementation, by autograd."""
    x = logp.detach().clone().requires_grad_(True)
    loss = reference_loss(algo, x, old_logp, advantages, mask, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), -g


__all__ = ["PUBLISHED", "reference_grad_weight", "reference_loss"]
