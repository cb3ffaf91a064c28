# Two commands for a fresh clone (see README):
#   make run    create .venv, install, train the demo runs (first time) and serve http://127.0.0.1:8501
#   make test   create/update .venv, install, and run the whole test suite
# Both install the versions the suite passed with (requirements.lock). Also:
#   make test-latest   the newest versions pyproject.toml allows, in .venv-latest, and the browser tests there
#   make lock          rewrite requirements.lock from .venv (after `make test` passed with new versions)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make test` runs the suite on this many pytest-xdist workers, a module's tests on one (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: run test lint install test-latest lock

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/policylens demo --host 127.0.0.1 --port 8501

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .

test-latest:
	PYTHON=$(PYTHON) sh scripts/test_latest.sh

lock: $(STAMP)
	{ sed -n '/^#/p' requirements.lock; $(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock
