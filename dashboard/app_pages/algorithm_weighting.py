"""Placeholder."""

import streamlit as st

st.header("algorithm_weighting")
st.info("Coming soon.")
