# MetaRoCE top-level targets.  `make demo` and `make test` install what is missing first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean lint

setup:
	@VENV=$(VENV) ./scripts/setup.sh

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m tools.demo

bench: setup
	$(PY) -m tools.bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
