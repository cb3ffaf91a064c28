"""Groups' completions: a page of groups drawn by one small component of the page from plain data.

Why not Streamlit elements: a page of 64 completions was about 260 of them (each completion's header, text, the note
that it is cut and its link to the Token inspector, in rows of columns, in a bordered box a group), which the browser
laid out again at every rerun of the page: about a second on two cores (docs/benchmarks.md, "Groups' completions
drawn from data"). Here the page sends every line as plain strings (`group_cards`) and `group_view.js` builds the
boxes, the strings as text nodes: nothing logged is ever parsed as markup. A completion's "tokens" link is a real
link to the Token inspector (a new tab opens it there); a plain click switches page in the same session instead.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from dashboard import common, data

_draw = st.components.v2.component(
    "policylens_groups", js=(Path(__file__).parent / "group_view.js").read_text(),
    css=(Path(__file__).parent / "group_view.css").read_text(), isolate_styles=False)
# isolate_styles=False: the text is in the page's document, where the browser's find (Ctrl+F) and its copy reach.

TOKEN_INSPECTOR_PATH = "tokens"
"""The Token inspector's address next to this page's (dashboard/streamlit_app.py names the pages' paths)."""


def _line(*pieces) -> list[list]:
    """A line of text as [text, bold] pieces; strings are plain, (text,) tuples bold."""
    return [[piece[0], 1] if isinstance(piece, tuple) else [piece, 0] for piece in pieces if piece != ""]


def group_cards(groups: pd.DataFrame, rollouts: pd.DataFrame, run: str, step: int) -> list[dict]:
    """What the component draws for `groups` (rows of `queries.group_summary`, in the order shown) and their
    completions (`rollouts`: `queries.step_rollout_previews`): by group a header line, its prompt and answer, and by
    completion a header line (index, advantage, length, truncated / filtered marks), its reward and parts, its text
    (a preview), the note that the text is cut, and the address of its tokens."""
    cards = []
    for group in groups.itertuples(index=False):
        dropped = ((" · ", ("dropped",), f" ({common.plain(group.filter_reason)})")
                   if common.flag(group.filtered) else ())
        members = []
        for r in data.group_members(rollouts, group.group_id).itertuples(index=False):
            flags = [f for f, on in (("✂ truncated", r.truncated), ("⊘ filtered", r.filtered)) if common.flag(on)]
            cut = pd.notna(r.completion_chars) and r.completion_chars > len(r.completion)
            rollout = None if pd.isna(r.rollout_id) else int(r.rollout_id)  # without it, no tokens can be found
            members.append({
                "head": _line((f"#{common.plain(r.index_in_group)}",), " · A ", (common.number(r.advantage, "+.3f"),),
                              f" · {common.number(r.length, '.0f')} tok" + (" · " + " ".join(flags) if flags else "")),
                "reward": common.reward_breakdown(r),  # reward function names come from the trainer's code: text
                "text": common.plain(r.completion),
                "note": f"the first {len(r.completion):,} of {r.completion_chars:,} characters" if cut else "",
                "rollout": rollout,
                "link": "" if rollout is None else TOKEN_INSPECTOR_PATH + "?" + urlencode(
                    {"run": run, "step": step, "rollout": rollout}),
            })
        cards.append({
            "head": _line((f"Group {common.plain(group.group_id)}",),
                          f" · {group.outcome} · reward mean {common.number(group.reward_mean, '.3f')}, std "
                          f"{common.number(group.reward_std, '.3f')}", *dropped),
            "prompt": f"{common.plain(group.prompt)}   (answer: {common.plain(group.answer)})",
            "members": members,
        })
    return cards


def show(cards: list[dict], key: str = "group_cards") -> int | None:
    """Draw `cards` (`group_cards`); returns the rollout id whose "tokens" link was clicked to start this rerun,
    else None."""
    # A trigger value (`open`) exists only for the rerun it started; a callback is what registers it.
    result = _draw(data={"groups": cards}, key=key, on_open_change=lambda: None)
    return result.open
