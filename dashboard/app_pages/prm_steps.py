"""Placeholder."""

import streamlit as st

st.header("prm_steps")
st.info("Coming soon.")
