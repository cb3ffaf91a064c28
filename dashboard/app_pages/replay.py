"""Placeholder."""

import streamlit as st

st.header("replay")
st.info("Coming soon.")
