"""PolicyLens dashboard: a Streamlit app over the run log written by the engine."""
