# One place for the project's everyday commands (each is a plain command you can also type).
# `make` lists them. Everything runs in .venv, made by `make install` (scripts/install.sh).

PY := .venv/bin/python
# Made again when pyproject.toml changes (a stamp: .venv/bin/python is a link to the system's).
STAMP := .venv/.installed

.DEFAULT_GOAL := help
.PHONY: help install test-fast test versions lint types docs bench soak wheel

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP) ## .venv with the project and its test extras (and redis-server when missing)

$(STAMP): pyproject.toml
	bash scripts/install.sh test,docs
	touch $(STAMP)

test-fast: $(STAMP) ## the unit, contract and protocol tests: about 2 minutes on 2 cores
	$(PY) -m pytest -n auto -m "not slow"

test: $(STAMP) ## the whole suite, as CI runs it (soaks, clusters, failovers, browser too)
	$(PY) -m pytest -n auto

versions: $(STAMP) ## the Redis-facing tests on Redis 6.2 and Valkey 8.1
	bash scripts/redis-versions.sh

lint: $(STAMP) ## ruff on everything
	$(PY) -m ruff check .

types: $(STAMP) ## mypy --strict on the production code
	$(PY) -m mypy supervisor worker broker

docs: $(STAMP) ## the documentation site, built as CI builds it (warnings fail it)
	$(PY) -m mkdocs build --strict

bench: $(STAMP) ## the throughput table on private servers (python -m bench --help for more)
	$(PY) -m bench

soak: $(STAMP) ## a 10-minute chaos soak of both brokers (README "Chaos soak")
	$(PY) -m bench.chaos --broker both --messages 60000 --seconds 600 --seed 42

wheel: $(STAMP) ## the installed wheel, outside the checkout, runs a short job
	bash scripts/wheel-check.sh
