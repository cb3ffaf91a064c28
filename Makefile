# Two commands for a fresh clone (see README):
#   make run    create .venv, install, train the demo runs (first time) and serve http://127.0.0.1:8501
#   make test   create/update .venv, install, and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/policylens demo --host 127.0.0.1 --port 8501

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
