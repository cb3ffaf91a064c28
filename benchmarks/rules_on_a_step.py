"""How each registry rule would weigh the tokens of one logged step, against GRPO (docs/algorithms.md).

    python benchmarks/rules_on_a_step.py --logs-dir logs --run my-run [--step N] [--pass P]

For the chosen step and pass (default: the last), every algorithm without a critic is asked (policy_loss) what it
would do with the logged log-probs and advantages, without the KL term (beta 0), so that only the policy rules are
compared. A token is "weighed differently from GRPO" when its multiplier, the gradient weight divided by the plain
policy-gradient weight A * a (a the rule's own aggregation weight, so that a different normaliser alone does not
count), differs from GRPO's by more than 1%. Also: the share of GRPO's total |gradient weight| carried by the top 1%
of the step's tokens by Cui et al.'s covariance (A - mean A)(log pi - mean log pi).
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.algorithms import ALGORITHMS, uses_critic
from engine.logrows import batch_from_tokens
from engine.objectives import aggregation_weights, policy_loss, token_covariance
from engine.runlog import RunReader

RELATIVE = 0.01  # a multiplier more than 1% away from GRPO's
TOP_SHARE = 0.01  # the top 1% of tokens by covariance


def step_tokens(logs_dir: str, run: str, step: int | None, pass_: int | None):
    """The tokens of one step joined with one pass's new log-probs (the last step / pass by default)."""
    with RunReader(logs_dir) as reader:
        if step is None:
            step = int(reader.sql("SELECT max(step) AS s FROM token_passes WHERE run = ?", [run])["s"][0])
        if pass_ is None:
            pass_ = int(reader.sql('SELECT max("pass") AS p FROM token_passes WHERE run = ? AND step = ?',
                                   [run, step])["p"][0])
        rows = reader.sql("""SELECT t.rollout_id, t.position, t.old_logp, t.advantage, t.ref_logp, t.entropy,
                                    p.new_logp
                             FROM tokens t JOIN token_passes p USING (run, step, rollout_id, position)
                             WHERE t.run = ? AND t.step = ? AND p."pass" = ?""", [run, step, pass_])
    return rows, step, pass_


def multiplier(out, mask, adv) -> torch.Tensor:
    """grad_weight / (A * a): the rule's factor on a token's plain policy-gradient weight (NaN where A = 0)."""
    a = aggregation_weights(mask, out.params["aggregation"], out.params["max_len"])
    plain = adv * a  # (B, T)
    return torch.where(plain != 0, out.grad_weight / plain, torch.full_like(plain, float("nan")))


def compare(rows) -> tuple[dict[str, tuple[int, int]], float]:
    """algorithm -> (tokens weighed differently from GRPO, tokens compared); top-1% covariance share of GRPO."""
    batch = batch_from_tokens(rows)
    mask = batch.mask
    adv = batch.advantages[:, None].expand_as(mask) if batch.advantages.dim() == 1 else batch.advantages
    adv = adv * mask
    kw = {"entropy": batch.entropy, "generator": torch.Generator().manual_seed(0)}
    grpo = policy_loss("grpo", batch.logp, batch.old_logp, batch.advantages, mask, beta=0.0, **kw)
    base = multiplier(grpo, mask, adv)
    compared = (mask > 0) & torch.isfinite(base)
    counts = {}
    for algo in ALGORITHMS:
        if uses_critic(algo):
            continue
        kw["generator"] = torch.Generator().manual_seed(0)
        out = policy_loss(algo, batch.logp, batch.old_logp, batch.advantages, mask, beta=0.0, **kw)
        factor = multiplier(out, mask, adv)
        differs = (factor - base).abs() > RELATIVE * torch.maximum(base.abs(), factor.abs()).clamp(min=1e-12)
        counts[algo] = (int((differs & compared).sum()), int(compared.sum()))
    cov = token_covariance(adv, batch.logp, mask)[mask > 0]
    weight = grpo.grad_weight[mask > 0].abs()
    top = torch.topk(cov, max(1, int(TOP_SHARE * cov.numel()))).indices
    return counts, float(weight[top].sum() / weight.sum().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs-dir", default="logs")
    parser.add_argument("--run", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--pass", dest="pass_", type=int, default=None)
    args = parser.parse_args(argv)
    rows, step, pass_ = step_tokens(args.logs_dir, args.run, args.step, args.pass_)
    if rows.empty:
        print(f"run {args.run!r} has no token passes at step {step}, pass {pass_}", file=sys.stderr)
        return 1
    counts, top_share = compare(rows)
    print(f"run {args.run}, step {step}, pass {pass_}: {len(rows)} tokens")
    print("| rule | tokens weighed differently from GRPO |\n|---|---|")
    for algo, (n, of) in counts.items():
        print(f"| {algo} | {n} of {of} ({n / max(1, of):.1%}) |")
    print(f"\nshare of GRPO's total |gradient weight| on the top {TOP_SHARE:.0%} covariance tokens: {top_share:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
