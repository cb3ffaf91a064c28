"""The Token inspector's text: a completion's tokens drawn by a small component of the page from plain data.

Why not `st.html`: a window of 512 tokens is 230 kB of markup (a style and a hover text per token), which the page
sanitizes (DOMPurify, inside `st.html`) and parses at every move of the window; most of a move's time in the browser
went there (docs/benchmarks.md, "The Token inspector's text drawn from data"). Here the page receives each token's
text, colour and marks as lists (`dashboard.tokens.token_spans`) and `token_spans.js` builds the spans itself, the
text as text nodes: nothing logged is ever parsed as markup. The colour legend stays a small `st.html` shared with
the report (`dashboard.tokens.colour_legend_html`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard.tokens import CHANNELS, TOKEN_STYLE, TOKENS_STYLE, colour_legend_html, token_spans

_HERE = Path(__file__).parent
_draw = st.components.v2.component(  # the span drawing shared with the report, then the component around it
    "policylens_tokens", js=(_HERE / "token_spans.js").read_text() + (_HERE / "token_view.js").read_text(),
    isolate_styles=False)
# isolate_styles=False: the spans are in the page's document, where the browser's find (Ctrl+F) and its copy reach.


def show(tokens: pd.DataFrame, channel_name: str, key: str = "token_text") -> None:
    """Draw `tokens` (one row per completion token in order, as `dashboard.tokens.token_spans` takes them)
    coloured by a channel, then the colour legend. The same `key` across reruns updates the same block."""
    drawn = token_spans(tokens, channel_name)
    _draw(data=drawn | {"block_style": TOKENS_STYLE, "token_style": TOKEN_STYLE}, key=key)
    st.html(colour_legend_html(CHANNELS[channel_name], drawn["low"], drawn["high"]))
