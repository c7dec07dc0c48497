# Three commands: `make demo` (a trial, offline), `make run` (set up and run the proxy) and
# `make test` (the whole suite, the documentation's strict build included); `make docs` serves
# the documentation.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.credproxy-installed
LISTEN ?= 127.0.0.1:8080

.PHONY: help venv demo run test lint docs docs-build bench clean
.DEFAULT_GOAL := help

help: ## this list (a bare `make` prints it too)
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "make %-11s  %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install credproxy into it

demo: $(STAMP) ## a trial, offline: a local TLS upstream, a real proxy, five requests shown
	$(BIN)/credproxy demo

run: $(STAMP) ## credproxy init, then credproxy run on 127.0.0.1:8080 (LISTEN=, ARGS= change it)
	$(BIN)/credproxy init
	$(BIN)/credproxy run --listen $(LISTEN) $(ARGS)

lint: $(STAMP) ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/mypy

# Without -q: quiet mode hides the warnings that --strict counts, and a broken link would pass.
docs-build: $(STAMP) ## the strict documentation build
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d "$$site"; \
	status=$$?; rm -rf "$$site"; exit $$status

docs: $(STAMP) ## serve the documentation on http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: lint docs-build ## lint, docs-build, every test but the slow: about 25 min on 2 cores (PYTEST_ARGS=)
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP) ## the benchmark (ARGS= for its flags)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench $(ARGS)

clean: ## remove .venv and the caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
