#!/bin/sh
# `make test-latest`: install the newest versions pyproject.toml's ranges allow (not requirements.lock) into a
# separate environment, print them next to the locked ones, and run the browser tests there: every widget of every
# page changed in a real browser, and the pages' safety checks. torch stays at the locked CPU build (the newest
# torch on PyPI is a multi-GB CUDA build); set TORCH_SPEC to try another.
set -eu
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-latest}
rm -rf "$VENV"  # a new environment: pip then takes the newest version of every package the ranges allow
POLICYLENS_UNLOCKED=1 VENV="$VENV" PYTHON="${PYTHON:-python3}" sh scripts/install.sh
"$VENV/bin/python" - <<'PY'
import importlib.metadata

locked = dict(line.strip().split("==") for line in open("requirements.lock") if "==" in line and line[0] != "#")
print("Newest versions allowed, where they differ from requirements.lock:")
for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name, version = dist.metadata["Name"], dist.version.split("+")[0]
    if name != "policylens" and locked.get(name, "") != version:
        print(f"  {name} {locked.get(name, '(not locked)')} -> {version}")
PY
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_browser_widgets.py tests/test_browser.py
