"""Bridges from other trainers to the PolicyLens run log (optional extras: `pip install 'policylens[trl]'`)."""
