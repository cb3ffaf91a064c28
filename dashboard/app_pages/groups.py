"""Placeholder."""

import streamlit as st

st.header("groups")
st.info("Coming soon.")
