# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install compiled serve test lint typecheck pytest bench clean promtool

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH, or: make PYTHON=/path/to/python3.11"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned in constraints.txt so pip never resolves a multi-GB CUDA build here.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The server's hot modules compiled with mypyc (src/tailguard/compiled.py), for the exact
# sources in the tree and cached by their hash (~3 min when they changed, else instant). A failed
# build (no C compiler) leaves pure Python running; `make test` then fails where a compiler exists.
compiled: $(STAMP)
	@$(BIN)/tailguard compiled build || echo "warning: the server runs as pure Python (see above)"

install: $(STAMP) compiled

serve: $(STAMP) compiled
	$(BIN)/tailguard serve $(ARGS)

# promtool (Debian package `prometheus`) backs the alert-rule tests; wrk the load cross-check.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q prometheus >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null)); \
	  else echo "promtool missing: install the Debian package 'prometheus'"; exit 2; fi; }
	@# wrk (Debian package `wrk`) backs the load tester's cross-check; its test skips without it.
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q wrk >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q wrk >/dev/null)); \
	  else echo "wrk missing: install the Debian package 'wrk' (the wrk cross-check test will skip)"; fi; }

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# TAILGUARD_EXPECT_COMPILED: tests/test_compiled.py checks the suite ran on the compiled modules.
pytest: $(STAMP) promtool compiled
	TAILGUARD_EXPECT_COMPILED=1 $(BIN)/pytest -q $(ARGS)

test: lint typecheck pytest

bench: $(STAMP) compiled
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
