# Quick start: `make demo` (set up, then run the main job) and `make test` (set up, then run the tests).
# TORCH picks the torch build; torch==2.13.0 resolves to a CPU build where the package index offers one.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# Test workers (pytest-xdist): two keep a 2-core machine busy while multi-rank tests wait on their peers.
TEST_WORKERS ?= 2

.PHONY: demo test setup clean

$(VENV)/.installed: pyproject.toml $(wildcard setup.py)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/thunderep demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info
