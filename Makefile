# Three commands: `make demo` (a trial, offline), `make run` (set up and run the proxy) and
# `make test` (the whole suite, the documentation's strict build included); `make docs` serves
# the documentation.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.credproxy-installed
LISTEN ?= 127.0.0.1:8080

.PHONY: venv demo run test lint docs docs-build bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/credproxy demo

run: $(STAMP)
	$(BIN)/credproxy init
	$(BIN)/credproxy run --listen $(LISTEN) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Without -q: quiet mode hides the warnings that --strict counts, and a broken link would pass.
docs-build: $(STAMP)
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d "$$site"; \
	status=$$?; rm -rf "$$site"; exit $$status

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: lint docs-build
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
