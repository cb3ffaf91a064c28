#!/bin/sh
# Create the virtual environment and install PolicyLens with its test tools, at the versions the suite passed with
# (requirements.lock, as pip constraints). POLICYLENS_UNLOCKED=1 installs the newest versions pyproject.toml allows
# instead (scripts/test_latest.sh does, in a separate environment).
# torch is installed first, on its own: on a machine without an NVIDIA GPU we ask for the CPU build,
# so that pip never pulls the multi-GB CUDA build. Set TORCH_SPEC / TORCH_INDEX_URL to choose yourself.
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "PolicyLens needs Python 3.10 or newer, found " + sys.version.split()[0])'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
LOCK="$(dirname "$0")/../requirements.lock"
if [ "${POLICYLENS_UNLOCKED:-0}" = 1 ]; then
    CONSTRAINTS=""
else
    CONSTRAINTS="-c $LOCK"
fi

if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    TORCH_SPEC=${TORCH_SPEC:-$(grep '^torch==' "$LOCK")}
    if [ -z "${TORCH_INDEX_URL+x}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    fi
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        # Without a reachable CPU index pip falls back to the default index at once (--retries 0).
        $PIP install --retries 0 "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX_URL"
    else
        $PIP install "$TORCH_SPEC"
    fi
fi
# The test suite covers the TRL adapter, so the test environment has the `trl` extra too.
$PIP install $CONSTRAINTS -e '.[dev,trl]'
# The dashboard's figures need only plotly.js's cartesian bundle, a third of the whole one plotly ships: fetched
# once here from the npm registry, checked against its sha512 (dashboard/plotly_bundle.py). Without it the dashboard
# serves plotly's whole bundle (a first visit to a page about half a second slower).
"$VENV/bin/python" -m dashboard.plotly_bundle || true
# verl's own functions are the reference the tests compare the engine's loss rules and mismatch corrections
# against (tests/verl_reference.py). They need only torch: --no-deps keeps Ray, vLLM and the rest out.
$PIP install --no-deps $CONSTRAINTS verl==0.9.1
# verl's wheel also installs its own top-level `tests` and `scripts` packages, which would shadow this project's
# tests/ and scripts/ folders (`from tests.x import ...`): remove those files and their lines of verl's RECORD.
"$VENV/bin/python" - <<'PY'
import importlib.metadata
import os

dist = importlib.metadata.distribution("verl")
stray = [f for f in dist.files or () if f.parts[0] in ("tests", "scripts")]
for f in stray:
    path = f.locate()
    if os.path.isfile(path):
        os.remove(path)
for top in ("tests", "scripts"):
    for folder, _, _ in sorted(os.walk(dist.locate_file(top)), key=lambda w: -len(w[0])):
        if not os.listdir(folder):
            os.rmdir(folder)
record = dist.locate_file(f"verl-{dist.version}.dist-info/RECORD")
if stray and os.path.isfile(record):
    with open(record, encoding="utf-8") as handle:
        lines = handle.readlines()
    with open(record, "w", encoding="utf-8") as handle:
        handle.writelines(line for line in lines if not line.startswith(("tests/", "scripts/")))
PY
