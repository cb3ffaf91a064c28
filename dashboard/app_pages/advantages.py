"""Advantages: which tokens each scheme blames, for the same completions of one group.

PPO spreads the reward over the tokens with a critic and GAE (and pays a KL on every token); GRPO gives every
token of a completion its group-relative outcome advantage, or, with process supervision, a staircase of normalized
step rewards. The GRPO schemes are recomputed from the logged rewards (dashboard.recompute.advantage_schemes, via
engine.advantages); the PPO ones are the logged values of a run with a critic.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import advantage_charts, common, figures, queries, recompute

selection = common.require_selection()
logs, run, step = selection.logs_dir, selection.run, selection.step
st.header("Advantages")
st.caption("One group, one panel per scheme, on the same token axis. Dotted lines: where each reasoning step of "
           "the highlighted completion starts; red: steps its verifier scored as wrong.")

summary, rollouts = common.train_groups(selection)
c1, c2 = st.columns(2)
group_id = common.group_picker(c1, summary, "adv_group")
if group_id is None:
    st.stop()
common.set_url_value("group", group_id)
group = rollouts[(rollouts["group_id"] == group_id) & (rollouts["length"] != 0).fillna(True)].sort_values("rollout_id")
if group.empty:
    st.info("Every completion of this group is empty.")
    st.stop()
rollout_ids = tuple(int(r) for r in group["rollout_id"])
labels = {int(r.rollout_id): f"#{common.plain(r.index_in_group)} reward {common.number(r.reward, '.3g')}"
          for r in group.itertuples(index=False)}
steps = common.load("the PRM steps", queries.prm_steps, logs, run, step, rollout_ids)
# The group's tokens in bins of positions (one token each for completions up to SCREEN_BINS tokens).
token_bins = common.load("the tokens", queries.critic_token_bins, logs, run, step, rollout_ids, common.SCREEN_BINS)
if token_bins.empty:
    st.info("No tokens were logged for this group (per-token logging was off).")
    st.stop()

# The default highlight: a completion with a wrong step, where the schemes disagree most.
wrong = steps[steps["reward_raw"] < 0]["rollout_id"]
highlight, _ = common.initial_value("adv_rollout", "rollout", int, list(rollout_ids),
                                    int(wrong.iloc[0]) if len(wrong) else rollout_ids[0])
st.session_state["adv_rollout"] = highlight
highlight = c2.selectbox("Highlight completion", list(rollout_ids), key="adv_rollout", format_func=labels.get)
common.set_url_value("rollout", highlight)

scale_by_std = bool(selection.config.get("scale_adv_by_std", True))
try:
    schemes = recompute.advantage_schemes(group, token_bins, steps, scale_by_std=scale_by_std)
except ValueError as error:
    st.error(f"engine.advantages refused this group's logged rewards: {common.md(error)}")
    st.stop()
unrewarded = int(pd.to_numeric(group["reward"], errors="coerce").isna().sum())
if schemes.empty:
    st.info(f"Nothing to compare: {unrewarded} of this group's {len(group)} completions have no logged reward "
            "and their tokens no logged advantage.")
    st.stop()

own_steps = steps[steps["rollout_id"] == highlight]
# The highlighted completion's token texts, for the hover of one-token bins only.
own_tokens = (common.load("the tokens", queries.critic_tokens, logs, run, step, (highlight,))
              if int(token_bins["width"].iloc[0]) == 1 else None)
figures.show(st, advantage_charts.advantage_schemes(schemes, list(recompute.SCHEMES), labels, highlight, own_steps,
                                                    own_tokens), key="advantage_schemes")

has_critic = (schemes["scheme"] == "ppo_gae").any()
notes = []
if unrewarded:
    notes.append(f"{unrewarded} of this group's {len(group)} completions have no logged reward (an import of a "
                 "dump that holds none, such as prime-rl's token exports), so GRPO's outcome advantage is not "
                 "recomputed" + ("; the last panel is the advantage the trainer logged per token."
                                 if (schemes["scheme"] == "logged_advantage").any() else "."))
if not has_critic:
    notes.append(f"{common.md(run)} has no critic, so there is no GAE advantage, value or KL reward to show: "
                 "train `--algo ppo` on the same task to compare.")
if steps.empty:
    notes.append("No reasoning steps were logged for this group, so there is no process scheme.")
if has_critic:
    notes.append("The PPO loss used the GAE advantage whitened over the whole batch ((A − advantage_mean) / "
                 "advantage_std, both in the `steps` table): the same shape, shifted and scaled.")
for note in notes:
    st.caption(note)

st.markdown("**The highlighted completion's reasoning steps**")
if own_steps.empty:
    st.caption("None logged.")
else:
    st.dataframe(pd.DataFrame({"step": own_steps["step_index"], "first token": own_steps["first_pos"],
                               "last token": own_steps["last_pos"], "text": own_steps["text"].astype(str),
                               "verifier score": own_steps["reward_raw"]}),
                 hide_index=True, key="adv_steps")
