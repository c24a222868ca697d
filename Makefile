# The venv is (re)built when missing or older than pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint typecheck bench clean

venv: $(STAMP)

# setup.py builds the optional C decoder (cdcflow/_speedups.c): a change to it
# reinstalls, which compiles it again.
$(STAMP): pyproject.toml setup.py cdcflow/_speedups.c
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' -e examples/plugin
	@# bytecode now, as pip does for a package it copies (an editable install is not
	@# copied): every process then starts without compiling, even under
	@# PYTHONDONTWRITEBYTECODE
	$(BIN)/python -m compileall -q cdcflow examples/plugin > /dev/null
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m cdcflow.demo

lint: $(STAMP)
	$(BIN)/ruff check cdcflow tests bench examples
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: $(STAMP)
	$(BIN)/mypy --strict cdcflow

# Three test processes on two cores: most end-to-end tests wait on the emulator, Spark
# or a subprocess; each process starts its own emulator (and Spark session when needed).
TEST_WORKERS ?= 3

test: lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache out
